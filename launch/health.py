"""Non-finite steps: detect them, skip them, and stop a run that keeps producing them.

A step is *non-finite* when, on any rank, the loss or the gradient norm is NaN/inf, or
an FP8 quantizer met a NaN/inf amax during the step. The last one matters because the
saturating FP8 cast turns inf into a finite number: an inf weight under FP8 gives a
plausible loss and finite gradients, and would otherwise train on silently.

Policy (``trainer.max_nonfinite_steps``): a non-finite step skips the optimizer step;
more than ``max_nonfinite_steps`` of them in a row stop the run with
:class:`TrainingDivergedError`, naming the step, what was not finite and the last good
checkpoint. ``tp_fuse.launch.checkpoint.manager`` separately refuses to save non-finite state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["NonfiniteGuard", "StepHealth", "TrainingDivergedError"]


class TrainingDivergedError(RuntimeError):
    """Training produced more non-finite steps in a row than ``trainer.max_nonfinite_steps`` allows."""


@dataclasses.dataclass
class StepHealth:
    """The verdict on one step (identical on every rank)."""

    finite: bool
    reasons: list[str]  # empty when finite
    in_a_row: int  # consecutive non-finite steps, this one included
    nonfinite_amax_total: int  # cumulative non-finite amaxes met by this rank's quantizers
    stop_signal: int = 0  # a stop signal's number if any rank got one (tp_fuse.launch.preemption), else 0


class NonfiniteGuard:
    """Checks every step once, with one small all-reduce over ``group``.

    Args:
        max_nonfinite_steps: non-finite steps in a row that are skipped; one more stops the run.
        group: the world group (every rank must agree to skip a step).
        device: where the flag tensor lives (the communication device).
        quantizers: returns the FP8 quantizers to watch as ``{name: quantizer}`` (each has an
            int ``nonfinite_amax_count`` tensor); called after every step, since quantizers
            are created at the first FP8 forward.
    """

    def __init__(
        self,
        max_nonfinite_steps: int,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        quantizers: Callable[[], dict[str, object]] = dict,
    ) -> None:
        if max_nonfinite_steps < 0:
            raise ValueError(f"trainer.max_nonfinite_steps must be >= 0, got {max_nonfinite_steps}")
        self.max_nonfinite_steps = max_nonfinite_steps
        self.group = group
        self.device = device
        self.quantizers = quantizers
        self.in_a_row = 0
        self._seen: dict[str, int] = {}  # quantizer name -> count at the last check

    def _amax_news(self) -> tuple[list[str], int]:
        """Quantizers whose non-finite amax count grew since the last check; the total count."""
        grew, total = [], 0
        for name, q in self.quantizers().items():
            count = int(getattr(q, "nonfinite_amax_count"))
            total += count
            if count > self._seen.get(name, 0):
                grew.append(name)
            self._seen[name] = count
        return grew, total

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, stop_signal: int = 0) -> StepHealth:
        """The verdict on ``step`` (a collective over ``group``: call it on every rank).

        ``stop_signal``: the number of a stop signal this rank received (0: none). It rides
        in the same all-reduce (MAX), so that all ranks agree to stop after this step
        without a collective of their own; :attr:`StepHealth.stop_signal` is the result.
        """
        grew, total = self._amax_news()
        local = torch.tensor(
            [float(not math.isfinite(float(loss))), float(bool(grew)), float(not math.isfinite(float(grad_norm))),
             float(stop_signal)],
            dtype=torch.float32, device=self.device,
        )
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        flags = local.tolist()
        loss_bad, amax_bad, norm_bad = (bool(v) for v in flags[:3])
        reasons = []
        if loss_bad:
            reasons.append("loss is NaN/inf")
        if norm_bad:
            reasons.append("gradient norm is NaN/inf")
        if amax_bad:
            where = f" ({', '.join(grew[:3])}{', ...' if len(grew) > 3 else ''})" if grew else " (on another rank)"
            reasons.append(f"an FP8 amax was NaN/inf{where}")
        self.in_a_row = self.in_a_row + 1 if reasons else 0
        return StepHealth(not reasons, reasons, self.in_a_row, total, int(flags[3]))

    def stop_if_diverged(self, step: int, health: StepHealth, last_checkpoint: Optional[str]) -> None:
        """Raise :class:`TrainingDivergedError` once the policy's limit is passed."""
        if health.in_a_row <= self.max_nonfinite_steps:
            return
        where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved"
        raise TrainingDivergedError(
            f"training diverged: step {step} makes {health.in_a_row} non-finite steps in a row "
            f"({'; '.join(health.reasons)}), more than trainer.max_nonfinite_steps={self.max_nonfinite_steps}; "
            f"{where}. Lower optim.lr, check the data, or raise trainer.max_nonfinite_steps"
        )
