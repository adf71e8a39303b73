"""Per-tensor FP8 casts written as ATen ops, for compiled graphs on the CUDA path.

On CUDA (and in strict-CUDA mode on CPU) a compiled FP8 Linear casts its operands with
the ops below instead of the opaque ``tp_fuse::fp8_cast``: inductor then sees ``max |x|``,
the scale, the clamp, ``.to(float8)`` and the transposed copy, and fuses them with the
op that produced ``x`` (a LayerNorm, an activation, the previous GEMM's epilogue) --
torchao's float8 design. The quantizer's state is written with ``copy_`` / ``add_`` on
its buffers, which dynamo lifts as graph inputs: AOTAutograd functionalizes the writes
and copies the final values back into the same buffers after the graph (forward) or the
backward graph (gradient casts), so the state after a compiled step is eager's.

**Binding the quantizers.** A graph reads the buffers of the quantizers the op's
``OpQuantizers`` holds when dynamo traces it, through attribute reads that are graph
inputs (re-read on every call). Those quantizers must exist for the recipe in force and
live on the operand's device before the reads are traced: :func:`traced_quantizers`
makes sure of that with one eager call at trace time (``comptime``: run while dynamo
traces, not recorded in the graph), exactly what an eager op does at its first forward
(``OpQuantizers.get``, the state moved to the device once). Nothing of it runs at graph
run time: a recipe change that rebuilds the quantizers changes the traced
``CompileKey`` (it carries the recipe's fields), which fails dynamo's guard and traces
again. An op whose quantizers did not exist yet when a graph shared by several layers
was traced would make dynamo trace once more for it (the guard on the quantizer dict
fails) -- once per layer of a model compiled before any eager step, past dynamo's
recompile limit -- so the trace-time binding also binds every ``OpQuantizers`` that has
built no quantizers yet (:func:`bind_unbuilt`), as their ops' first forward would.

Delayed scaling: the cast reads the quantizer's scale and maxes its amax into this step's
history slot (``amax_history[0]``, an in-place write of a graph input); the once-per-step
reduction and scale update stay outside the graph (the outermost ``autocast`` exit, the
end-of-backward callback), as in eager mode. Joining those reductions is Python that must
run at every step: ``tp_fuse::fp8_track`` (an opaque op without tensor outputs) does that
and only that, so inductor still sees the cast itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ...kernels import amax_of
from ...kernels._common import FP8_MAX, abs_max, current_scale_torch, fp8_cast, rows_2d
from ...quantization.autocast import active_autocast
from ...quantization.compile_ref import live_targets
from ...quantization.compile_state import (
    compile_key,
    raise_key_mismatch,
    traced_amax_group,
    traced_key,
)
from ...quantization.float8.current_scaling import CurrentScalingQuantizer
from ...quantization.float8.delayed_scaling import DelayedScalingQuantizer
from ...quantization.op_quantizers import OpQuantizers
from ...quantization.scaling import nan_to_inf

__all__ = ["bind_quantizers", "bind_unbuilt", "current_scaling_cast", "delayed_scaling_cast", "traced_quantizers"]


def bind_quantizers(owner: OpQuantizers, device: torch.device) -> dict[str, Any]:
    """The quantizers of ``owner`` for the autocast in force, built if needed, their state on
    ``device`` -- what an eager op's forward does first (eager Python; at trace time)."""
    state = active_autocast()
    if state is None:
        raise_key_mismatch(f"{traced_key()}", None, "tp_fuse compiled FP8 Linear")
    if compile_key(state) != traced_key():
        raise_key_mismatch(f"{traced_key()}", compile_key(state), "tp_fuse compiled FP8 Linear")
    quantizers = owner.get(state.recipe, state.amax_reduction_group)
    for q in quantizers.values():
        q._to_device(device)
    return quantizers


def bind_unbuilt(device: torch.device) -> None:
    """:func:`bind_quantizers` for every live ``OpQuantizers`` that has built no quantizers
    yet (the other layers of a model compiled from its first step): their first compiled
    call then finds what the shared graph reads, instead of failing its guards. Ops that
    later run under another recipe rebuild theirs, as in eager mode."""
    for owner in live_targets(OpQuantizers):
        if not owner.quantizers:
            bind_quantizers(owner, device)


def _bind_at_trace_time(ctx: Any) -> None:
    # Runs inside dynamo's tracing of traced_quantizers (comptime): its locals are the
    # real OpQuantizers and a fake tensor of the operand's device. comptime exposes the
    # traced variable's Python object only through this accessor (no BC promise; a
    # torch without it fails here, loudly, at the first compile).
    owner = ctx.get_local("owner")._i_will_not_complain_if_bc_breaks_VariableTracker().value
    device = ctx.get_local("x").as_fake().device
    if not isinstance(owner, OpQuantizers):
        raise TypeError(f"traced_quantizers: expected an OpQuantizers, got {type(owner).__name__}")
    bind_quantizers(owner, device)
    bind_unbuilt(device)


def traced_quantizers(owner: OpQuantizers, x: torch.Tensor) -> dict[str, Any]:
    """``owner``'s quantizers by role for the recipe in force, state on ``x``'s device.

    Traced: bound once at trace time (module doc), then read as graph inputs. Called
    outside dynamo (``Fp8LinearCudaFunction`` run eagerly): bound now.
    """
    if torch.compiler.is_compiling():
        # Imported while dynamo traces: eager programs must not load torch._dynamo
        # (tp_fuse/graph_breaks.py).
        from torch._dynamo.comptime import comptime

        comptime(_bind_at_trace_time)
        return owner._quantizers
    return bind_quantizers(owner, x.device)


def _reduce_max(amax: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``CurrentScalingQuantizer._reduce`` traced: MAX over the amax group, fp32 on the
    wire, NaN as +inf (every rank then agrees); the local amax without a group."""
    if group is None or dist.get_world_size(group) == 1:
        return amax
    wire = nan_to_inf(amax.float()).reshape(1)
    return funcol.wait_tensor(funcol.all_reduce(wire, "max", group)).reshape(())


def current_scaling_cast(
    x: torch.Tensor, q: CurrentScalingQuantizer, transpose: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Current scaling's cast of ``x`` with quantizer ``q``, as ATen ops (no autograd).

    Shapes::

        x          [..., cols]   high precision
        data       [..., cols]   q.fp8_dtype, contiguous
        data_t     [cols, rows]  q.fp8_dtype, contiguous (``transpose``), else None
        scale_inv  []            fp32

    The math of eager ``CurrentScalingQuantizer.quantize`` (``kernels.amax_of``, the group
    reduction, ``kernels.quantize_current_scaling``'s torch path)::

        amax  = max |x| (x's dtype; MAX over the traced amax group)
        scale = current_scale_torch(amax): fp8_max / amax in float64, clamped to fp32's
                range, [rounded down to a power of two], to fp32; 1.0 for 0 / NaN / inf
        data  = cast(x * scale) saturated, RTNE;  scale_inv = 1 / scale
        q.scale = scale; q.last_amax = amax; q.nonfinite_amax_count += amax non-finite;
        q.zero_amax_count += amax == 0            (in place: mutated graph inputs)
    """
    x = x.detach()
    amax = _reduce_max(amax_of(x), traced_amax_group())
    scale, nonfinite, zero = current_scale_torch(amax, FP8_MAX[q.fp8_dtype], q.power_2_scale)
    q.scale.copy_(scale)
    q.last_amax.copy_(amax)
    q.nonfinite_amax_count.add_(nonfinite)
    q.zero_amax_count.add_(zero)
    data2d = fp8_cast(rows_2d(x), scale, q.fp8_dtype).contiguous()
    data_t = data2d.t().contiguous() if transpose else None
    return data2d.reshape(x.shape), data_t, torch.reciprocal(scale)


def delayed_scaling_cast(
    x: torch.Tensor, q: DelayedScalingQuantizer, transpose: bool, track: tuple
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Delayed scaling's cast of ``x`` with quantizer ``q``, as ATen ops (no autograd).

    Shapes as :func:`current_scaling_cast`. The math of eager
    ``DelayedScalingQuantizer.quantize`` (``kernels.quantize`` with the history slot as
    ``amax_out``, torch path)::

        data = cast(x * q.scale) saturated, RTNE;  scale_inv = 1 / q.scale
        q.amax_history[0] = max(q.amax_history[0], max |x|)   (in place; NaN propagates)

    The scale is last update's; this step's amax is reduced and turned into the next scale
    at the end of the step, outside the graph: ``tp_fuse::fp8_track`` joins the reduction
    (``track``: its ``(owner ref, role, recipe, forward dtype)``) and hands back the scale
    to cast with, a value the backward saves rather than re-reads (see that op).
    """
    x = x.detach()
    slot = q.amax_history[0]
    folded = torch.maximum(slot, abs_max(x))
    slot.copy_(folded)
    scale = torch.ops.tp_fuse.fp8_track(folded, q.scale, *track)
    data2d = fp8_cast(rows_2d(x), scale, q.fp8_dtype).contiguous()
    data_t = data2d.t().contiguous() if transpose else None
    return data2d.reshape(x.shape), data_t, torch.reciprocal(scale)
