"""The end-of-step FP8 work of a replayed step: recorded once, run outside the replay.

An eager FP8 step does Python bookkeeping around its casts: every delayed-scaling
quantizer joins the step's amax reduction (``AutocastContext.track_forward``, the
backward tracker's ``track``), the outermost ``autocast`` exit reduces and updates the
forward quantizers, and a callback queued on the autograd engine
(``queue_callback``) does the same for the gradient quantizers after backward. A
replayed step -- a CUDA graph (``tp_fuse.make_graphed_callables``), or any recorded
sequence of ops -- runs the casts' kernels (which fold amaxes into the history slots
and write current scaling's scale and counters in place) but none of that Python.

So the graphed path works like Transformer Engine's:

1. :func:`record_fp8_step` around the warm-up steps: the reductions are *recorded*
   (which quantizers, which group, which direction), not run; the autocast exit and
   the backward callback update nothing.
2. :func:`reset_fp8_state` then puts every quantizer back to its state before the
   warm-up (a quantizer born during the warm-up: its initial state), and fixes the
   delayed-scaling groups (``fix_delayed_groups``), so the captured addresses are the
   static ones. Nothing is rebound after this point.
3. After each replayed backward, :meth:`FP8StepMembership.reduce_and_update` runs the
   recorded reductions with fixed membership, outside the graphs: per (direction,
   group) one all-reduce(MAX) and one fused scale update, exactly the eager ones (the
   forward direction's update after backward is bit-identical to eager's at the
   autocast exit: no backward op reads a forward quantizer's scale).

Current scaling needs no end-of-step work: its cast computes the scale and writes
``scale``/``last_amax``/counters in place, inside the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
import torch.distributed as dist

from . import amax_reduction
from .amax_reduction import reduce_amaxes
from .float8.current_scaling import CurrentScalingQuantizer
from .float8.delayed_scaling import DelayedScalingQuantizer, fix_delayed_groups, update_delayed_quantizers
from .op_quantizers import make_quantizer
from .quantizer import Quantizer

__all__ = ["FP8StepMembership", "find_quantizers", "record_fp8_step", "reset_fp8_state", "snapshot_fp8_state"]

#: The state tensors of the quantizers whose state a replay writes.
_STATE = {
    DelayedScalingQuantizer: ("scale", "amax_history", "last_amax", "nonfinite_amax_count"),
    CurrentScalingQuantizer: ("scale", "last_amax", "nonfinite_amax_count", "zero_amax_count"),
}


#: One recorded reduction: its group and its quantizers by ``id``, in first-seen order.
_Entry = tuple[Optional[dist.ProcessGroup], dict[int, DelayedScalingQuantizer]]


class FP8StepMembership:
    """The delayed-scaling reductions of one step, fixed: ``(direction, group,
    reduce_amax) -> quantizers`` in first-seen order (every rank records in program
    order, so slot ``i`` of a collective names the same quantizer on all ranks)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int, bool], _Entry] = {}

    def _record(self, direction: str, group: Optional[dist.ProcessGroup], reduce_amax: bool,
                quantizers: list[DelayedScalingQuantizer]) -> None:
        _, members = self._entries.setdefault((direction, id(group), reduce_amax), (group, {}))
        for q in quantizers:
            members.setdefault(id(q), q)

    def quantizers(self, direction: Optional[str] = None) -> list[DelayedScalingQuantizer]:
        """The recorded quantizers (of ``direction``: "forward"/"backward", or both)."""
        return [q for (d, _, _), (_, members) in self._entries.items() if direction in (None, d)
                for q in members.values()]

    def reduce_and_update(self, forward: Optional[bool] = None) -> None:
        """The recorded end-of-step work (``forward`` True/False: one direction; None:
        both): one all-reduce(MAX) per recorded (direction, group), then one fused scale
        update over all their quantizers (one kernel per group of
        :func:`~tp_fuse.quantization.quantizer.fix_delayed_groups`; rows are updated
        independently, so this equals eager's per-direction updates bit for bit).
        Outside any graph: Python, collectives and the update kernels only."""
        selected: dict[int, DelayedScalingQuantizer] = {}
        for (d, _, reduce_amax), (group, members) in self._entries.items():
            if members and (forward is None or forward == (d == "forward")):
                reduce_amaxes(list(members.values()), group, reduce_amax)
                selected.update(members)
        if selected:
            update_delayed_quantizers(list(selected.values()))

    def __len__(self) -> int:
        return sum(len(m) for _, m in self._entries.values())


@contextlib.contextmanager
def record_fp8_step(membership: FP8StepMembership) -> Iterator[FP8StepMembership]:
    """While inside, the end-of-step amax reductions (autocast exit, end of backward)
    record into ``membership`` instead of running. For warm-up and capture only: a
    step run inside leaves the delayed scales un-updated."""
    amax_reduction._RECORDER.append(membership._record)
    try:
        yield membership
    finally:
        popped = amax_reduction._RECORDER.pop()
        assert popped == membership._record, "record_fp8_step contexts must nest"


def find_quantizers(modules: Iterable[torch.nn.Module]) -> list[Quantizer]:
    """The quantizers built so far by the ops in ``modules`` (and their submodules):
    each op's quantizer set (an attribute with a ``quantizers`` dict, e.g.
    ``OpQuantizers``) and FP8 parameters' own quantizers. Deduplicated, in module order."""
    found: dict[int, Quantizer] = {}
    for root in modules:
        for m in root.modules():
            for v in vars(m).values():
                qs = getattr(v, "quantizers", None) if not isinstance(v, torch.Tensor) else None
                if isinstance(qs, dict):
                    for q in qs.values():
                        if isinstance(q, Quantizer):
                            found.setdefault(id(q), q)
            for p in m.parameters(recurse=False):
                q = getattr(p, "quantizer", None)
                if isinstance(q, Quantizer):
                    found.setdefault(id(q), q)
    return list(found.values())


def snapshot_fp8_state(quantizers: Iterable[Quantizer]) -> dict[int, tuple[Quantizer, dict[str, torch.Tensor]]]:
    """Copies of the state tensors of ``quantizers`` (delayed and current scaling)."""
    snap = {}
    for q in quantizers:
        names = _STATE.get(type(q))
        if names is not None:
            snap[id(q)] = (q, {n: getattr(q, n).detach().clone() for n in names})
    return snap


@torch.no_grad()
def reset_fp8_state(quantizers: Iterable[Quantizer], snapshot: dict) -> None:
    """Write back, in place, the state ``snapshot`` holds for each quantizer, or the
    initial state of a fresh quantizer of its recipe and role for one born after the
    snapshot (the warm-up made it); then fix the delayed-scaling groups."""
    quantizers = list(quantizers)
    for q in quantizers:
        names = _STATE.get(type(q))
        if names is None:
            continue
        saved = snapshot.get(id(q))
        if saved is not None and saved[0] is q:
            values = saved[1]
        else:
            fresh = make_quantizer(q.recipe, q.role)
            values = {n: getattr(fresh, n) for n in names}
        for n in names:
            getattr(q, n).copy_(values[n])
    fix_delayed_groups(quantizers)
