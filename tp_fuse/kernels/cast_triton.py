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
    amax_target,
    current_scale,
    emulate_conversions,
    fold_amax,
    quantize_values,
    variant,
    write_scale_inv,
)


@triton.jit
def _quantize_kernel(
    x_ptr,
    stride_r,
    stride_c,
    scale_ptr,
    out_ptr,  # uint8 view of the fp8 output [R, C]
    out_t_ptr,  # uint8 view of the fp8 transposed output [C, R] (unused without TRANSPOSE)
    amax_ptr,  # int32 [1] folded into; with SCALE_FROM_AMAX the amax [1] (any float dtype), read
    sinv_ptr,  # fp32 [1]: 1 / scale, with WRITE_SINV
    last_amax_ptr,  # SCALE_FROM_AMAX: fp32 [1] <- amax
    nonfinite_ptr,  # SCALE_FROM_AMAX: int64 [1] += amax is NaN/inf
    zero_ptr,  # SCALE_FROM_AMAX: int64 [1] += amax == 0
    R,
    C,
    TRANSPOSE: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    WRITE_SINV: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,
    POW2_SCALE: tl.constexpr,
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
    if SCALE_FROM_AMAX:
        # Current scaling: every program derives the scale from the (reduced) amax; the
        # first one records it in the quantizer's state.
        amax = tl.load(amax_ptr).to(tl.float32)  # exact: an amax of bf16/fp16 values is one of them
        scale, nonfinite, zero = current_scale(amax, FP8_E4M3, POW2_SCALE)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_ptr, scale)
            tl.store(last_amax_ptr, amax)
            tl.store(nonfinite_ptr, tl.load(nonfinite_ptr) + nonfinite.to(tl.int64))
            tl.store(zero_ptr, tl.load(zero_ptr) + zero.to(tl.int64))
    else:
        scale = tl.load(scale_ptr)
    q = quantize_values(x, scale, FP8_E4M3, EMULATE)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        # tl.trans lets the compiler stage the tile through shared memory so that both
        # stores are coalesced along their own innermost dimension.
        tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    fold_amax(amax_ptr, x, mask, WITH_AMAX)
    write_scale_inv(sinv_ptr, scale, WRITE_SINV)


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
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
    current: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], str]:
    """Returns ``(data, data_t, amax, variant)``; arguments validated by the caller
    (``amax_out``, ``scale_inv_out``: see ``cast.quantize``; ``current``: ``(amax,
    last_amax_out, nonfinite_count, zero_count, power_2_scale)`` of
    ``cast.quantize_current_scaling``, which then writes ``scale``). One launch, plus one
    fill only for a fresh amax (``with_amax`` without ``amax_out``)."""
    x2 = rows_2d(x)  # [R, C], possibly strided
    R, C = x2.shape
    data = torch.empty((R, C), dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((C, R), dtype=fp8_dtype, device=x.device) if transpose else None
    out_u8 = data.view(torch.uint8)
    if current is None:
        buf, fold, amax = amax_target(x.device, with_amax, amax_out, out_u8)
        last, nonfinite, zero, pow2_scale = scale, out_u8, out_u8, False
    else:
        amax_in, last, nonfinite, zero, pow2_scale = current
        buf, fold, amax = amax_in, False, None
    emulated = emulate_conversions(x.device)
    if R * C > 0:
        block_r, block_c, warps = _blocks(transpose, R * C)
        grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
        _quantize_kernel[grid](
            x2,
            x2.stride(0),
            x2.stride(1),
            scale,
            out_u8,
            data_t.view(torch.uint8) if transpose else out_u8,
            buf,
            scale if scale_inv_out is None else scale_inv_out,
            last,
            nonfinite,
            zero,
            R,
            C,
            TRANSPOSE=transpose,
            WITH_AMAX=fold,
            WRITE_SINV=scale_inv_out is not None,
            SCALE_FROM_AMAX=current is not None,
            POW2_SCALE=pow2_scale,
            FP8_E4M3=fp8_dtype == torch.float8_e4m3fn,
            EMULATE=emulated,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=warps,
        )
    return data.reshape(x.shape), data_t, amax, variant("tiles", emulated)
