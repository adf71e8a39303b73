"""The end-of-run summary block that rank 0 prints when training ends normally.

The last progress line (``step 300/300 ...``) says nothing about the run as a whole; a
practitioner then looks for the final losses, how long it took, the mean throughput, the
MFU, the peak memory, and where everything went (run directory, last checkpoint, W&B
files and how to upload them). :func:`summary_lines` puts these in one block::

    [tp-fuse] run summary:
      steps            300/300 (steps 1-300 trained in this run)
      final loss       train 2.4012 (step 300), val 2.5120 (step 300)
      time             1m02s in total; 205 ms/step mean (leaving out the first step: start-up)
      ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .report import format_eta

__all__ = ["RunSummary", "summary_lines"]


@dataclass
class RunSummary:
    """What the summary reports (rank 0's view; losses are already averaged over DP).

    ``totals`` is :meth:`tp_fuse.launch.logging.report.StepMeter.totals`; ``mfu_note``
    says why MFU is missing (peak unknown or proven wrong), ``peak_source`` the peak and
    where it came from (:attr:`tp_fuse.launch.logging.peak.PeakFlops.short`); ``wandb`` is the W&B line (None: ``logger=none``);
    ``compile`` the torch.compile line (None: not compiled).
    """

    start_step: int
    last_step: int
    max_steps: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    wall_s: float
    totals: dict[str, float]
    peak_source: str
    mfu_note: Optional[str]
    peak_mem_gib: float
    mem_what: str
    run_dir: str
    checkpoint: Optional[str]
    checkpoint_hint: str
    wandb: Optional[str]
    stopped_by: Optional[str] = None
    compile: Optional[str] = None  # trainer.compile=true: graphs, breaks, compile time (compile_stats)


def _row(label: str, text: str) -> str:
    return f"  {label:<16} {text}"


def summary_lines(s: RunSummary) -> list[str]:
    """The block's lines (the first one is ``[tp-fuse] run summary:``)."""
    trained = sorted(s.losses)
    steps = f"{s.last_step}/{s.max_steps}"
    if trained:
        steps += f" (steps {trained[0]}-{trained[-1]} trained in this run)"
    if s.stopped_by:
        steps += f"; stopped early by {s.stopped_by}"
    loss = f"train {s.losses[trained[-1]]:.4f} (step {trained[-1]})" if trained else "train n/a (no step trained)"
    if s.val_losses:
        last_val = max(s.val_losses)
        loss += f", val {s.val_losses[last_val]:.4f} (step {last_val})"
    else:
        loss += ", val n/a (no validation ran)"
    t = s.totals
    lines = ["[tp-fuse] run summary:", _row("steps", steps), _row("final loss", loss)]
    if t.get("steps"):
        wall = f"{s.wall_s:.1f}s" if s.wall_s < 60 else format_eta(s.wall_s)
        lines.append(_row("time", f"{wall} in total (with validation and checkpoints); "
                                  f"{t['mean_step_s'] * 1e3:,.0f} ms/step mean"
                                  + (" (leaving out the first step: start-up)" if t["steps"] > 1 else "")))
        lines.append(_row("throughput", f"{t['tokens_per_s']:,.0f} tokens/s (all training tokens / time in steps)"))
    if "mfu" in t:
        lines.append(_row("MFU", f"{t['mfu']:.1%} of a peak of {s.peak_source}"))
    else:
        lines.append(_row("MFU", f"n/a ({s.mfu_note or 'no step timed'})"))
    if s.compile is not None:
        lines.append(_row("torch.compile", s.compile))
    lines.append(_row("peak memory", f"{s.peak_mem_gib:.2f} GiB ({s.mem_what}, rank 0)"))
    lines.append(_row("run dir", s.run_dir))
    lines.append(_row("last checkpoint", s.checkpoint or f"none ({s.checkpoint_hint})"))
    lines.append(_row("W&B", s.wandb or "off (logger=none)"))
    return lines
