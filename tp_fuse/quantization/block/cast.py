"""Block quantization of both GEMM layouts: the torch reference or the Triton kernels.

:func:`quantize_layouts` is what :class:`~tp_fuse.quantization.BlockScalingQuantizer`
calls. It picks the implementation with ``tp_fuse.kernels.dispatch`` under the kernel
name ``block_quantize`` -- the rules of every tp_fuse kernel: auto (``backend=None``)
is Triton for CUDA tensors when triton imports and torch elsewhere (also on CPU with
``TRITON_INTERPRET=1``: the interpreter is a testing tool); ``backend="triton"`` runs
Triton or raises, on CPU only under the interpreter; float64 inputs take torch. The
path that ran is recorded for ``record_kernel_paths``.

Both paths give the same bytes and scales (``tests/test_block_kernels_interpret.py``):

* torch -- :mod:`~tp_fuse.quantization.block.scaling`, one layout at a time;
* Triton -- :mod:`tp_fuse.kernels.block_cast_triton`: 1x128, 128x128 and 1x32 blocks in
  one read of ``x`` for both layouts; row-wise scaling in two reads (row and column
  amaxes, then the cast), since a column's scale depends on every row.

Shapes, for 2-D ``x [R, C]`` and block spec ``(br, bc)``: row-wise payload ``data [R, C]``,
``scale_inv [ceil(R/br), ceil(C/bc)]``; column-wise payload (the row-wise quantization
of ``x.T``) ``data [C, R]``, ``scale_inv [ceil(C/br), ceil(R/bc)]``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ...kernels import dispatch
from ...kernels._common import triton_dtype_issue
from .scaling import BlockSpec, ScaleRule, block_amax, quantize_blocks
from .tensor import BlockPayload

__all__ = ["BlockLayouts", "quantize_layouts", "KERNEL"]

#: Kernel name in dispatch records and ``explain``.
KERNEL = "block_quantize"

AmaxHook = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class BlockLayouts:
    """Result of :func:`quantize_layouts`.

    Attributes:
        rowwise: payload of ``x``.
        columnwise: payload of ``x.T`` (None unless asked for).
        nonfinite: int64 0-d, how many of the quantized layouts had a NaN/inf block amax.
        backend: ``"torch"`` or ``"triton"``, the path that ran.
    """

    rowwise: BlockPayload
    columnwise: Optional[BlockPayload]
    nonfinite: torch.Tensor
    backend: str


def _triton_issue(x2d: torch.Tensor, spec: BlockSpec, fp8_dtype: torch.dtype, rule: ScaleRule) -> Optional[str]:
    """Why the Triton kernels cannot quantize this (None: they can). Anything the torch
    math takes but these kernels do not (other formats or scale rules) runs on torch."""
    issue = triton_dtype_issue(x2d.dtype)
    if issue is not None:
        return issue
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"{fp8_dtype}: the Triton block kernels write float8_e4m3fn / float8_e5m2"
    if rule.kind not in ("fp32", "e8m0"):
        return f"scale rule {rule.kind!r}: the Triton block kernels have fp32 and E8M0 scales"
    if spec.cols is not None:
        square = spec.rows == spec.cols
        if not ((spec.rows == 1 or square) and spec.cols in (32, 64, 128)):
            return f"block {spec.describe()}: the Triton kernels take 1xB or BxB blocks with B in 32/64/128"
    if rule.kind == "e8m0" and spec.cols is None:
        return "E8M0 scales with whole-row blocks: the Triton row-wise kernel has fp32 scales only"
    return None


def quantize_layouts(
    x2d: torch.Tensor,
    spec: BlockSpec,
    fp8_dtype: torch.dtype,
    rule: ScaleRule,
    *,
    columnwise: bool,
    reduce_columnwise_amax: Optional[AmaxHook] = None,
    backend: Optional[str] = None,
) -> BlockLayouts:
    """Quantize ``x2d [R, C]`` block by block: the row-wise copy and, with ``columnwise``,
    the column-wise copy, each from high precision (never one from the other).

    Args:
        reduce_columnwise_amax: row-wise scaling only (``spec.cols is None``): called with
            the fp32 column amaxes ``[C, 1]`` before the column-wise cast, returns the
            amaxes to use (e.g. all-reduced over a TP group, so that a gathered copy equals
            quantizing the gathered tensor).
        backend: None (auto), "torch" or "triton" (``tp_fuse.kernels.dispatch``).
    """
    if x2d.dim() != 2:
        raise ValueError(f"quantize_layouts: expected a 2-D tensor, got shape {tuple(x2d.shape)}")
    if reduce_columnwise_amax is not None and not (columnwise and spec.cols is None):
        raise ValueError(
            "reduce_columnwise_amax: only row-wise scaling's column-wise copy has amaxes that span "
            f"ranks; got block {spec.describe()} with columnwise={columnwise}"
        )
    issue = _triton_issue(x2d, spec, fp8_dtype, rule)
    choice = dispatch.select_backend(KERNEL, x2d.device, backend, triton_unsupported=issue)
    if choice.backend == "torch":
        out, variant = _torch_layouts(x2d, spec, fp8_dtype, rule, columnwise, reduce_columnwise_amax), "reference"
    else:
        out, variant = _triton_layouts(x2d, spec, fp8_dtype, rule, columnwise, reduce_columnwise_amax)
    dispatch.log_call(KERNEL, choice, variant, x2d.device)
    return out


def _nonfinite(*amaxes: Optional[torch.Tensor]) -> torch.Tensor:
    count = torch.zeros((), dtype=torch.int64, device=amaxes[0].device)
    for a in amaxes:
        if a is not None:
            count = count + (~torch.isfinite(a)).any().to(torch.int64)
    return count


def _torch_layouts(
    x2d: torch.Tensor, spec: BlockSpec, fp8_dtype: torch.dtype, rule: ScaleRule, columnwise: bool,
    reduce_columnwise_amax: Optional[AmaxHook],
) -> BlockLayouts:
    amax = block_amax(x2d, spec)
    rowwise = BlockPayload(*quantize_blocks(x2d, spec, fp8_dtype, rule, amax), spec)
    col = col_amax = None
    if columnwise:
        xt = x2d.t()
        col_amax = block_amax(xt, spec)
        if reduce_columnwise_amax is not None:
            col_amax = reduce_columnwise_amax(col_amax)
        col = BlockPayload(*quantize_blocks(xt, spec, fp8_dtype, rule, col_amax), spec)
    return BlockLayouts(rowwise, col, _nonfinite(amax, col_amax), "torch")


def _triton_layouts(
    x2d: torch.Tensor, spec: BlockSpec, fp8_dtype: torch.dtype, rule: ScaleRule, columnwise: bool,
    reduce_columnwise_amax: Optional[AmaxHook],
) -> tuple[BlockLayouts, str]:
    # Imported here, not at the top: importing triton is slow and CPU-only use never
    # needs it (the same lazy import as kernels/cast.py); not an import cycle.
    from ...kernels import block_cast_triton

    if spec.cols is None:
        row_amax, col_amax = block_cast_triton.row_col_amax(x2d, columnwise)
        if reduce_columnwise_amax is not None:
            col_amax = reduce_columnwise_amax(col_amax)
        data, sinv, data_t, sinv_t, variant = block_cast_triton.row_cast(
            x2d, row_amax, col_amax, fp8_dtype, power_2=rule.power_2, amax_epsilon=rule.amax_epsilon
        )
        nonfinite = _nonfinite(row_amax, col_amax)
    else:
        data, sinv, data_t, sinv_t, flag, variant = block_cast_triton.block_quantize_tiles(
            x2d, spec.cols, spec.rows != 1, fp8_dtype, e8m0=rule.kind == "e8m0", power_2=rule.power_2,
            amax_epsilon=rule.amax_epsilon, columnwise=columnwise,
        )
        # A NaN/inf element makes a block amax of each layout non-finite.
        nonfinite = flag.reshape(()).to(torch.int64) * (2 if columnwise else 1)
    col = BlockPayload(data_t, sinv_t, spec) if columnwise else None
    return BlockLayouts(BlockPayload(data, sinv, spec), col, nonfinite, "triton"), variant
