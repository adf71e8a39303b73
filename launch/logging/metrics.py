"""Where metrics go: JSONL files in the run directory and, optionally, W&B.

Rank 0 only. ``metrics.jsonl`` has one JSON object per logged step (``step``,
``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``step_time_s``, ...);
``fp8_stats.jsonl`` and ``debug_stats.jsonl`` hold the FP8 scaling and debug-feature
records (``{"step": s, "fp8/<layer>/<gemm>/<tensor>/<stat>": v, ...}``); the same
records go to W&B under the same names.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from .wandb_logger import WandbLogger

__all__ = ["MetricsSink", "read_jsonl"]

_FILES = {"train": "metrics.jsonl", "fp8": "fp8_stats.jsonl", "debug": "debug_stats.jsonl"}


def _jsonable(v: Any) -> Any:
    # JSON has no NaN/inf: keep them visible as strings rather than dropping the record.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """All records of a JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsSink:
    """JSONL files (+ W&B) for one run; a no-op object on ranks != 0.

    Args:
        run_dir: the run directory.
        enabled: True on rank 0.
        wandb: the W&B logger, or None (``logger=none``).
        resume_step: the step training starts after; records of later steps already in
            the files (written by an attempt that crashed, or by an earlier run in the same
            directory) are dropped, so the files hold one trajectory.
    """

    def __init__(self, run_dir: str, enabled: bool, wandb: Optional[WandbLogger], resume_step: int = 0) -> None:
        self.enabled = enabled
        self.wandb = wandb
        self.paths = {k: os.path.join(run_dir, v) for k, v in _FILES.items()}
        self._files: dict[str, Any] = {}
        if not enabled:
            return
        for kind, path in self.paths.items():
            if os.path.exists(path):
                kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= resume_step]
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
                os.replace(tmp, path)

    def _write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = open(self.paths[kind], "a", buffering=1)
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        f.write(json.dumps(record) + "\n")

    def log(self, step: int, train: dict[str, float], fp8: Optional[dict[str, float]] = None) -> None:
        """Training metrics (and FP8 statistics) of ``step``: one W&B row."""
        if not self.enabled:
            return
        self._write("train", step, train)
        if fp8:
            self._write("fp8", step, fp8)
        if self.wandb is not None:
            self.wandb.log(step, {**train, **(fp8 or {})})

    def log_debug(self, records: list[tuple[int, dict[str, float]]]) -> None:
        """Debug-feature statistics, each at its own step."""
        if not self.enabled:
            return
        for step, rec in records:
            self._write("debug", step, rec)
            if self.wandb is not None:
                self.wandb.log(step, rec)

    def close(self, exit_code: int = 0) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self.wandb is not None:
            self.wandb.finish(exit_code)
            self.wandb = None
