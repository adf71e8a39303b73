"""Triton LayerNorm / RMSNorm forward (semantics and shapes documented in ``norms``).

One program normalizes ``BLOCK_R`` whole rows held in registers (``BLOCK_N`` is the row
length rounded up to a power of two), so ``x`` is read exactly once; statistics are
two-pass over registers (mean, then centered variance) for accuracy.
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
    emulate_conversions,
    fold_amax,
    pow2,
    store_result,
    variant,
    write_scale_inv,
)


@triton.jit
def _norm_fwd_kernel(
    x_ptr,
    stride_xr,
    stride_xc,
    w_ptr,
    b_ptr,
    y_ptr,  # [R, N] in x.dtype, or uint8 view of fp8 when QUANT
    mean_ptr,  # [R] fp32 (unused when RMS)
    rstd_ptr,  # [R] fp32
    scale_ptr,
    amax_ptr,  # int32 [1]
    sinv_ptr,  # fp32 [1]: 1 / scale, with WRITE_SINV
    R,
    N,
    eps,
    RMS: tl.constexpr,
    QUANT: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    WRITE_SINV: tl.constexpr,
    FP8_E4M3: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < R
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        # Padding columns must not contribute (x - mean) to the variance.
        xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    # IEEE sqrt and division (tl.sqrt / "/" lower to approximate PTX instructions);
    # this is per row, so the cost is negligible.
    rstd = tl.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if not RMS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y + b[None, :]
    scale = tl.load(scale_ptr) if QUANT else 1.0
    store_result(y_ptr + rows[:, None] * N + cols[None, :], y, mask, scale, QUANT, FP8_E4M3, EMULATE)
    fold_amax(amax_ptr, y, mask, WITH_AMAX)
    write_scale_inv(sinv_ptr, scale, WRITE_SINV)


def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps) for rows of n elements."""
    block_n = pow2(n)
    if INTERPRETED:
        return 4, block_n, 1
    # ~4096 elements per program: several short rows, or one long row spread over
    # up to 16 warps (about 16 fp32 registers per thread for the row at n = 8192).
    block_r = max(1, 4096 // block_n)
    warps = min(16, max(1, block_r * block_n // 512))
    return block_r, block_n, warps


def norm_fwd_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    scale: Optional[torch.Tensor],
    fp8_dtype: Optional[torch.dtype],
    *,
    rms: bool,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor], str]:
    """Returns ``(y, mean | None, rstd, amax, variant)``; arguments validated by caller
    (``with_amax``, ``amax_out``, ``scale_inv_out``: see ``cast.quantize``)."""
    x2 = rows_2d(x)  # [R, N]
    R, N = x2.shape
    quant = fp8_dtype is not None
    y = torch.empty((R, N), dtype=fp8_dtype if quant else x.dtype, device=x.device)
    mean = None if rms else torch.empty(R, dtype=torch.float32, device=x.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    buf, fold, amax = amax_target(x.device, with_amax, amax_out, rstd)
    emulated = emulate_conversions(x.device)
    if R * N > 0:
        block_r, block_n, warps = _blocks(N)
        _norm_fwd_kernel[(triton.cdiv(R, block_r),)](
            x2,
            x2.stride(0),
            x2.stride(1),
            weight,
            weight if bias is None else bias,
            y.view(torch.uint8) if quant else y,
            rstd if mean is None else mean,
            rstd,
            scale if quant else rstd,
            buf,
            rstd if scale_inv_out is None else scale_inv_out,
            R,
            N,
            float(eps),
            RMS=rms,
            QUANT=quant,
            WITH_AMAX=fold,
            WRITE_SINV=scale_inv_out is not None,
            FP8_E4M3=fp8_dtype == torch.float8_e4m3fn,
            EMULATE=emulated,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    elif scale_inv_out is not None:  # no program ran to write it
        torch.reciprocal(scale, out=scale_inv_out)
    lead = x.shape[:-1]
    return (
        y.reshape(x.shape),
        None if mean is None else mean.reshape(lead),
        rstd.reshape(lead),
        amax,
        variant("rows", emulated),
    )
