"""Non-finite steps: detect them, skip them, and stop a run that keeps producing them.

A step is *non-finite* when, on any rank, the loss or the gradient norm is NaN/inf, or
an FP8 quantizer met a NaN/inf amax during the step. The last one matters because the
saturating FP8 cast turns inf into a finite number: an inf weight under FP8 gives a
plausible loss and finite gradients, and would otherwise train on silently.

Policy (``trainer.max_nonfinite_steps``): a non-finite step skips the optimizer step;
more than ``max_nonfinite_steps`` of them in a row stop the run with
:class:`TrainingDivergedError`, naming the step, what was not finite and the last good
checkpoint. A non-finite step that would be checkpointed, or that is the run's last,
stops it the same way (:meth:`NonfiniteGuard.stop_if_ending_nonfinite`): a resumed
checkpoint with huge finite weights gave NaN at every step, and the run exited 0 having
saved its last step as the newest checkpoint. ``tp_fuse.launch.checkpoint.manager``
separately refuses to save non-finite state.
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
    loss: float = math.nan  # the loss given to check(), read in the same transfer as the verdict
    grad_norm: float = math.nan  # the gradient norm given to check(), likewise


class NonfiniteGuard:
    """Checks every step once, with one small all-reduce over ``group`` and one host read.

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
        self._seen: dict[str, int] = {}  # quantizer name -> count when last named (bad steps only)
        self._seen_total = 0  # this rank's total count at the last check (host int: compared on the device)

    def _amax_total(self) -> torch.Tensor:
        """This rank's total non-finite amax count, as a 0-d int64 tensor on ``self.device``.

        One stacking kernel over the counters that live on the device, no host read: the
        count is read together with the step's other values in :meth:`check`. Counters
        still on the host (block/NVFP4/current quantizers create theirs there and move
        them at their first update, so these are quantizers that never ran) are added
        there: reading host memory does not wait for the device.
        """
        on_device: list[torch.Tensor] = []
        on_host = 0
        for q in self.quantizers().values():
            count = getattr(q, "nonfinite_amax_count")
            if isinstance(count, torch.Tensor) and count.device == self.device:
                on_device.append(count.reshape(()).to(torch.int64))
            else:
                on_host += int(count)
        total = torch.stack(on_device).sum() if on_device else torch.zeros((), dtype=torch.int64, device=self.device)
        return total + on_host if on_host else total

    def _amax_news(self) -> list[str]:
        """Quantizers whose non-finite amax count grew since the last look (one host read each).

        Called only when the total grew (a bad step), so the common step pays nothing for
        naming them. Counts only ever grow during a run, so an unchanged total means no
        quantizer's count grew.
        """
        grew = []
        for name, q in self.quantizers().items():
            count = int(getattr(q, "nonfinite_amax_count"))
            if count > self._seen.get(name, 0):
                grew.append(name)
            self._seen[name] = count
        return grew

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, stop_signal: int = 0) -> StepHealth:
        """The verdict on ``step`` (a collective over ``group``: call it on every rank).

        ``stop_signal``: the number of a stop signal this rank received (0: none). It rides
        in the same all-reduce (MAX), so that all ranks agree to stop after this step
        without a collective of their own; :attr:`StepHealth.stop_signal` is the result.

        Host syncs: exactly one per step in the common (finite) case. The flags are
        computed on the device, all-reduced, and read back in one transfer together with
        ``loss``, ``grad_norm`` and the amax total (returned as :attr:`StepHealth.loss`,
        :attr:`StepHealth.grad_norm` so that the caller need not read them again). One
        read per step remains because the host must know, before the optimizer step,
        whether to take it: the AdamW step count lives on the host (non-capturable AdamW;
        its bias correction is computed in Python doubles, which a device-side step count
        would change), the stop rule names the exact step that passes the limit, and the
        ranks must agree on a stop signal at the same step. A bad step costs one more
        read per quantizer, to name the ones that met a NaN/inf amax.
        """
        loss = loss.detach()
        grad_norm = grad_norm.detach()
        total = self._amax_total()
        local = torch.stack([
            ~torch.isfinite(loss).reshape(()),
            total > self._seen_total,  # this rank's quantizers met a NaN/inf amax during the step
            ~torch.isfinite(grad_norm).reshape(()),
        ]).to(torch.float32)
        local = torch.cat([local, torch.full((1,), float(stop_signal), dtype=torch.float32, device=local.device)])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        # float64 holds the fp32 loss, the fp64 norm and an int64 count below 2**53 exactly.
        packed = torch.cat([local.to(torch.float64), loss.reshape(1).to(torch.float64),
                            grad_norm.reshape(1).to(torch.float64), total.reshape(1).to(torch.float64)])
        values = packed.to("cpu").tolist()  # the step's one host read (a device->host copy on GPU)
        loss_bad, amax_bad, norm_bad = (bool(v) for v in values[:3])
        total_now = int(values[6])
        grew = self._amax_news() if total_now > self._seen_total else []
        self._seen_total = total_now
        reasons = []
        if loss_bad:
            reasons.append("loss is NaN/inf")
        if norm_bad:
            reasons.append("gradient norm is NaN/inf")
        if amax_bad:
            where = f" ({', '.join(grew[:3])}{', ...' if len(grew) > 3 else ''})" if grew else " (on another rank)"
            reasons.append(f"an FP8 amax was NaN/inf{where}")
        self.in_a_row = self.in_a_row + 1 if reasons else 0
        return StepHealth(not reasons, reasons, self.in_a_row, total_now, int(values[3]), values[4], values[5])

    def stop_if_diverged(self, step: int, health: StepHealth, last_checkpoint: Callable[[], Optional[str]]) -> None:
        """Raise :class:`TrainingDivergedError` once the policy's limit is passed.

        ``last_checkpoint`` is asked only then (it lists the checkpoint directory: no file
        system work on the steps that are fine, and none while another rank cleans up).
        """
        if health.in_a_row <= self.max_nonfinite_steps:
            return
        last = last_checkpoint()
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
        raise TrainingDivergedError(
            f"training diverged: step {step} makes {health.in_a_row} non-finite steps in a row "
            f"({'; '.join(health.reasons)}), more than trainer.max_nonfinite_steps={self.max_nonfinite_steps}; "
            f"{where}. Lower optim.lr, check the data, or raise trainer.max_nonfinite_steps"
        )

    def stop_if_ending_nonfinite(self, step: int, health: StepHealth, ending: Optional[str],
                                 last_checkpoint: Callable[[], Optional[str]]) -> None:
        """Raise :class:`TrainingDivergedError` when the non-finite ``step`` would end the run
        or be saved (``ending`` says which; None: neither, the skip policy applies)."""
        if health.finite or ending is None:
            return
        last = last_checkpoint()
        where = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
        raise TrainingDivergedError(
            f"training diverged: step {step} is not finite ({'; '.join(health.reasons)}) and {ending}; a run "
            f"never ends on or saves a non-finite step; {where}. Check the data and the checkpoint it resumed, "
            "or lower optim.lr"
        )
