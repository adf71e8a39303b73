"""FP8 GEMM on Float8Tensors through ``tp_fuse.kernels.fp8_gemm``.

The kernel is the one FP8 GEMM implementation: ``torch._scaled_mm`` on the torch path
(CPU, and the default on CUDA), a Triton kernel on CUDA when chosen
(``TP_FUSE_FP8_GEMM=triton``). This module unwraps
Float8Tensors (bytes + ``_scale_inv``) and validates them.

``fp8_gemm(a, b)`` computes ``a @ b.T`` -- the "NT" layout of a linear layer
(``y = x @ W.T``), which is also what ``_scaled_mm`` wants: ``mat1`` row-major
and ``mat2`` column-major, i.e. ``b`` row-major ``[N, K]`` and passed as the
free transpose ``b.t()``. Per-tensor scales: ``scale_a = a._sinv``,
``scale_b = b._sinv`` (``_scaled_mm`` multiplies by them, dequantizing).

The three linear-layer GEMMs map to it as (``x [M, K]``, ``W [N, K]``,
``dy [M, N]``)::

    fprop:  y  = fp8_gemm(x,                 W)                   # [M, N]
    dgrad:  dx = fp8_gemm(dy,                W.transpose_fp8())   # [M, K]
    wgrad:  dW = fp8_gemm(dy.transpose_fp8(), x.transpose_fp8())  # [N, K]
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from ..kernels._common import as_rows
from ..kernels.fp8_emulation import accumulation_dtype
from .block.gemm import block_gemm
from .block.tensor import BlockScaledTensor
from .float8.tensor import Float8Tensor

__all__ = ["fp8_gemm", "fp8_gemm_of_views"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _describe(name: str, t: object) -> str:
    if isinstance(t, Float8Tensor):
        return f"{name}: Float8Tensor shape {tuple(t.shape)} fp8_dtype {t.fp8_dtype}"
    if isinstance(t, torch.Tensor):
        return f"{name}: Tensor shape {tuple(t.shape)} dtype {t.dtype}"
    return f"{name}: {type(t).__name__}"


def fp8_gemm(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` in ``out_dtype`` from FP8 operands.

    Args:
        a: Float8Tensor ``[M, K]``.
        b: Float8Tensor ``[N, K]``.
        out_dtype: float32, bfloat16, float16 or float64.
        bias: optional ``[N]`` high-precision tensor added to every row.

    Returns:
        Plain tensor ``[M, N]`` of ``out_dtype``.
    """
    if isinstance(a, BlockScaledTensor) or isinstance(b, BlockScaledTensor):
        # Block-scaled and row-wise recipes (block/gemm.py): same NT contract.
        return block_gemm(a, b, out_dtype, bias)
    if not isinstance(a, Float8Tensor) or not isinstance(b, Float8Tensor):
        raise ValueError(
            f"fp8_gemm: expected Float8Tensor operands, got {_describe('a', a)}; {_describe('b', b)}"
        )
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            "fp8_gemm: expected a [M, K] and b [N, K] with equal K, got "
            f"{_describe('a', a)}; {_describe('b', b)}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemm: out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    if a.device != b.device:
        raise ValueError(f"fp8_gemm: operands on different devices: a {a.device}, b {b.device}")
    n = b.shape[0]
    if bias is not None:
        if (
            not isinstance(bias, torch.Tensor)
            or isinstance(bias, Float8Tensor)
            or bias.shape != (n,)
            or not bias.dtype.is_floating_point
            or bias.dtype in _FP8_DTYPES
        ):
            raise ValueError(
                f"fp8_gemm: bias: expected a high-precision tensor of shape ({n},), got "
                f"{_describe('bias', bias)}"
            )
        if bias.device != a.device:
            raise ValueError(f"fp8_gemm: bias on {bias.device}, operands on {a.device}")
    # The kernel takes a [M, K] and b [N, K] (it makes them contiguous as its GEMM
    # needs) and the dequantization scales; it adds the bias in its epilogue.
    if kernels.fp8_gemm_reads_views(a.device):
        # The CPU emulation: decoded operands, kept where the caller asked (a weight's
        # decode serves its fprop and dgrad GEMMs).
        acc = accumulation_dtype(out_dtype)
        return kernels.fp8_gemm_emulated(a.decoded(acc), b.decoded(acc), a._sinv, b._sinv, out_dtype, bias=bias)
    # Float8Tensor guarantees FP8 bytes and 0-d fp32 scales; the rest was checked above.
    out, _ = kernels.fp8_gemm_checked(a._fp8, b._fp8, a._sinv, b._sinv, out_dtype, bias=bias)
    return out


def fp8_gemm_of_views(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
) -> torch.Tensor:
    """``op(a) @ op(b).T`` on a GEMM that reads any layout (the CPU emulation:
    ``kernels.fp8_gemm_reads_views``), where ``op`` is the transpose of the 2-D view
    ``[prod(shape[:-1]), shape[-1]]`` when asked: the linear layer's backward GEMMs
    without a Float8Tensor wrapper per transposed operand::

        dgrad: dx = fp8_gemm_of_views(dy, W, transpose_b=True)                    # dy @ W
        wgrad: dW = fp8_gemm_of_views(dy, x, transpose_a=True, transpose_b=True)  # dy^T @ x

    Bit-identical to ``fp8_gemm(a.transposed_view(), ...)`` (the same decoded values,
    transposed as views, and the same GEMM and epilogue); decodes kept by
    ``Float8Tensor.keep_decoded`` are used. ``a``, ``b``: per-tensor Float8Tensors (the
    caller checks; block-scaled tensors keep their own column-wise copies).
    """
    # (the caller decided that the GEMM reads views: kernels.fp8_gemm_reads_views)
    assert isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor) and a.device == b.device
    acc = accumulation_dtype(out_dtype)
    da = as_rows(a.decoded(acc), a.shape[-1])
    db = as_rows(b.decoded(acc), b.shape[-1])
    da = da.t() if transpose_a else da
    db = db.t() if transpose_b else db
    assert da.shape[1] == db.shape[1], f"fp8_gemm_of_views: K of {tuple(da.shape)} and {tuple(db.shape)}"
    return kernels.fp8_gemm_emulated(da, db, a._sinv, b._sinv, out_dtype)
