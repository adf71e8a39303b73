"""Triton GELU / SwiGLU forward and backward (semantics documented in ``activations``).

All four kernels tile the 2-D view ``[rows, cols]`` with ``[BLOCK_R, BLOCK_C]`` programs,
evaluate the same fp32 formulas as the torch reference, store the output (or its FP8
bytes) and fold the tile amax into a global int32 with ``atomic_max``.

``dgelu_dbias`` also reduces dx over rows. For a deterministic result (no float
atomics) each row-block writes its column sums to an fp32 workspace
``[cdiv(rows, BLOCK_R), cols]`` and a second small kernel sums the workspace rows.
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
    amax_target,
    emulate_conversions,
    fold_amax,
    gelu_parts,
    round_to,
    sigmoid_parts,
    store_result,
    variant,
    write_scale_inv,
)


@triton.jit
def _tile(R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    return rows, cols, mask


@triton.jit
def _load(ptr, rows, cols, stride_r, stride_c, mask):
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gelu_fwd_kernel(
    x_ptr, sxr, sxc, y_ptr, scale_ptr, amax_ptr, sinv_ptr, R, C,
    QUANT: tl.constexpr, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr,
    WITH_AMAX: tl.constexpr, WRITE_SINV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask = _tile(R, C, BLOCK_R, BLOCK_C)
    x = _load(x_ptr, rows, cols, sxr, sxc, mask)
    s, _ = gelu_parts(x)
    y = x * s
    scale = tl.load(scale_ptr) if QUANT else 1.0
    store_result(y_ptr + rows[:, None] * C + cols[None, :], y, mask, scale, QUANT, FP8_E4M3, EMULATE)
    fold_amax(amax_ptr, y, mask, WITH_AMAX)
    write_scale_inv(sinv_ptr, scale, WRITE_SINV)


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, sxr, sxc, y_ptr, scale_ptr, amax_ptr, sinv_ptr, R, C,  # C = n, the output width
    QUANT: tl.constexpr, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr,
    WITH_AMAX: tl.constexpr, WRITE_SINV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask = _tile(R, C, BLOCK_R, BLOCK_C)
    x1 = _load(x_ptr, rows, cols, sxr, sxc, mask)
    x2 = _load(x_ptr, rows, cols + C, sxr, sxc, mask)
    s, _ = sigmoid_parts(x1)
    y = x1 * s * x2
    scale = tl.load(scale_ptr) if QUANT else 1.0
    store_result(y_ptr + rows[:, None] * C + cols[None, :], y, mask, scale, QUANT, FP8_E4M3, EMULATE)
    fold_amax(amax_ptr, y, mask, WITH_AMAX)
    write_scale_inv(sinv_ptr, scale, WRITE_SINV)


@triton.jit
def _dgelu_dbias_kernel(
    g_ptr, sgr, sgc, x_ptr, sxr, sxc, dx_ptr, ws_ptr, scale_ptr, amax_ptr, sinv_ptr, R, C,
    QUANT: tl.constexpr, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr,
    WITH_AMAX: tl.constexpr, WRITE_SINV: tl.constexpr, DBIAS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask = _tile(R, C, BLOCK_R, BLOCK_C)
    g = _load(g_ptr, rows, cols, sgr, sgc, mask)
    x = _load(x_ptr, rows, cols, sxr, sxc, mask)
    s, one_minus_s = gelu_parts(x)
    dgelu = s + 2.0 * x * s * one_minus_s * 0.7978845608028654 * (1.0 + (3.0 * 0.044715) * x * x)
    dx = g * dgelu
    scale = tl.load(scale_ptr) if QUANT else 1.0
    store_result(dx_ptr + rows[:, None] * C + cols[None, :], dx, mask, scale, QUANT, FP8_E4M3, EMULATE)
    fold_amax(amax_ptr, dx, mask, WITH_AMAX)
    write_scale_inv(sinv_ptr, scale, WRITE_SINV)
    if DBIAS:
        # Masked elements loaded as 0 give dx = 0, so they add nothing to the column sums.
        tl.store(ws_ptr + tl.program_id(0) * C + cols, tl.sum(dx, axis=0), mask=cols < C)


@triton.jit
def _col_sum_kernel(
    ws_ptr, out_ptr, P, C, EMULATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):
    """out[c] = sum_p ws[p, c] in fp32, rounded to out's dtype."""
    cols = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        m = (ps[:, None] < P) & (cols[None, :] < C)
        acc += tl.sum(tl.load(ws_ptr + ps[:, None] * C + cols[None, :], mask=m, other=0.0), axis=0)
    tl.store(out_ptr + cols, round_to(acc, out_ptr.dtype.element_ty, EMULATE), mask=cols < C)


@triton.jit
def _dswiglu_kernel(
    g_ptr, sgr, sgc, x_ptr, sxr, sxc, dx_ptr, scale_ptr, amax_ptr, sinv_ptr, R, C,  # C = n
    QUANT: tl.constexpr, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr,
    WITH_AMAX: tl.constexpr, WRITE_SINV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols, mask = _tile(R, C, BLOCK_R, BLOCK_C)
    g = _load(g_ptr, rows, cols, sgr, sgc, mask)
    x1 = _load(x_ptr, rows, cols, sxr, sxc, mask)
    x2 = _load(x_ptr, rows, cols + C, sxr, sxc, mask)
    s, one_minus_s = sigmoid_parts(x1)
    dx1 = g * x2 * (s * (1.0 + x1 * one_minus_s))
    dx2 = g * (x1 * s)
    scale = tl.load(scale_ptr) if QUANT else 1.0
    out = dx_ptr + rows[:, None] * (2 * C) + cols[None, :]
    store_result(out, dx1, mask, scale, QUANT, FP8_E4M3, EMULATE)
    store_result(out + C, dx2, mask, scale, QUANT, FP8_E4M3, EMULATE)
    if WITH_AMAX:
        tl.atomic_max(amax_ptr, tl.maximum(abs_max_bits(dx1, mask), abs_max_bits(dx2, mask)))
    write_scale_inv(sinv_ptr, scale, WRITE_SINV)


def _blocks() -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps)."""
    if INTERPRETED:
        return 16, 32, 1  # small tiles: multi-program grids even at test shapes
    return 32, 128, 4  # 4096 elements per program, 16 per thread


def _out(shape, dtype, fp8_dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(output tensor, the view the kernel writes: uint8 bytes when quantizing)."""
    y = torch.empty(shape, dtype=fp8_dtype or dtype, device=device)
    return y, (y.view(torch.uint8) if fp8_dtype is not None else y)


def _flags(fp8_dtype, device, fold: bool, scale_inv_out) -> dict:
    return dict(
        QUANT=fp8_dtype is not None,
        FP8_E4M3=fp8_dtype == torch.float8_e4m3fn,
        EMULATE=emulate_conversions(device),
        WITH_AMAX=fold,
        WRITE_SINV=scale_inv_out is not None,
    )


def _finish_scale_inv(launched: bool, scale, scale_inv_out) -> None:
    """``1 / scale`` into ``scale_inv_out`` when no program ran to write it (empty input)."""
    if not launched and scale_inv_out is not None:
        torch.reciprocal(scale, out=scale_inv_out)


def gelu_fwd_triton(
    x, scale: Optional[torch.Tensor], fp8_dtype, with_amax: bool = True, amax_out=None, scale_inv_out=None
) -> tuple[torch.Tensor, Optional[torch.Tensor], str]:
    x2 = rows_2d(x)  # [R, C]
    R, C = x2.shape
    y, y_k = _out((R, C), x.dtype, fp8_dtype, x.device)
    buf, fold, amax = amax_target(x.device, with_amax, amax_out, y_k)
    flags = _flags(fp8_dtype, x.device, fold, scale_inv_out)
    if R * C > 0:
        br, bc, warps = _blocks()
        _gelu_fwd_kernel[(triton.cdiv(R, br), triton.cdiv(C, bc))](
            x2, x2.stride(0), x2.stride(1), y_k, scale if scale is not None else y_k, buf,
            scale_inv_out if scale_inv_out is not None else y_k, R, C,
            **flags, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
        )
    _finish_scale_inv(R * C > 0, scale, scale_inv_out)
    return y.reshape(x.shape), amax, variant("tiles", flags["EMULATE"])


def swiglu_fwd_triton(
    x, scale: Optional[torch.Tensor], fp8_dtype, with_amax: bool = True, amax_out=None, scale_inv_out=None
) -> tuple[torch.Tensor, Optional[torch.Tensor], str]:
    x2 = rows_2d(x)  # [R, 2n]
    R, n = x2.shape[0], x2.shape[1] // 2
    y, y_k = _out((R, n), x.dtype, fp8_dtype, x.device)
    buf, fold, amax = amax_target(x.device, with_amax, amax_out, y_k)
    flags = _flags(fp8_dtype, x.device, fold, scale_inv_out)
    if R * n > 0:
        br, bc, warps = _blocks()
        _swiglu_fwd_kernel[(triton.cdiv(R, br), triton.cdiv(n, bc))](
            x2, x2.stride(0), x2.stride(1), y_k, scale if scale is not None else y_k, buf,
            scale_inv_out if scale_inv_out is not None else y_k, R, n,
            **flags, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
        )
    _finish_scale_inv(R * n > 0, scale, scale_inv_out)
    return y.reshape(*x.shape[:-1], n), amax, variant("tiles", flags["EMULATE"])


def dgelu_dbias_triton(
    grad, x, scale: Optional[torch.Tensor], fp8_dtype, with_amax: bool = True, amax_out=None, scale_inv_out=None,
    with_dbias: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], str]:
    g2, x2 = rows_2d(grad), rows_2d(x)  # [R, C]
    R, C = x2.shape
    dx, dx_k = _out((R, C), grad.dtype, fp8_dtype, x.device)
    buf, fold, amax = amax_target(x.device, with_amax, amax_out, dx_k)
    flags = _flags(fp8_dtype, x.device, fold, scale_inv_out)
    br, bc, warps = _blocks()
    row_blocks = triton.cdiv(R, br)
    # [row_blocks, C] partial column sums (written by every row block, so no fill; with
    # no rows it is zeros, so that dbias = 0).
    ws_shape = (max(row_blocks, 1), C) if with_dbias else (1, 1)
    ws = (torch.empty if R > 0 else torch.zeros)(ws_shape, dtype=torch.float32, device=x.device)
    if R * C > 0:
        _dgelu_dbias_kernel[(row_blocks, triton.cdiv(C, bc))](
            g2, g2.stride(0), g2.stride(1), x2, x2.stride(0), x2.stride(1), dx_k, ws,
            scale if scale is not None else dx_k, buf, scale_inv_out if scale_inv_out is not None else dx_k, R, C,
            **flags, DBIAS=with_dbias, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
        )
    _finish_scale_inv(R * C > 0, scale, scale_inv_out)
    dbias = None
    if with_dbias:
        dbias = torch.empty(C, dtype=grad.dtype, device=x.device)
        if C > 0:
            _col_sum_kernel[(triton.cdiv(C, bc),)](
                ws, dbias, ws.shape[0], C, EMULATE=flags["EMULATE"], BLOCK_P=br, BLOCK_C=bc, num_warps=warps
            )
    return dx.reshape(x.shape), dbias, amax, variant("tiles", flags["EMULATE"])


def dswiglu_triton(
    grad, x, scale: Optional[torch.Tensor], fp8_dtype, with_amax: bool = True, amax_out=None, scale_inv_out=None
) -> tuple[torch.Tensor, Optional[torch.Tensor], str]:
    g2, x2 = rows_2d(grad), rows_2d(x)  # [R, n], [R, 2n]
    R, n = g2.shape
    dx, dx_k = _out((R, 2 * n), grad.dtype, fp8_dtype, x.device)
    buf, fold, amax = amax_target(x.device, with_amax, amax_out, dx_k)
    flags = _flags(fp8_dtype, x.device, fold, scale_inv_out)
    if R * n > 0:
        br, bc, warps = _blocks()
        _dswiglu_kernel[(triton.cdiv(R, br), triton.cdiv(n, bc))](
            g2, g2.stride(0), g2.stride(1), x2, x2.stride(0), x2.stride(1), dx_k,
            scale if scale is not None else dx_k, buf, scale_inv_out if scale_inv_out is not None else dx_k, R, n,
            **flags, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
        )
    _finish_scale_inv(R * n > 0, scale, scale_inv_out)
    return dx.reshape(x.shape), amax, variant("tiles", flags["EMULATE"])
