"""The FP8 linear layer of compiled graphs: custom-op casts and GEMMs under one autograd function.

``BasicLinear``'s eager FP8 path works on ``Float8Tensor`` subclasses, which dynamo cannot
trace through the fuser. Here the same three GEMMs run on plain tensors -- FP8 bytes, the
transposed bytes the backward GEMMs read, and ``scale_inv`` -- made by the custom ops
``tp_fuse::fp8_cast`` (the op's own quantizers, run at graph run time) and
``tp_fuse::fp8_gemm`` (the FP8 GEMM kernel). Dynamo traces this function's forward and
backward into the graph; AOTAutograd partitions them.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.library import fp8_gemm_op  # noqa: F401  (registers tp_fuse::fp8_gemm)
from ...quantization.compile_state import CompileRef
from ...quantization.custom_ops import fp8_cast  # noqa: F401  (registers tp_fuse::fp8_cast)

__all__ = ["Fp8LinearFunction"]


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T`` with FP8 operands (per-tensor scales), differentiable in x and W.

    Shapes: ``x [M, K]`` (high precision), ``W [N, K]`` (the parameter), ``y [M, N]`` in
    x's dtype. ``q(.)`` is the quantizer cast ``tp_fuse::fp8_cast`` (forward dtype for x and
    W, backward dtype for dy), ``s_*`` its ``scale_inv``.

    Equations (each GEMM ``tp_fuse::fp8_gemm``, fp32 accumulation)::

        forward: y  = (q(x) @ q(W)^T) s_x s_W
        dgrad:   dx = (q(dy) @ q(W)) s_dy s_W          (reads W's transposed bytes)
        wgrad:   dW = (q(dy)^T @ q(x)) s_dy s_x        (dy's and x's transposed bytes),
                      in W's dtype

    Quantization is not differentiated (straight-through), as in every FP8 recipe and in
    ``BasicLinear``'s eager path, whose numbers these are: same quantizers, same casts, same
    GEMM kernel. Saved for backward: the transposed FP8 bytes of x and W and their scales.

    Args (after ``x``, ``weight``): ``owner`` -- the op's ``OpQuantizers.compile_ref``;
    ``recipe`` / ``fwd_dtype`` / ``bwd_dtype`` -- the ``CompileKey`` it was traced for;
    ``need_grad`` -- whether a backward will run (the casts then also write transposes);
    ``observer`` -- the ``compile_ref`` of the op's ``tp_fuse.debug`` hooks (FP8
    statistics), or ``NO_OBSERVER``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        owner: CompileRef,
        recipe: str,
        fwd_dtype: torch.dtype,
        bwd_dtype: torch.dtype,
        need_grad: bool,
        observer: CompileRef,
    ) -> torch.Tensor:
        fp8 = torch.ops.tp_fuse
        wgrad = need_grad and weight.requires_grad
        x_data, x_t, x_sinv = fp8.fp8_cast(x.detach(), owner, "input", recipe, fwd_dtype, wgrad, observer)
        w_data, w_t, w_sinv = fp8.fp8_cast(weight.detach(), owner, "weight", recipe, fwd_dtype, need_grad, observer)
        y = fp8.fp8_gemm(x_data, w_data, x_sinv, w_sinv, x.dtype)
        ctx.save_for_backward(x_t, x_sinv, w_t, w_sinv)
        ctx.owner, ctx.recipe, ctx.bwd_dtype, ctx.wgrad, ctx.observer = owner, recipe, bwd_dtype, wgrad, observer
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        fp8 = torch.ops.tp_fuse
        x_t, x_sinv, w_t, w_sinv = ctx.saved_tensors
        dy_data, dy_t, dy_sinv = fp8.fp8_cast(
            dy.contiguous(), ctx.owner, "grad_output", ctx.recipe, ctx.bwd_dtype, ctx.wgrad, ctx.observer
        )
        dx = fp8.fp8_gemm(dy_data, w_t, dy_sinv, w_sinv, dy.dtype)
        dw = None
        if ctx.wgrad:
            dw = fp8.fp8_gemm(dy_t, x_t, dy_sinv, x_sinv, dy.dtype).to(ctx.weight_dtype)
        return dx, dw, None, None, None, None, None, None
