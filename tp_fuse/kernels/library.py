"""``tp_fuse::fp8_gemm``: the FP8 GEMM kernel as a ``torch.library`` custom op.

Compiled graphs call the GEMM through this op, so the compiler treats it as one opaque
node with known output metadata (from the fake implementation) and runs
:func:`tp_fuse.kernels.fp8_gemm` -- ``torch._scaled_mm`` / the Triton GEMM on CUDA, the
exact emulation on CPU, whichever the dispatch picks, logged as usual -- at run time.
Eager code calls the kernel directly (no dispatcher round trip).
"""

from __future__ import annotations

import torch

from .gemm import fp8_gemm

__all__ = ["fp8_gemm_op"]


@torch.library.custom_op("tp_fuse::fp8_gemm", mutates_args=())
def fp8_gemm_op(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out = (a @ b.T) * scale_a * scale_b`` in ``out_dtype`` (fp32 accumulation).

    Shapes::

        a        [M, K]  float8_e4m3fn / float8_e5m2 (K-major; other layouts are copied)
        b        [N, K]  float8_e4m3fn / float8_e5m2
        scale_a  []      fp32 dequantization scale of a (``scale_inv`` of its cast)
        scale_b  []      fp32 dequantization scale of b
        out      [M, N]  out_dtype, contiguous

    A linear layer's three GEMMs (``x [M, K]``, ``W [N, K]``, ``dy [M, N]``; ``_t`` the
    transposed bytes of a cast): fprop ``y = fp8_gemm(x, W)``, dgrad
    ``dx = fp8_gemm(dy, W_t)``, wgrad ``dW = fp8_gemm(dy_t, x_t)``. No autograd: the
    callers (``tp_fuse/ops/compiled/fp8_linear.py``) differentiate the linear layer.
    """
    out, _ = fp8_gemm(a, b, scale_a, scale_b, out_dtype)
    return out


@fp8_gemm_op.register_fake
def _fp8_gemm_fake(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "tp_fuse::fp8_gemm: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[1], lambda: "tp_fuse::fp8_gemm: a [M, K] and b [N, K] need equal K")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
