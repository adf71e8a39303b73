"""W&B start-up that never takes the training down, and one W&B run per training run.

* :func:`init_with_fallback`: an online ``wandb.init`` that fails (no network, server
  unreachable, bad key: wandb raises after ``init_timeout``) is torn down and the run
  starts again **offline** in the same directory, with one clear warning naming the
  cause and the command that uploads it later. Training never waits longer than
  ``logger.init_timeout_s`` for W&B and never stops because of it.
* :func:`run_id_for`: the W&B run id lives in ``<run dir>/wandb/run_id`` (created by the
  first start), so an elastic restart or a resume in the same run directory continues
  the same W&B run instead of creating a second one.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from typing import Any, Callable

from tp_fuse.safe_files import read_regular_file, write_atomic

__all__ = ["init_with_fallback", "run_id_for", "sync_hint"]

_ID_RE = re.compile(r"[a-z0-9]{1,64}")
_ID_FILE_LIMIT = 4096


def run_id_for(run_dir: str) -> str:
    """The W&B run id of ``run_dir`` (read from ``wandb/run_id``, created on first use).

    A file that does not hold a plain id (lower-case letters and digits) is an error:
    it names the file instead of passing its content to W&B.
    """
    path = os.path.join(run_dir, "wandb", "run_id")
    if os.path.lexists(path):
        run_id = read_regular_file(path, _ID_FILE_LIMIT, "W&B run id file").decode("utf-8", "replace").strip()
        if not _ID_RE.fullmatch(run_id):
            raise ValueError(f"{path}: expected a W&B run id of lower-case letters and digits, got {run_id[:80]!r}")
        return run_id
    run_id = secrets.token_hex(4)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, run_id + "\n", fsync=False)
    return run_id


def sync_hint(run: Any) -> str:
    """``wandb sync <dir>`` for an offline run (its files' directory)."""
    sync_file = getattr(run.settings, "sync_file", None)
    where = os.path.dirname(sync_file) if sync_file else "<run dir>/wandb/offline-run-*"
    return f"wandb sync {where}"


def _warn(text: str) -> None:
    print(f"[tp-fuse] WARNING: {text}", file=sys.stderr, flush=True)


def init_with_fallback(
    wandb: Any,
    mode: str,
    init_kwargs: dict[str, Any],
    settings: Callable[..., Any],
    timeout_s: float,
) -> tuple[Any, str]:
    """``(run, mode actually used)``: ``wandb.init(**init_kwargs)`` in ``mode``; an
    online start that fails is retried offline (never raises for network trouble).

    ``settings(**extra)`` builds the ``wandb.Settings`` (called once per attempt).
    """
    if mode == "online":
        try:
            run = wandb.init(mode="online", settings=settings(init_timeout=timeout_s), **init_kwargs)
            return run, "online"
        except Exception as exc:  # CommError, UsageError, AuthenticationError, ...: W&B's, not ours
            # The failed attempt still holds the run id in wandb's service process.
            wandb.teardown()
            cause = " ".join(str(exc).split())[:200]
            _warn(f"W&B could not start online ({type(exc).__name__}: {cause}); "
                  "logging offline instead (metrics.jsonl and fp8_stats.jsonl are written as usual)")
        mode = "offline"
    run = wandb.init(mode=mode, settings=settings(), **init_kwargs)  # offline, or WANDB_MODE=disabled
    return run, mode
