"""Amax reduction for delayed scaling: one collective per direction per step.

Every delayed-scaling quantizer used in a step registers its amax slot
(``amax_history[0]``) with an :class:`AmaxReductionBuffer`. At the end of the
step the buffer stacks all slots into one flat tensor, issues ONE
``torch.distributed.all_reduce(op=MAX)`` over the amax reduction group, writes
the reduced values back into the slots, and then updates every quantizer
(new scale, rolled history). All ranks of the group therefore end the step with
identical scales -- needed to all-gather FP8 bytes, and to keep TP ranks'
numerics in lock-step.

The forward direction is reduced when the outermost ``autocast`` exits; the
backward direction by a :class:`BackwardAmaxTracker` that ops save in their
autograd ctx: the first ``track`` of a backward pass queues one callback that
runs when the autograd engine finishes the pass.

The collective is skipped (local update only) when the recipe's
``reduce_amax`` is False, when the group is None and ``torch.distributed`` is
not initialized, or when the group has a single rank. NaN amaxes are turned
into +inf before the collective so that all ranks agree (see
:func:`~tp_fuse.quantization.scaling.nan_to_inf`); both keep the old scale.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

from . import scaling
from .block.quantizer import BlockScalingQuantizer
from .float8.current_scaling import CurrentScalingQuantizer
from .float8.delayed_scaling import DelayedScalingQuantizer, update_delayed_quantizers
from .quantizer import Quantizer, no_grad_if_enabled

__all__ = ["AmaxReductionBuffer", "BackwardAmaxTracker", "reduce_amaxes", "reduce_and_update_quantizers"]


class AmaxReductionBuffer:
    """Amax slots of the delayed-scaling quantizers that reduce together.

    Args:
        group: process group of the reduction (None: the default group, if
            ``torch.distributed`` is initialized; else no reduction).
        reduce_amax: False keeps each rank's own amaxes (no collective).
    """

    def __init__(
        self, group: Optional[dist.ProcessGroup] = None, reduce_amax: bool = True, direction: str = "forward"
    ) -> None:
        assert direction in ("forward", "backward")
        self.group = group
        self.reduce_amax = reduce_amax
        self.direction = direction
        # Insertion-ordered: every rank registers in program order, so slot i
        # names the same quantizer on all ranks of the group.
        self._slots: dict[int, DelayedScalingQuantizer] = {}

    def register(self, quantizer: Quantizer) -> None:
        """Add ``quantizer``'s amax slot to this step's reduction (idempotent)."""
        if not isinstance(quantizer, DelayedScalingQuantizer):
            raise ValueError(
                "AmaxReductionBuffer.register: expected a DelayedScalingQuantizer, got "
                f"{type(quantizer).__name__}"
            )
        self._slots.setdefault(id(quantizer), quantizer)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, quantizer: object) -> bool:
        return self._slots.get(id(quantizer)) is quantizer

    def needs_collective(self) -> bool:
        """Whether :meth:`reduce_and_update` will issue an all-reduce."""
        return _needs_collective(self.group, self.reduce_amax)

    def reduce_and_update(self) -> None:
        """One all-reduce(MAX) over all registered slots, then update them all.

        Empties the buffer, ready for the next step.
        """
        with no_grad_if_enabled():
            self._reduce_and_update()

    def _reduce_and_update(self) -> None:
        quantizers = list(self._slots.values())
        self._slots.clear()
        if not quantizers:
            return
        recorder = _RECORDER[-1] if _RECORDER else None
        if recorder is not None:
            # A recorded (warm-up) step: note the membership, update nothing; the graphed
            # path runs the update itself, outside the graphs (step_record.FP8StepMembership).
            recorder(self.direction, self.group, self.reduce_amax, quantizers)
            return
        reduce_and_update_quantizers(quantizers, self.group, self.reduce_amax)


def reduce_and_update_quantizers(
    quantizers: Sequence[DelayedScalingQuantizer], group: Optional[dist.ProcessGroup], reduce_amax: bool
) -> None:
    """One all-reduce(MAX) of the quantizers' amax slots over ``group`` (when
    :meth:`AmaxReductionBuffer.needs_collective` says so), then their fused scale update.
    The end-of-step work of a buffer, and of a recorded membership replayed by the
    graphed path."""
    with no_grad_if_enabled():
        reduce_amaxes(quantizers, group, reduce_amax)
        update_delayed_quantizers(list(quantizers))


def reduce_amaxes(
    quantizers: Sequence[DelayedScalingQuantizer], group: Optional[dist.ProcessGroup], reduce_amax: bool
) -> None:
    """The all-reduce(MAX) of the quantizers' amax slots over ``group``, written back into
    the slots (nothing when no collective is needed)."""
    if _needs_collective(group, reduce_amax):
        with no_grad_if_enabled():
            # One flat tensor -> one collective, however many quantizers.
            amaxes = scaling.nan_to_inf(torch.stack([q.current_amax for q in quantizers]))
            check_collective("all_reduce", [amaxes], world_size=dist.get_world_size(group), op=dist.ReduceOp.MAX)
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
            for q, amax in zip(quantizers, amaxes.unbind(0)):
                q.amax_history[0] = amax


def _needs_collective(group: Optional[dist.ProcessGroup], reduce_amax: bool) -> bool:
    if not reduce_amax or not dist.is_available() or not dist.is_initialized():
        return False
    return dist.get_world_size(group) > 1


#: Recorders of steps whose end-of-step updates are deferred (innermost last): a plain
#: list, not a ContextVar, because the backward's end-of-pass callback runs on the
#: autograd engine's device thread, which does not inherit the caller's context.
#: Pushed and popped by :func:`tp_fuse.quantization.step_record.record_fp8_step`.
_RECORDER: list[Callable[[str, Optional[dist.ProcessGroup], bool, list[DelayedScalingQuantizer]], None]] = []


class BackwardAmaxTracker:
    """Collects grad quantizers during a backward pass; reduces them at its end.

    Ops take one from ``AutocastContext.backward_tracker`` in forward, save it
    in their autograd ctx, and call ``tracker.track(q)`` in backward for each
    delayed-scaling grad quantizer they used. The first ``track`` of a pass
    queues a single engine callback
    (``torch.autograd.Variable._execution_engine.queue_callback``) that runs
    after the whole backward pass: one all-reduce(MAX) + update of all tracked
    quantizers. Current-scaling quantizers are ignored (nothing to reduce).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, reduce_amax: bool = True) -> None:
        self._buffer = AmaxReductionBuffer(group, reduce_amax, "backward")
        self._queued = False
        # CUDA backward runs on per-device threads; track() may race.
        self._lock = threading.Lock()

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self._buffer.group

    def track(self, quantizer: Quantizer) -> None:
        """Register a grad quantizer used in this backward pass.

        Must be called from inside a backward pass (an autograd function's
        ``backward``): the end-of-pass callback can only be queued there.
        """
        if isinstance(quantizer, (CurrentScalingQuantizer, BlockScalingQuantizer)):
            return
        with self._lock:
            self._buffer.register(quantizer)
            if not self._queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._queued = True

    def pending(self) -> int:
        """Number of quantizers waiting for the end-of-backward reduction."""
        return len(self._buffer)

    def _finish(self) -> None:
        with self._lock:
            self._queued = False
            self._buffer.reduce_and_update()
