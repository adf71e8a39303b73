"""Weights & Biases logger (rank 0 only; the only module that imports wandb).

``logger.mode=auto`` goes online only when W&B is configured on this machine
(``WANDB_API_KEY``, ``WANDB_MODE``, or an ``api.wandb.ai`` entry from ``wandb login``
in ``~/.netrc``); otherwise the run is written offline under ``<run dir>/wandb`` and
can be uploaded later with ``wandb sync``. It never needs the network to start.

Every metric is plotted against ``trainer/step`` (``define_metric``), so records that
arrive for earlier steps (e.g. debug statistics gathered over a logging interval) land
at their own step.
"""

from __future__ import annotations

import netrc
import os
from typing import Any, Optional

from .config import LoggerConfig

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
        import wandb

        self.mode = resolve_mode(cfg.mode)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            tags=list(cfg.tags) or None,
            dir=run_dir,
            config=config,
            mode=self.mode,
            # console="off": stdout stays ours (progress bar); no system-stats sampler
            # process competing for the CPU cores the training uses.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False),
        )
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    @property
    def run_path(self) -> Optional[str]:
        """Directory of this run's files (``.../wandb/offline-run-...``)."""
        return os.path.dirname(self.run.settings.sync_file) if self.run.settings.sync_file else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "trainer/step": step})

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
