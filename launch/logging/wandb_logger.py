"""Weights & Biases logger (rank 0 only; the only module that imports wandb).

``logger.mode=auto`` goes online only when W&B is configured on this machine
(``WANDB_API_KEY``, ``WANDB_MODE``, or an ``api.wandb.ai`` entry from ``wandb login``
in ``~/.netrc``); otherwise the run is written offline under ``<run dir>/wandb`` and
can be uploaded later with ``wandb sync``. An online start that fails (no network,
unreachable server) falls back to offline with a warning (``tp_fuse.launch.logging.wandb_safe``), and a
restart in the same run directory continues the same W&B run.

Every metric is plotted against ``trainer/step`` (``define_metric``), so records that
arrive for earlier steps (e.g. debug statistics gathered over a logging interval) land
at their own step.
"""

from __future__ import annotations

import netrc
import os
import sys
import threading
from typing import Any, Optional

from tp_fuse.kernels.fp8_emulation import declare_matmul_free_threads

from ..config import LoggerConfig
from .wandb_safe import init_with_fallback, run_id_for, sync_hint

__all__ = ["WandbLogger", "resolve_mode"]


def _has_netrc_key() -> bool:
    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str) -> str:
    """``online`` / ``offline`` for ``logger.mode`` (``auto``: online iff W&B is configured)."""
    if mode != "auto":
        return mode
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode:
        return env_mode
    if os.environ.get("WANDB_API_KEY") or _has_netrc_key():
        return "online"
    return "offline"


class WandbLogger:
    """One W&B run in ``run_dir``.

    Args:
        cfg: the ``logger`` config group.
        run_dir: the training run directory (W&B writes ``run_dir/wandb``).
        config: the run's configuration, logged with it.
    """

    def __init__(self, cfg: LoggerConfig, run_dir: str, config: dict[str, Any]) -> None:
        self.requested_mode = resolve_mode(cfg.mode)
        self._failed = False
        if self.requested_mode == "disabled":
            # WANDB_MODE=disabled: W&B would only return a run that drops everything, after
            # an import and a thread that cost every process about a second of start-up.
            self.run, self.mode = None, "disabled"
            return
        import wandb  # optional heavy dependency: imported only when a run is really logged


        def settings(**extra: Any) -> Any:
            # console="off": stdout stays ours (progress bar); no system-stats sampler
            # process competing for the CPU cores the training uses.
            return wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False, **extra)

        init_kwargs = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            tags=list(cfg.tags) or None,
            dir=run_dir,
            config=config,
            # The same W&B run across elastic restarts and resumes in this run directory.
            id=run_id_for(run_dir),
            resume="allow",
        )
        before = set(threading.enumerate())
        self.run, self.mode = init_with_fallback(wandb, self.requested_mode, init_kwargs, settings, cfg.init_timeout_s)
        # W&B's own threads (one even with WANDB_MODE=disabled) move data, never run a
        # matmul: they need not keep the CPU FP8 GEMMs off the AMX-BF16 units.
        declare_matmul_free_threads(set(threading.enumerate()) - before)
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    def describe(self) -> str:
        """One line for the start of the log: online (with the URL) or offline (with how to sync)."""
        if self.mode == "online":
            url = getattr(self.run, "url", None) or ""
            return f"W&B: online, run {self.run.id} {url}".rstrip()
        if self.mode == "disabled":
            return "W&B: disabled (WANDB_MODE=disabled)"
        return f"W&B: offline, run {self.run.id}; upload it later with: {sync_hint(self.run)}"

    def summary_line(self) -> str:
        """For the end-of-run summary: the mode, the run's files, and how to upload them if offline."""
        where = self.run_path or "<run dir>/wandb"
        if self.mode == "online":
            url = getattr(self.run, "url", None) or ""
            return f"online, run {self.run.id} {url}; files in {where}".replace("  ", " ")
        if self.mode == "disabled":
            return "disabled (WANDB_MODE=disabled)"
        return f"offline, files in {where}; upload them with: {sync_hint(self.run)}"

    @property
    def run_path(self) -> Optional[str]:
        """Directory of this run's files (``.../wandb/offline-run-...``)."""
        if self.run is None or not self.run.settings.sync_file:
            return None
        return os.path.dirname(self.run.settings.sync_file)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._failed or self.run is None:
            return
        try:
            self.run.log({**metrics, "trainer/step": step})
        except Exception as exc:  # W&B must never stop the training: warn once, keep the JSONL files
            self._failed = True
            print(f"[tp-fuse] WARNING: W&B logging failed ({type(exc).__name__}: {exc}); "
                  "W&B logging stops, metrics.jsonl continues", file=sys.stderr, flush=True)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as exc:
            print(f"[tp-fuse] WARNING: W&B finish failed ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
