"""FP8 comm/GEMM overlap windows inside compiled graphs: ``tp_fuse::ub_linear_fp8``.

Under a per-tensor FP8 recipe (``DelayedScaling``, ``Float8CurrentScaling``) the eager
fuser's userbuffers ops run their GEMMs in FP8 (and all-gather FP8 bytes). As for high
precision (``overlap.py``: ``tp_fuse::ub_linear``), the window is ONE graph node whose real
implementation is the eager fused forward, run at graph run time under the autocast in
force, and whose autograd formula runs the eager fused backward. What differs is what
crosses from forward to backward: the FP8 operands the backward GEMMs read -- this rank's
input and the weight as FP8 bytes with their ``scale_inv`` -- are outputs of the forward
op (plain tensors: the graph saves them, as eager saves the Float8Tensors) and inputs of
the backward op, which wraps them again; the gradient quantizer and the backward amax
tracker, which eager ops keep in their context, are bound per window by its last forward
(the rule of ``tp_fuse::fp8_cast``). The quantizers' state is updated by the eager code in
eager's order, so compiled == eager bit for bit under ``aot_eager`` (tested on 2 ranks).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ...quantization import Float8Tensor, active_autocast
from ...quantization.compile_ref import CompileRef
from ...quantization.compile_state import compile_key, raise_key_mismatch
from .overlap import ub_linear_fake, unaliased, window_backward, window_forward

__all__ = ["ub_linear_fp8", "ub_linear_fp8_backward"]


class _Fp8Binding(NamedTuple):
    """What the eager fused forward leaves in the BasicLinear's context for the backward's
    gradient cast: the op's grad_output quantizer and the backward amax tracker."""

    grad_quantizer: Any
    grad_tracker: Any


@torch.library.custom_op("tp_fuse::ub_linear_fp8", mutates_args=())
def ub_linear_fp8(
    x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], window: CompileRef, tp: int, mode: str,
    recipe: str, fwd_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ub_linear` under a per-tensor FP8 recipe: the eager fused forward with FP8 GEMMs
    (its FP8 all-gather of the input for ``all_gather``), run at graph run time under the
    autocast in force, which must be the one traced for (``recipe``, ``fwd_dtype``).

    Returns ``(y, x_data, x_scale_inv, w_data, w_scale_inv)``: ``y`` as :func:`ub_linear`'s,
    then the FP8 operands the backward reads -- this rank's input as ``[rows, in]`` FP8
    bytes (``fwd_dtype``, contiguous) and the weight's ``[out, in]``, each with its 0-d fp32
    ``scale_inv``: value = bytes * scale_inv. The quantizers' state is updated as in eager
    mode (the casts join the step's amax reduction); the gradient quantizer and tracker are
    bound for the backward that follows (the last forward of this window binds them).
    """
    owner = window.target()
    actual = compile_key(active_autocast())
    if actual is None or actual.recipe != recipe or actual.fwd_dtype != fwd_dtype:
        raise_key_mismatch(f"{recipe} with forward dtype {fwd_dtype}", actual, "tp_fuse::ub_linear_fp8")
    y, lin_ctx = window_forward(window, x, w, b, "tp_fuse::ub_linear_fp8")
    x_q, w_q = lin_ctx.to_save
    if not (lin_ctx.fp8 and isinstance(x_q, Float8Tensor) and isinstance(w_q, Float8Tensor)):
        raise RuntimeError("tp_fuse::ub_linear_fp8: the fused forward did not save per-tensor FP8 operands")
    # Bound on the window's state for the backward that follows (eager ops keep it in their
    # autograd context; the same rule as tp_fuse::fp8_cast's).
    owner.fp8_backward = _Fp8Binding(lin_ctx.grad_quantizer, lin_ctx.grad_tracker)
    outputs = [y, x_q._fp8.contiguous(), x_q._sinv, w_q._fp8.contiguous(), w_q._sinv]
    return tuple(unaliased(outputs, [x, w, b]))


@ub_linear_fp8.register_fake
def _ub_linear_fp8_fake(x, w, b, window, tp, mode, recipe, fwd_dtype):
    cols = x.shape[-1]
    rows = x.numel() // cols
    scalar = x.new_empty((), dtype=torch.float32)
    return (ub_linear_fake(x, w, b, window, tp, mode), x.new_empty((rows, cols), dtype=fwd_dtype), scalar,
            w.new_empty(w.shape, dtype=fwd_dtype), torch.empty_like(scalar))


@torch.library.custom_op("tp_fuse::ub_linear_fp8_backward", mutates_args=())
def ub_linear_fp8_backward(
    dy: torch.Tensor, x_data: torch.Tensor, x_scale_inv: torch.Tensor, w_data: torch.Tensor,
    w_scale_inv: torch.Tensor, x_shape: list[int], w: torch.Tensor, b: Optional[torch.Tensor],
    window: CompileRef, tp: int, mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`ub_linear_fp8`: :func:`ub_linear_backward`'s equations with the
    eager FP8 backward (``dy`` cast by the bound gradient quantizer, FP8 GEMMs), on the FP8
    operands the forward returned (``x_shape``: the forward input's shape). ``(dx, dW, db)``."""
    binding = window.target().fp8_backward
    if binding is None:
        raise RuntimeError("tp_fuse::ub_linear_fp8_backward: no FP8 forward of this window ran before its backward")
    saved = (Float8Tensor.wrap_checked(x_data, x_scale_inv, dy.dtype),
             Float8Tensor.wrap_checked(w_data, w_scale_inv, w.dtype))
    return window_backward(window, dy, saved, x_shape, w, b, tp, mode, fp8=binding)


@ub_linear_fp8_backward.register_fake
def _ub_linear_fp8_backward_fake(dy, x_data, x_scale_inv, w_data, w_scale_inv, x_shape, w, b, window, tp, mode):
    return (dy.new_empty(x_shape), torch.empty_like(w),
            (torch.empty_like(b) if b is not None else dy.new_empty(0)))


def _setup_context_fp8(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, w, b, window, tp, mode, _, _ = inputs
    _, x_data, x_sinv, w_data, w_sinv = output
    ctx.mark_non_differentiable(x_data, x_sinv, w_data, w_sinv)
    ctx.save_for_backward(x_data, x_sinv, w_data, w_sinv, w, b)
    ctx.x_shape, ctx.window, ctx.tp, ctx.mode = list(x.shape), window, tp, mode


def _backward_fp8(ctx: Any, dy: torch.Tensor, *unused: Any):
    x_data, x_sinv, w_data, w_sinv, w, b = ctx.saved_tensors
    dx, dw, db = torch.ops.tp_fuse.ub_linear_fp8_backward(
        dy.contiguous(), x_data, x_sinv, w_data, w_sinv, ctx.x_shape, w, b, ctx.window, ctx.tp, ctx.mode
    )
    return dx, dw, (db if b is not None else None), None, None, None, None, None


ub_linear_fp8.register_autograd(_backward_fp8, setup_context=_setup_context_fp8)
