"""Triton implementation of ``cast.quantize`` (semantics and shapes documented there).

One program owns a ``[BLOCK_R, BLOCK_C]`` tile of the 2-D view: it reads the tile once,
writes the FP8 bytes row-major and (optionally) transposed, and folds the tile's
``max(|x|)`` into a global int32 with ``atomic_max`` (see ``abs_max_bits``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import rows_2d
from ._triton_common import (
    INTERPRETED,
    abs_max_bits,
    amax_buffer,
    amax_from_buffer,
    emulate_conversions,
    quantize_values,
    variant,
)


@triton.jit
def _quantize_kernel(
    x_ptr,
    stride_r,
    stride_c,
    scale_ptr,
    out_ptr,  # uint8 view of the fp8 output [R, C]
    out_t_ptr,  # uint8 view of the fp8 transposed output [C, R] (unused without TRANSPOSE)
    amax_ptr,  # int32 [1]
    R,
    C,
    TRANSPOSE: tl.constexpr,
    FP8_E4M3: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)
    x = x.to(tl.float32)
    q = quantize_values(x, tl.load(scale_ptr), FP8_E4M3, EMULATE)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        # tl.trans lets the compiler stage the tile through shared memory so that both
        # stores are coalesced along their own innermost dimension.
        tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    tl.atomic_max(amax_ptr, abs_max_bits(x, mask))


def _blocks(transpose: bool, numel: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps)."""
    if INTERPRETED:
        # The interpreter runs programs one after another, at a fixed cost per op: small
        # tiles keep small test shapes multi-program (masks, atomics exercised), large
        # tiles keep exhaustive tests (every bf16 pattern) fast.
        return (16, 32, 1) if numel <= 32768 else (128, 256, 1)
    # 4096 elements per program; square tiles when transposing so both stores coalesce.
    return (64, 64, 4) if transpose else (32, 128, 4)


def quantize_triton(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, str]:
    """Returns ``(data, data_t, amax, variant)``; arguments validated by the caller."""
    x2 = rows_2d(x)  # [R, C], possibly strided
    R, C = x2.shape
    data = torch.empty((R, C), dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((C, R), dtype=fp8_dtype, device=x.device) if transpose else None
    buf = amax_buffer(x.device)
    emulated = emulate_conversions(x.device)
    if R * C > 0:
        block_r, block_c, warps = _blocks(transpose, R * C)
        grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
        out_u8 = data.view(torch.uint8)
        _quantize_kernel[grid](
            x2,
            x2.stride(0),
            x2.stride(1),
            scale,
            out_u8,
            data_t.view(torch.uint8) if transpose else out_u8,
            buf,
            R,
            C,
            TRANSPOSE=transpose,
            FP8_E4M3=fp8_dtype == torch.float8_e4m3fn,
            EMULATE=emulated,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=warps,
        )
    return data.reshape(x.shape), data_t, amax_from_buffer(buf), variant("tiles", emulated)
