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
import sys
from collections.abc import Iterator
from typing import IO, Any, Optional

from tp_fuse.safe_files import atomic_writer, open_append, open_regular_file

from .wandb_logger import WandbLogger

__all__ = ["MetricsSink", "read_jsonl"]

_FILES = {"train": "metrics.jsonl", "fp8": "fp8_stats.jsonl", "debug": "debug_stats.jsonl"}
#: Longest line a metrics file may have: an FP8 statistics record of a very large model
#: (8 statistics x 3 tensors x 4 GEMMs x layers) is well below a MiB.
MAX_LINE_BYTES = 64 << 20


def _jsonable(v: Any) -> Any:
    # JSON has no NaN/inf: keep them visible as strings rather than dropping the record.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _records(f: IO[bytes], path: str) -> Iterator[tuple[int, dict[str, Any], bytes, bool]]:
    """``(line number, record, raw line, torn)`` for every non-blank line of an open JSONL file.

    A last line that does not parse and has no newline is a write cut short (a crash, a
    full disk): it is yielded once with ``torn=True`` and an empty record. Any other line
    that is not a JSON object with an integer ``step`` is a ValueError naming the line.
    """
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise ValueError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES} bytes; not a metrics file?")
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            if not raw.endswith(b"\n") and not f.read(1):
                yield lineno, {}, raw, True
                return
            raise ValueError(f"{path}:{lineno}: not a JSON record ({type(exc).__name__}: {exc}); move the file "
                             "away to start it afresh") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with an integer 'step', got {raw[:80]!r}")
        yield lineno, record, raw, False


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """All records of a JSONL file written by :class:`MetricsSink` (a torn last line is left out).

    The file must be a regular file (a link, FIFO or device is a ValueError).
    """
    with open_regular_file(path, "metrics file") as f:
        return [record for _, record, _, torn in _records(f, path) if not torn]


def _truncate_to_step(path: str, resume_step: int) -> None:
    """Keep the records of steps <= ``resume_step`` in ``path`` (streamed, then renamed in place);
    report and drop a torn last line."""
    name = os.path.basename(path)
    with open_regular_file(path, "metrics file") as src, atomic_writer(path, fsync=False) as dst:
        for lineno, record, raw, torn in _records(src, path):
            if torn:
                print(f"[tp-fuse] {name}: line {lineno} ({len(raw)} bytes) was cut short (a crash or a full disk "
                      "while it was written); dropped it", file=sys.stderr, flush=True)
            elif record["step"] <= resume_step:
                dst.write(raw if raw.endswith(b"\n") else raw + b"\n")


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
        for path in self.paths.values():
            if os.path.lexists(path):  # lexists: a planted link is refused by the reader, not skipped
                _truncate_to_step(path, resume_step)

    def _write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = open_append(self.paths[kind], "metrics file")
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
