"""The FP8 linear layer of compiled graphs on the CUDA path: ``torch._scaled_mm`` traced, with its bias.

On CUDA (and in strict-CUDA mode, where CPU tensors take the CUDA branches) the three
GEMMs of a per-tensor FP8 Linear are ``torch._scaled_mm`` calls in the traced graph --
with the bias epilogue cuBLASLt fuses -- instead of the opaque ``tp_fuse::fp8_gemm`` they
were (removed: it had no bias, so the eager path's fused bias was lost). The casts are ATen ops too
(``traced_cast``: current and delayed scaling), so inductor sees the whole cast; delayed
scaling adds ``tp_fuse::fp8_track`` per cast (joining the step's amax reduction: Python,
no tensors out). When a ``tp_fuse.debug`` observer must see the quantized tensors the
casts stay the opaque ``tp_fuse::fp8_cast``, which runs the eager quantizer and tells the
observer. ``explain`` says which (``cast_mode``).

The CPU's exact emulation (``Fp8LinearFunction``'s traced emulation) is untouched.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...kernels.cuda_rules import cuda_epilogue, scaled_mm_violations
from ...kernels._common import compute_dtype
from ...quantization.compile_ref import CompileRef
from ...quantization.compile_state import CompileKey
from ...quantization.custom_ops import fp8_cast, fp8_track  # noqa: F401  (registers the tp_fuse:: ops)
from ...quantization.float8.current_scaling import CurrentScalingQuantizer
from ...quantization.op_quantizers import OpQuantizers
from ...strict import STRICT_ENV, CudaConformanceError, strict_cuda_enabled
from .traced_cast import current_scaling_cast, delayed_scaling_cast, traced_quantizers

__all__ = ["Fp8LinearCudaFunction", "cast_mode", "scaled_gemm"]


def cast_mode(key: CompileKey, observed: bool) -> str:
    """How a compiled per-tensor FP8 Linear on the CUDA path casts: ``"aten"`` (traced ATen
    ops, inductor fuses them) or ``"custom op"`` (the opaque ``tp_fuse::fp8_cast``: a
    ``tp_fuse.debug`` observer reads the quantized tensors in Python)."""
    return "custom op" if observed else "aten"


def scaled_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``a @ b.T * scale_a * scale_b (+ bias)`` in ``out_dtype`` as one traced
    ``torch._scaled_mm``, with cuBLASLt's rules (``kernels.gemm._fp8_gemm_torch``'s CUDA
    branch, whose results these are).

    Shapes: ``a [M, K]`` FP8 row-major, ``b [N, K]`` FP8 row-major (``b.t()`` is the
    column-major ``mat2``), scales 0-d fp32, ``bias [N]`` or None, out ``[M, N]``.
    The bias is fused for 16-bit outputs, in the output dtype; an fp32 output gets it
    added after; a float64 output is the fp32 GEMM widened. Strict mode checks the call
    against CUDA's rules first (layouts, sizes, dtypes: static while tracing).
    """
    gemm_dtype, fused = cuda_epilogue(out_dtype, bias is not None)
    mat2 = b.t()
    fused_bias = bias.to(out_dtype) if fused else None
    if strict_cuda_enabled():
        issues = scaled_mm_violations(a, mat2, scale_a, scale_b, gemm_dtype, fused_bias)
        if issues:
            raise CudaConformanceError(f"{STRICT_ENV}=1: CUDA's torch._scaled_mm would reject this call: "
                                       + "; ".join(issues))
    y = torch._scaled_mm(a, mat2, scale_a=scale_a, scale_b=scale_b, bias=fused_bias, out_dtype=gemm_dtype)
    if gemm_dtype != out_dtype:
        y = y.to(out_dtype)
    if bias is not None and not fused:
        y = y + bias.to(out_dtype)
    return y


def _cast(
    x: torch.Tensor, quantizers: Optional[dict[str, Any]], owner: OpQuantizers, role: str, key: CompileKey,
    dtype: torch.dtype, transpose: bool, observer: CompileRef,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(data, data_t, scale_inv)`` of ``x`` for ``role``: the traced ATen cast when
    ``quantizers`` are bound (delayed scaling: and ``tp_fuse::fp8_track``), else
    ``tp_fuse::fp8_cast``."""
    if quantizers is not None:
        q = quantizers[role]
        if isinstance(q, CurrentScalingQuantizer):
            return current_scaling_cast(x, q, transpose)
        return delayed_scaling_cast(x, q, transpose, (owner.compile_ref, role, key.recipe, key.fwd_dtype))
    data, data_t, sinv = torch.ops.tp_fuse.fp8_cast(x.detach(), owner.compile_ref, role, key.recipe, dtype,
                                                    transpose, observer)
    return data, data_t if transpose else None, sinv


class Fp8LinearCudaFunction(torch.autograd.Function):
    """``y = x W^T + b`` with FP8 operands (per-tensor scales) on the CUDA path,
    differentiable in x, W and b.

    Shapes: ``x [M, K]`` (high precision), ``W [N, K]``, ``b [N]`` or None, ``y [M, N]``
    in x's dtype. ``q(.)`` the quantizer cast of the role (forward dtype for x and W,
    backward dtype for dy), ``s_*`` its ``scale_inv``, ``q(.)^T`` its transposed bytes
    (K-major for the GEMMs that contract over the other dim). Each GEMM is
    :func:`scaled_gemm` (``torch._scaled_mm``, fp32 accumulation)::

        forward: y  = (q(x) @ q(W)^T) s_x s_W + b
        dgrad:   dx = (q(dy) @ q(W)) s_dy s_W        mat2 = q(W)^T bytes, viewed K-major
        wgrad:   dW = (q(dy)^T @ q(x)) s_dy s_x      q(dy)^T, q(x)^T bytes; in W's dtype
        dbias:   db = sum of dy over rows (in fp32 for 16-bit dy), in b's dtype

    Quantization is straight-through, as in ``BasicLinear``'s eager path, whose numbers
    these are (same quantizer math, same GEMM as ``kernels.fp8_gemm`` on CUDA). Saved for
    backward: the transposed FP8 bytes of x and W and their scales.

    Args (after ``x``, ``weight``, ``bias``): ``owner`` -- the op's ``OpQuantizers``;
    ``key`` -- the ``CompileKey`` traced for; ``need_grad`` -- whether a backward will run;
    ``observer`` -- the ``compile_ref`` of the op's debug hooks, or ``NO_OBSERVER``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        owner: OpQuantizers,
        key: CompileKey,
        need_grad: bool,
        observer: CompileRef,
    ) -> torch.Tensor:
        wgrad = need_grad and weight.requires_grad
        quantizers = traced_quantizers(owner, x) if cast_mode(key, bool(observer)) == "aten" else None
        fwd = key.fwd_dtype
        x_data, x_t, x_sinv = _cast(x, quantizers, owner, "input", key, fwd, wgrad, observer)
        w_data, w_t, w_sinv = _cast(weight, quantizers, owner, "weight", key, fwd, need_grad, observer)
        y = scaled_gemm(x_data, w_data, x_sinv, w_sinv, x.dtype, bias)
        ctx.save_for_backward(x_t, x_sinv, w_t, w_sinv)
        ctx.quantizers, ctx.owner, ctx.key, ctx.observer, ctx.wgrad = quantizers, owner, key, observer, wgrad
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None or not bias.requires_grad else bias.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_t, x_sinv, w_t, w_sinv = ctx.saved_tensors
        dy = dy.contiguous()
        dy_data, dy_t, dy_sinv = _cast(dy, ctx.quantizers, ctx.owner, "grad_output", ctx.key, ctx.key.bwd_dtype,
                                       ctx.wgrad, ctx.observer)
        dx = scaled_gemm(dy_data, w_t, dy_sinv, w_sinv, dy.dtype)
        dw = scaled_gemm(dy_t, x_t, dy_sinv, x_sinv, dy.dtype).to(ctx.weight_dtype) if ctx.wgrad else None
        db = None
        if ctx.bias_dtype is not None:
            # As Bias.bias_grad: accumulated wide, rounded once to the bias dtype.
            db = dy.sum(dim=0, dtype=compute_dtype(dy.dtype)).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None
