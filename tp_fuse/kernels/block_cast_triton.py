"""Triton kernels of block-scaled FP8 quantization (both GEMM layouts in one read of ``x``).

Semantics (bit for bit): ``tp_fuse.quantization.block.scaling`` -- per block,
``amax = max |x|`` (NaN-propagating), a scale from the amax (fp32 ``fp8_max / amax``,
optionally floored to a power of two, or the OCP MX E8M0 rule), then the saturating
round-to-nearest-even cast of ``x * scale``. The entry point that chooses between these
kernels and the torch reference is ``tp_fuse.quantization.block.cast``.

Layouts. ``x [R, C]`` is quantized row-wise (blocks of ``1 x B`` or ``B x B`` along C:
``data [R, C]``, ``scale_inv [ceil(R/br), ceil(C/B)]``) and, with ``COLUMNWISE``,
column-wise: the row-wise quantization of ``x.T`` (``data_t [C, R]``, ``scale_inv_t
[ceil(C/br), ceil(R/B)]``), which in ``x``'s coordinates has ``B x 1`` blocks.

* ``_tile_kernel`` (1x128, 128x128, 1x32): one program owns a ``[TR, TC]`` tile whose
  sides are multiples of B. It reads the tile once and gets the row-wise block amaxes
  (reduce over ``[TR, TC/B, B]``) and the column-wise ones (over ``[TR/B, B, TC]``)
  from the same registers, then writes both layouts: one pass. For ``B x B`` blocks the
  two layouts share the block, its scale and its bytes (``data_t`` is the transposed tile).
* Row-wise scaling (one scale per row of each layout) needs the amax of a whole row and
  of a whole column: ``_row_col_amax_kernel`` folds per-tile maxima into global int32
  buffers with ``atomic_max`` (first read), ``_row_cast_kernel`` casts both layouts with
  the finished scales (second read). The gap between the two lets the caller all-reduce
  the column amaxes over a TP group.

Amaxes are kept as the int32 bit pattern of ``|x|`` (``abs_max_bits``'s trick): integer
max is an exact float max that propagates NaN. Scales use a correctly rounded division
and exponent-bit arithmetic, never ``log2``/``exp2`` (approximate on GPUs).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._triton_common import INTERPRETED, emulate_conversions, pow2, quantize_values, variant


@triton.jit
def _scales(amax, FP8_E4M3: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr):
    """Per-block ``(multiplier, stored scale_inv)`` from fp32 ``amax`` (>= 0 or NaN).

    fp32 rule: ``scale = fp8_max / max(amax, EPS)``; 1 when that is not finite or the
    amax is 0 (or NaN); floored to a power of two by clearing the mantissa (scales are
    normal floats); ``scale_inv = 1 / scale``. E8M0 rule: ``X = 2**clamp(floor(log2(amax))
    - emax_elem, -127, 127)`` (``2**-127`` for amax 0, NaN for a non-finite amax), the
    exponent read from the float's bits (a subnormal amax clamps to -127 either way);
    stored as the E8M0 byte ``e + 127`` (0xFF: NaN), multiplier ``1 / X``.
    """
    if E8M0:
        EMAX: tl.constexpr = 8 if FP8_E4M3 else 15
        bits = amax.to(tl.int32, bitcast=True)
        finite = (bits & 0x7FFFFFFF) < 0x7F800000
        e = ((bits >> 23) & 0xFF) - (127 + EMAX)
        e = tl.where(amax > 0, e, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        # 1 / X = 2**-e; 2**-127 is the one subnormal power (e = 127).
        mult = tl.where(e <= 126, (127 - e) << 23, 0x00400000).to(tl.float32, bitcast=True)
        mult = tl.where(finite, mult, float("nan"))
        return mult, tl.where(finite, e + 127, 255).to(tl.uint8)
    else:
        FP8_MAX: tl.constexpr = 448.0 if FP8_E4M3 else 57344.0
        if EPS > 0:
            amax = tl.where(amax < EPS, EPS, amax)  # NaN stays NaN, like torch.clamp
        scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
        scale = tl.where((scale < float("inf")) & (amax > 0), scale, 1.0)
        if POW2:
            scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        return scale, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _cast(x, mult, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr):
    """fp8 bytes of ``clamp(x * mult)``. A NaN multiplier (E8M0 block with a non-finite
    amax) gives the positive NaN for every element, as torch's CPU multiply does even
    when ``x`` is a negative NaN (it keeps the second operand's NaN; numpy, which runs the
    interpreter, keeps the first)."""
    x = tl.where(mult == mult, x, float("nan"))
    return quantize_values(x, mult, FP8_E4M3, EMULATE)


@triton.jit
def _abs_bits(x, mask):
    """int32 bit patterns of ``|x|`` (0 outside ``mask``): they order like the values, NaN on top."""
    return tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def _tile_kernel(
    x_ptr, stride_r, stride_c,
    out_ptr,  # uint8 [R, C]
    sinv_ptr,  # fp32 or uint8 (E8M0) [ceil(R/BR), ceil(C/B)]
    out_t_ptr,  # uint8 [C, R]
    sinv_t_ptr,  # [ceil(C/BR), ceil(R/B)]
    flag_ptr,  # int32 [1]: set to 1 when x has a NaN/inf element
    R, C,
    B: tl.constexpr, TWO_D: tl.constexpr, COLUMNWISE: tl.constexpr,
    FP8_E4M3: tl.constexpr, E8M0: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr,
    EMULATE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = (pid_r * TR + tl.arange(0, TR)).to(tl.int64)
    cols = (pid_c * TC + tl.arange(0, TC)).to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x, mask)
    tl.atomic_max(flag_ptr, (tl.max(tl.max(bits, 1), 0) >= 0x7F800000).to(tl.int32))
    if TWO_D:
        # One B x B block per program (TR == TC == B): one scale for both layouts.
        amax = tl.max(tl.max(bits, 1), 0).to(tl.float32, bitcast=True)
        mult, sinv = _scales(amax, FP8_E4M3, E8M0, POW2, EPS)
        q = _cast(x, mult, FP8_E4M3, EMULATE)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
        tl.store(sinv_ptr + pid_r * tl.cdiv(C, B) + pid_c, sinv)
        if COLUMNWISE:
            tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q), mask=tl.trans(mask))
            tl.store(sinv_t_ptr + pid_c * tl.cdiv(R, B) + pid_r, sinv)
    else:
        NB_C: tl.constexpr = TC // B
        # Row-wise: blocks of B consecutive columns -> [TR, TC/B] amaxes.
        amax = tl.max(tl.reshape(bits, (TR, NB_C, B)), 2).to(tl.float32, bitcast=True)
        mult, sinv = _scales(amax, FP8_E4M3, E8M0, POW2, EPS)
        q = _cast(tl.reshape(x, (TR, NB_C, B)), mult[:, :, None], FP8_E4M3, EMULATE)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], tl.reshape(q, (TR, TC)), mask=mask)
        bcol = pid_c * NB_C + tl.arange(0, NB_C)
        tl.store(sinv_ptr + rows[:, None] * tl.cdiv(C, B) + bcol[None, :], sinv,
                 mask=(rows[:, None] < R) & (bcol[None, :] < tl.cdiv(C, B)))
        if COLUMNWISE:
            NB_R: tl.constexpr = TR // B
            # Column-wise: blocks of B consecutive rows -> [TR/B, TC] amaxes.
            amax_t = tl.max(tl.reshape(bits, (NB_R, B, TC)), 1).to(tl.float32, bitcast=True)
            mult_t, sinv_t = _scales(amax_t, FP8_E4M3, E8M0, POW2, EPS)
            q_t = _cast(tl.reshape(x, (NB_R, B, TC)), mult_t[:, None, :], FP8_E4M3, EMULATE)
            q_t = tl.reshape(q_t, (TR, TC))
            tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q_t), mask=tl.trans(mask))
            brow = pid_r * NB_R + tl.arange(0, NB_R)
            tl.store(sinv_t_ptr + cols[:, None] * tl.cdiv(R, B) + brow[None, :], tl.trans(sinv_t),
                     mask=(cols[:, None] < C) & (brow[None, :] < tl.cdiv(R, B)))


@triton.jit
def _row_col_amax_kernel(
    x_ptr, stride_r, stride_c, row_ptr, col_ptr, R, C,
    COLUMNWISE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):
    """Fold the tile's per-row (and per-column) ``max |x|`` into int32 bit-pattern buffers."""
    rows = (tl.program_id(0) * TR + tl.arange(0, TR)).to(tl.int64)
    cols = (tl.program_id(1) * TC + tl.arange(0, TC)).to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x, mask)
    tl.atomic_max(row_ptr + rows, tl.max(bits, 1), mask=rows < R)
    if COLUMNWISE:
        tl.atomic_max(col_ptr + cols, tl.max(bits, 0), mask=cols < C)


@triton.jit
def _row_cast_kernel(
    x_ptr, stride_r, stride_c,
    row_amax_ptr, col_amax_ptr,  # fp32 [R], [C]
    out_ptr, sinv_ptr, out_t_ptr, sinv_t_ptr,  # uint8 [R, C], fp32 [R], uint8 [C, R], fp32 [C]
    R, C,
    COLUMNWISE: tl.constexpr, FP8_E4M3: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr,
    EMULATE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
):
    """Cast a tile with one scale per row (row-wise copy) and per column (column-wise copy)."""
    pid_c = tl.program_id(1)
    rows = (tl.program_id(0) * TR + tl.arange(0, TR)).to(tl.int64)
    cols = (pid_c * TC + tl.arange(0, TC)).to(tl.int64)
    rmask, cmask = rows < R, cols < C
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    mult, sinv = _scales(tl.load(row_amax_ptr + rows, mask=rmask, other=0.0), FP8_E4M3, False, POW2, EPS)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], quantize_values(x, mult[:, None], FP8_E4M3, EMULATE),
             mask=mask)
    if pid_c == 0:
        tl.store(sinv_ptr + rows, sinv, mask=rmask)
    if COLUMNWISE:
        mult_t, sinv_t = _scales(tl.load(col_amax_ptr + cols, mask=cmask, other=0.0), FP8_E4M3, False, POW2, EPS)
        q_t = quantize_values(x, mult_t[None, :], FP8_E4M3, EMULATE)
        tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(q_t), mask=tl.trans(mask))
        if tl.program_id(0) == 0:
            tl.store(sinv_t_ptr + cols, sinv_t, mask=cmask)


def _tile_shape(block: int, two_d: bool, columnwise: bool) -> tuple[int, int, int]:
    """(TR, TC, num_warps): sides are multiples of the block wherever a block must fit."""
    if two_d:
        return block, block, 8
    if columnwise:
        # 1x128: one 128 x 128 tile; 1x32: several 32-element blocks each way.
        return (block, block, 8) if block >= 128 else (64, 64, 4)
    return (16 if INTERPRETED else 32), max(block, 64), 4


def block_quantize_tiles(
    x2d: torch.Tensor, block: int, two_d: bool, fp8_dtype: torch.dtype, *, e8m0: bool, power_2: bool,
    amax_epsilon: float, columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, str]:
    """``(data, scale_inv, data_t, scale_inv_t, nonfinite, variant)`` of 2-D ``x2d`` with
    ``1 x block`` (or ``block x block``) blocks; ``nonfinite``: int32 [1], 1 when ``x2d``
    has a NaN/inf element. Arguments are validated by the caller."""
    R, C = x2d.shape
    br = block if two_d else 1
    sdtype = torch.float8_e8m0fnu if e8m0 else torch.float32
    dev = x2d.device
    data = torch.empty((R, C), dtype=fp8_dtype, device=dev)
    sinv = torch.empty((triton.cdiv(R, br), triton.cdiv(C, block)), dtype=sdtype, device=dev)
    data_t = torch.empty((C, R), dtype=fp8_dtype, device=dev) if columnwise else None
    sinv_t = torch.empty((triton.cdiv(C, br), triton.cdiv(R, block)), dtype=sdtype, device=dev) if columnwise else None
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    emulated = emulate_conversions(dev)
    if R * C > 0:
        tr, tc, warps = _tile_shape(block, two_d, columnwise)
        u8 = data.view(torch.uint8)
        s8 = sinv.view(torch.uint8) if e8m0 else sinv
        _tile_kernel[(triton.cdiv(R, tr), triton.cdiv(C, tc))](
            x2d, x2d.stride(0), x2d.stride(1), u8, s8,
            data_t.view(torch.uint8) if columnwise else u8,
            (sinv_t.view(torch.uint8) if e8m0 else sinv_t) if columnwise else s8,
            flag, R, C,
            B=block, TWO_D=two_d, COLUMNWISE=columnwise, FP8_E4M3=fp8_dtype == torch.float8_e4m3fn,
            E8M0=e8m0, POW2=power_2, EPS=float(amax_epsilon), EMULATE=emulated, TR=tr, TC=tc, num_warps=warps,
        )
    return data, sinv, data_t, sinv_t, flag, variant("tiles", emulated)


def _row_tiles(C: int) -> tuple[int, int]:
    if INTERPRETED:
        # Few programs (the interpreter pays per op), still several per test shape.
        return 32, 64
    return 32, min(128, pow2(C, 16))


def row_col_amax(x2d: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fp32 ``(max |x| per row [R, 1], per column [C, 1] or None)``, NaN-propagating, one read."""
    R, C = x2d.shape
    row = torch.zeros(R, dtype=torch.int32, device=x2d.device)
    col = torch.zeros(C, dtype=torch.int32, device=x2d.device) if columnwise else None
    if R * C > 0:
        tr, tc = _row_tiles(C)
        _row_col_amax_kernel[(triton.cdiv(R, tr), triton.cdiv(C, tc))](
            x2d, x2d.stride(0), x2d.stride(1), row, col if columnwise else row, R, C,
            COLUMNWISE=columnwise, TR=tr, TC=tc,
        )
    # The int32 bit patterns of non-negative floats (and NaN) are the fp32 amaxes.
    return row.view(torch.float32).reshape(-1, 1), (col.view(torch.float32).reshape(-1, 1) if columnwise else None)


def row_cast(
    x2d: torch.Tensor, row_amax: torch.Tensor, col_amax: Optional[torch.Tensor], fp8_dtype: torch.dtype, *,
    power_2: bool, amax_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], str]:
    """``(data, scale_inv [R, 1], data_t, scale_inv_t [C, 1], variant)``: the row-wise
    recipe's cast with given fp32 amaxes (``row_amax [R, 1]``, ``col_amax [C, 1]`` or None)."""
    R, C = x2d.shape
    dev = x2d.device
    columnwise = col_amax is not None
    data = torch.empty((R, C), dtype=fp8_dtype, device=dev)
    # An empty row has no block (scale shape [R, 0]), like the torch path's ceil(0 / 1).
    sinv = torch.empty((R, int(C > 0)), dtype=torch.float32, device=dev)
    data_t = torch.empty((C, R), dtype=fp8_dtype, device=dev) if columnwise else None
    sinv_t = torch.empty((C, int(R > 0)), dtype=torch.float32, device=dev) if columnwise else None
    emulated = emulate_conversions(dev)
    if R * C > 0:
        tr, tc = _row_tiles(C)
        ra = row_amax.reshape(-1).to(torch.float32).contiguous()
        ca = col_amax.reshape(-1).to(torch.float32).contiguous() if columnwise else ra
        u8 = data.view(torch.uint8)
        _row_cast_kernel[(triton.cdiv(R, tr), triton.cdiv(C, tc))](
            x2d, x2d.stride(0), x2d.stride(1), ra, ca, u8, sinv,
            data_t.view(torch.uint8) if columnwise else u8, sinv_t if columnwise else sinv, R, C,
            COLUMNWISE=columnwise, FP8_E4M3=fp8_dtype == torch.float8_e4m3fn, POW2=power_2,
            EPS=float(amax_epsilon), EMULATE=emulated, TR=tr, TC=tc,
        )
    return data, sinv, data_t, sinv_t, variant("rows", emulated)
