"""The FP8 GEMM of quantized tensors: the one entry point ops, layers and users call.

``fp8_gemm(a, b)`` computes ``op(a) @ op(b).T`` -- the "NT" layout of a linear layer
(``y = x @ W.T``), which is also what ``_scaled_mm`` wants: ``mat1`` row-major and
``mat2`` column-major, i.e. ``b`` row-major ``[N, K]`` and passed as the free transpose
``b.t()``. ``op`` is the identity, or with ``transpose_a`` / ``transpose_b`` the transpose
of the operand's 2-D view ``[prod(shape[:-1]), shape[-1]]``. The three linear-layer GEMMs
(``x [M, K]``, ``W [N, K]``, ``dy [M, N]``)::

    fprop:  y  = fp8_gemm(x,  W)                                     # [M, N]
    dgrad:  dx = fp8_gemm(dy, W, transpose_b=True)                   # [M, K]
    wgrad:  dW = fp8_gemm(dy, x, transpose_a=True, transpose_b=True) # [N, K]

Operands:

* :class:`Float8Tensor` (per-tensor scale ``_sinv``, which ``_scaled_mm`` multiplies by):
  the bytes go to ``tp_fuse.kernels.fp8_gemm`` (its raw-bytes form: ``torch._scaled_mm``,
  on CPU its exact emulation, or the Triton GEMM on CUDA when chosen). Where that GEMM
  reads any layout (the CPU emulation, ``kernels.fp8_gemm_reads_views``) a transposed
  operand is a view of the row-wise bytes and the operands' decoded values are used (a
  weight's decode, kept by ``Float8Tensor.keep_decoded``, serves fprop and dgrad); else a
  transposed operand is the K-major bytes of ``Float8Tensor.transpose_fp8`` a GPU needs.
* :class:`BlockScaledTensor` (block-scaled, row-wise and NVFP4 recipes): ``block_gemm``
  on the row-wise copies; a transposed operand is its column-wise copy.

The checks and the path are decided by the first call with a signature (types, shapes,
FP8 dtypes, devices, output dtype, bias, transposes, settings) and kept, as the kernel
keeps its plans (``kernels.gemm``): later calls with that signature look the decision up.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import kernels, settings
from ..kernels._common import as_rows
from ..kernels.gemm import Fp8GemmPlan, fp8_gemm_plan, fp8_gemm_reads_views, remember_plan
from .block.gemm import block_gemm
from .block.tensor import BlockScaledTensor
from .float8.tensor import Float8Tensor

__all__ = ["fp8_gemm"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The plan of a signature whose GEMM reads the FP8 bytes (no views): the kernel plans by
# the bytes' own signature, which a transposed copy fixes only once it exists.
_BYTES = "bytes"
# signature -> the views path's kernel plan, or _BYTES (bounded: kernels.gemm.remember_plan).
_PLANS: dict[tuple, Union[Fp8GemmPlan, str]] = {}


def fp8_gemm(
    a: Union[Float8Tensor, BlockScaledTensor],
    b: Union[Float8Tensor, BlockScaledTensor],
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
) -> torch.Tensor:
    """``op(a) @ op(b).T (+ bias)`` in ``out_dtype`` from quantized operands (module doc).

    Args:
        a: Float8Tensor or BlockScaledTensor; ``op(a)`` is ``[M, K]``.
        b: of the same kind; ``op(b)`` is ``[N, K]``.
        out_dtype: float32, bfloat16, float16 or float64.
        bias: optional ``[N]`` high-precision tensor added to every row.
        transpose_a, transpose_b: ``op`` transposes the operand's 2-D view.

    Returns:
        Plain tensor ``[M, N]`` of ``out_dtype``.
    """
    if isinstance(a, BlockScaledTensor) or isinstance(b, BlockScaledTensor):
        # Block-scaled and row-wise recipes (block/gemm.py): same NT contract, transposed
        # operands are the column-wise copies.
        return block_gemm(a.transpose_fp8() if transpose_a else a, b.transpose_fp8() if transpose_b else b,
                          out_dtype, bias)
    try:
        key = (type(a), type(b), a.shape, b.shape, a.device, b.device, a._fp8.dtype, b._fp8.dtype, out_dtype,
               None if bias is None else (type(bias), bias.shape, bias.dtype, bias.device),
               transpose_a, transpose_b, settings.current())
    except AttributeError:  # not Float8Tensors: the checks name what arrived
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(a, b, out_dtype, bias, transpose_a, transpose_b, key)
    if plan is _BYTES:
        # A transposed operand is its K-major transposed bytes (cached on the tensor), not a
        # Float8Tensor wrapper built to be unwrapped.
        return kernels.fp8_gemm(a.transpose_data() if transpose_a else a._fp8,
                                b.transpose_data() if transpose_b else b._fp8,
                                a._sinv, b._sinv, out_dtype, bias=bias)[0]
    # The CPU emulation: decoded operands (kept where the caller asked), transposed as views.
    acc = plan.acc_dtype
    da = _op(a.decoded(acc), a.shape[-1], transpose_a)
    db = _op(b.decoded(acc), b.shape[-1], transpose_b)
    return plan.run_decoded(da, db, a._sinv, b._sinv, bias)


def _plan(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    transpose_a: bool,
    transpose_b: bool,
    key: Optional[tuple],
) -> Union[Fp8GemmPlan, str]:
    """Check a new signature (the errors name what was wrong and what was expected) and
    decide its path: the kernel plan of the views path, or ``_BYTES``."""
    _check(a, b, out_dtype, bias, transpose_a, transpose_b)
    if fp8_gemm_reads_views(a.device):
        # The kernel plans (and checks) the GEMM of the row-wise bytes, transposed as views.
        a8 = _op(a._fp8, a.shape[-1], transpose_a)
        b8 = _op(b._fp8, b.shape[-1], transpose_b)
        plan: Union[Fp8GemmPlan, str] = fp8_gemm_plan(a8, b8, a._sinv, b._sinv, out_dtype, bias)
        assert plan.reads_views, "fp8_gemm_reads_views and the kernel's plan disagree"
    else:
        plan = _BYTES
    remember_plan(_PLANS, key, plan)
    return plan


def _op(x: torch.Tensor, cols: int, transpose: bool) -> torch.Tensor:
    """``op(x)``: ``x`` itself, or the transpose of its 2-D view ``[rows, cols]`` (a view)."""
    return as_rows(x, cols).t() if transpose else x


def _describe(name: str, t: object) -> str:
    if isinstance(t, Float8Tensor):
        return f"{name}: Float8Tensor shape {tuple(t.shape)} fp8_dtype {t.fp8_dtype}"
    if isinstance(t, torch.Tensor):
        return f"{name}: Tensor shape {tuple(t.shape)} dtype {t.dtype}"
    return f"{name}: {type(t).__name__}"


def _op_shape(t: Float8Tensor, transpose: bool) -> Optional[tuple[int, int]]:
    """``op(t)``'s 2-D shape, or None when ``t`` has none (not 2-D; < 2 dims transposed)."""
    if not transpose:
        return tuple(t.shape) if t.dim() == 2 else None
    if t.dim() < 2:
        return None
    return t.shape[-1], t.numel() // max(1, t.shape[-1])


def _check(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    transpose_a: bool,
    transpose_b: bool,
) -> None:
    if not isinstance(a, Float8Tensor) or not isinstance(b, Float8Tensor):
        raise ValueError(
            f"fp8_gemm: expected Float8Tensor operands, got {_describe('a', a)}; {_describe('b', b)}"
        )
    shape_a, shape_b = _op_shape(a, transpose_a), _op_shape(b, transpose_b)
    if shape_a is None or shape_b is None or shape_a[1] != shape_b[1]:
        ops = "" if not (transpose_a or transpose_b) else (
            f" (transpose_a={transpose_a}, transpose_b={transpose_b}: op(t) is the transpose of t's 2-D view)")
        raise ValueError(
            f"fp8_gemm: expected {'op(a)' if transpose_a else 'a'} [M, K] and {'op(b)' if transpose_b else 'b'} "
            f"[N, K] with equal K, got {_describe('a', a)}; {_describe('b', b)}{ops}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_gemm: out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    if a.device != b.device:
        raise ValueError(f"fp8_gemm: operands on different devices: a {a.device}, b {b.device}")
    n = shape_b[0]
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
