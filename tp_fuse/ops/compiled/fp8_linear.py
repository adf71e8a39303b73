"""The FP8 linear layer of compiled graphs on CPU: custom-op casts, traced emulated GEMMs.

``BasicLinear``'s eager FP8 path works on ``Float8Tensor`` subclasses, which dynamo cannot
trace through the fuser. Here the same three GEMMs run on plain tensors -- FP8 bytes and
``scale_inv`` -- made by the custom op ``tp_fuse::fp8_cast`` (the op's own quantizers, run
at graph run time) and multiplied by the CPU's exact emulation traced as ops. Dynamo traces
this function's forward and backward into the graph; AOTAutograd partitions them. The
CUDA path (``torch._scaled_mm`` and ATen casts) is ``fp8_linear_cuda``; the block-scaled
recipes are :class:`BlockLinearFunction` here.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.fp8_emulation import accumulation_dtype, emulated_mm_decoded
from ...quantization.compile_ref import CompileRef
from ...quantization.compile_state import BlockLayout, CompileKey
from ...quantization.custom_ops import block_cast, fp8_cast  # noqa: F401  (registers the tp_fuse:: ops)

__all__ = ["BlockLinearFunction", "Fp8LinearFunction"]


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T`` with FP8 operands (per-tensor scales) on CPU's exact emulation
    (``kernels.fp8_gemm_reads_views``), differentiable in x and W. The CUDA path (GPU, and
    strict-CUDA mode on CPU) is ``fp8_linear_cuda.Fp8LinearCudaFunction``.

    Shapes: ``x [M, K]`` (high precision), ``W [N, K]`` (the parameter), ``y [M, N]`` in
    x's dtype. ``q(.)`` is the quantizer cast ``tp_fuse::fp8_cast`` (forward dtype for x and
    W, backward dtype for dy), ``s_*`` its ``scale_inv``.

    Equations (each GEMM :func:`_traced_gemm`, fp32 accumulation)::

        forward: y  = (q(x) @ q(W)^T) s_x s_W
        dgrad:   dx = (q(dy) @ q(W)) s_dy s_W          (a t() view of W's bytes)
        wgrad:   dW = (q(dy)^T @ q(x)) s_dy s_x        (t() views), in W's dtype

    Quantization is not differentiated (straight-through), as in every FP8 recipe and in
    ``BasicLinear``'s eager path, whose numbers these are: same quantizers, same casts, same
    GEMM emulation, traced as its own ops (the compiler sees the decodes and the scale
    epilogues); the emulation reads any layout, so the casts write no transposed bytes and
    the backward reads ``t()`` views. Saved for backward: the FP8 bytes of x and W and
    their scales.

    Args (after ``x``, ``weight``): ``owner`` -- the op's ``OpQuantizers.compile_ref``;
    ``recipe`` / ``fwd_dtype`` / ``bwd_dtype`` -- the ``CompileKey`` it was traced for;
    ``need_grad`` -- whether a backward will run; ``observer`` -- the ``compile_ref`` of the
    op's ``tp_fuse.debug`` hooks (FP8 statistics), or ``NO_OBSERVER``.
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
        x_data, _, x_sinv = fp8.fp8_cast(x.detach(), owner, "input", recipe, fwd_dtype, False, observer)
        w_data, _, w_sinv = fp8.fp8_cast(weight.detach(), owner, "weight", recipe, fwd_dtype, False, observer)
        y = _traced_gemm(x_data, w_data, x_sinv, w_sinv, x.dtype)
        ctx.save_for_backward(x_data, x_sinv, w_data, w_sinv)
        ctx.owner, ctx.recipe, ctx.bwd_dtype, ctx.observer = owner, recipe, bwd_dtype, observer
        ctx.wgrad, ctx.weight_dtype = need_grad and weight.requires_grad, weight.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        x_data, x_sinv, w_data, w_sinv = ctx.saved_tensors
        dy_data, _, dy_sinv = torch.ops.tp_fuse.fp8_cast(
            dy.contiguous(), ctx.owner, "grad_output", ctx.recipe, ctx.bwd_dtype, False, ctx.observer
        )
        dx = _traced_gemm(dy_data, w_data.t(), dy_sinv, w_sinv, dy.dtype)
        dw = None
        if ctx.wgrad:
            dw = _traced_gemm(dy_data.t(), x_data.t(), dy_sinv, x_sinv, dy.dtype).to(ctx.weight_dtype)
        return dx, dw, None, None, None, None, None, None


def _traced_gemm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The traced form of ``quantization.fp8_gemm``'s CPU emulation (a graph cannot look up
    its plans; the plan's checks are the fuser's, made before tracing): ``(a @ b.T) * scale_a *
    scale_b`` in ``out_dtype`` from FP8 ``a [M, K]`` and ``b [N, K]`` of any layout.

    Exact decodes (every FP8 value is exact in fp32) into the emulation's own matmul and
    epilogue, ``kernels.fp8_emulation.emulated_mm_decoded``, so compiled == eager; traced,
    the compiler fuses the decodes and the epilogue around the matmul instead of running an
    opaque op per GEMM.
    """
    acc = accumulation_dtype(out_dtype)
    return emulated_mm_decoded(a.to(acc), b.to(acc).t(), scale_a, scale_b, out_dtype)


def _cast_args(layout: BlockLayout) -> tuple:
    return (layout.recipe_name, layout.block_rows, layout.block_cols, layout.data_dtype, layout.scale_dtype)


class BlockLinearFunction(torch.autograd.Function):
    """``y = x W^T`` under a block-scaled recipe (Float8BlockScaling, MXFP8BlockScaling,
    Float8RowwiseScaling, NVFP4BlockScaling), differentiable in x and W.

    Shapes as :class:`Fp8LinearFunction`. ``q_r(.)`` / ``q_c(.)`` are the row-wise copy and
    the column-wise copy (the row-wise cast of the transpose, from high precision) made by
    ``tp_fuse::block_cast`` with the op's quantizer for the role; each GEMM is
    ``tp_fuse::block_gemm`` (``a @ b.T`` of two row-wise payloads, blocks along K)::

        forward: y  = q_r(x) @ q_r(W)^T
        dgrad:   dx = q_r(dy) @ q_c(W)^T         (q_c(W) holds W^T: [K, N])
        wgrad:   dW = q_c(dy) @ q_c(x)^T          in W's dtype

    -- ``BasicLinear``'s eager block-scaled path (same quantizers, same casts, same GEMM
    kernel): straight-through quantization. Saved for backward: the column-wise payloads
    of x and W (data, block scales, NVFP4's amax).

    Args (after ``x``, ``weight``): ``owner`` -- the op's ``OpQuantizers.compile_ref``;
    ``key`` -- the :class:`CompileKey` traced for (recipe class and per-role layouts);
    ``need_grad``, ``observer`` -- as :class:`Fp8LinearFunction`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        owner: CompileRef,
        key: CompileKey,
        need_grad: bool,
        observer: CompileRef,
    ) -> torch.Tensor:
        ops = torch.ops.tp_fuse
        lx, lw = key.layout("input"), key.layout("weight")
        wgrad = need_grad and weight.requires_grad
        xr_d, xr_s, xr_a, xc_d, xc_s, xc_a = ops.block_cast(
            x.detach(), owner, "input", key.recipe, *_cast_args(lx), wgrad, observer
        )
        wr_d, wr_s, wr_a, wc_d, wc_s, wc_a = ops.block_cast(
            weight.detach(), owner, "weight", key.recipe, *_cast_args(lw), need_grad, observer
        )
        blk_x, blk_w = [lx.block_rows, lx.block_cols], [lw.block_rows, lw.block_cols]
        y = ops.block_gemm(xr_d, xr_s, xr_a, wr_d, wr_s, wr_a, lx.recipe_name, blk_x, blk_w, lx.e4m3_max, lw.e4m3_max,
                           x.dtype)
        ctx.save_for_backward(xc_d, xc_s, xc_a, wc_d, wc_s, wc_a)
        ctx.owner, ctx.key, ctx.wgrad, ctx.observer = owner, key, wgrad, observer
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        ops = torch.ops.tp_fuse
        xc_d, xc_s, xc_a, wc_d, wc_s, wc_a = ctx.saved_tensors
        key: CompileKey = ctx.key
        lx, lw, lg = key.layout("input"), key.layout("weight"), key.layout("grad_output")
        gr_d, gr_s, gr_a, gc_d, gc_s, gc_a = ops.block_cast(
            dy.contiguous(), ctx.owner, "grad_output", key.recipe, *_cast_args(lg), ctx.wgrad, ctx.observer
        )
        blk = lambda layout: [layout.block_rows, layout.block_cols]  # noqa: E731
        dx = ops.block_gemm(
            gr_d, gr_s, gr_a, wc_d, wc_s, wc_a, lg.recipe_name, blk(lg), blk(lw), lg.e4m3_max, lw.e4m3_max, dy.dtype
        )
        dw = None
        if ctx.wgrad:
            dw = ops.block_gemm(
                gc_d, gc_s, gc_a, xc_d, xc_s, xc_a, lg.recipe_name, blk(lg), blk(lx), lg.e4m3_max, lx.e4m3_max, dy.dtype
            ).to(ctx.weight_dtype)
        return dx, dw, None, None, None, None
