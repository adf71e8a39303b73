"""Triton kernel of NVFP4 quantization with 1x16 or 16x16 blocks (one layout per call).

Semantics, bit for bit: ``tp_fuse.quantization.nvfp4.scaling.quantize_nvfp4`` with
``BlockSpec(1, 16)`` or ``BlockSpec(16, 16)`` -- per block (16 values of a row, or a
16x16 tile), the E4M3 block scale
``e4m3(clamp(amax_blk * mult, <= 448))`` and the E2M1 codes of
``clamp(x * min(1 / (scale * S_dec), FLT_MAX), -6, 6)``, rounded to nearest even or
stochastically with the same counter-based hash of (seed, global row, global column).
The per-tensor factors ``mult = S_enc * fp32(1/6)`` and ``S_dec`` come from the host (they
are two scalars: computed once, with torch's correctly rounded fp32 arithmetic).

Casts to E4M3 use ``_triton_common.fp32_to_fp8_bits`` (integer RTNE emulation in the
interpreter and before sm_89); the E2M1 rounding is exact fp32/int arithmetic (the
magnitude over its binade's spacing, rounded half to even), as in the torch code.
One program owns ``BR`` rows x ``BC`` columns (``BC`` a multiple of 32, ``BR`` of 16 for
16x16 blocks); it loads the
even and the odd columns separately, so the two nibbles of a byte are in matching lanes.

Untested on a GPU (no GPU here): tested bit-exact against the torch quantizer under
``TRITON_INTERPRET=1`` (``tests/test_nvfp4_triton.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._triton_common import emulate_conversions, fp8_bits_to_fp32, fp32_to_fp8_bits

__all__ = ["nvfp4_quantize", "nvfp4_quantize_1x16"]

_M32 = 0xFFFFFFFF


@triton.jit
def _mix32(x):
    # Same 32-bit hash as nvfp4.scaling._mix32, in int64 (products stay below 2**63).
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _e2m1_code(scaled, u, SR: tl.constexpr):
    """E2M1 code (int32 0..15) of fp32 ``scaled`` in [-6, 6]; ``u`` uniform when ``SR``."""
    a = tl.abs(scaled)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    t = a / step  # exact: step is a power of two
    f = t.to(tl.int32).to(tl.float32)  # floor (t >= 0)
    r = t - f
    if SR:
        up = u < r
    else:
        odd = (f.to(tl.int32) & 1) == 1
        up = (r > 0.5) | ((r == 0.5) & odd)
    q = (f + up.to(tl.float32)) * step
    mag = tl.where(q < 2.0, q * 2.0, tl.where(q < 4.0, q + 2.0, q * 0.5 + 4.0)).to(tl.int32)
    return mag | tl.where(scaled < 0.0, 8, 0)


@triton.jit
def _uniform(seed_mixed, rows, cols):
    hr = _mix32(seed_mixed + _mix32(rows))
    hc = _mix32(cols + 0x632BE5A)
    h = ((hr ^ hc) * 0x45D9F3B) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    return (h & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _nvfp4_1x16_kernel(
    x_ptr, data_ptr, scale_ptr, factors_ptr, R, C, stride_r, stride_c, seed_mixed, row_offset, col_offset,
    SR: tl.constexpr, TWO_D: tl.constexpr, EMULATE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    HALF: tl.constexpr = BC // 2
    NB: tl.constexpr = BC // 16
    G: tl.constexpr = BR // 16  # 16-row groups of the tile (2-D blocks)
    rows = pid_r * BR + tl.arange(0, BR)
    pairs = pid_c * HALF + tl.arange(0, HALF)  # byte index within the row
    rmask = rows < R
    mask = rmask[:, None] & (pairs[None, :] < C // 2)
    base = x_ptr + rows[:, None].to(tl.int64) * stride_r
    ev = tl.load(base + (2 * pairs[None, :]).to(tl.int64) * stride_c, mask=mask, other=0.0).to(tl.float32)
    od = tl.load(base + (2 * pairs[None, :] + 1).to(tl.int64) * stride_c, mask=mask, other=0.0).to(tl.float32)
    mult = tl.load(factors_ptr)
    s_dec = tl.load(factors_ptr + 1)
    # Block amax over [BR, NB, 8] even + 8 odd values (NaN propagates through maximum).
    am = tl.maximum(tl.max(tl.reshape(tl.abs(ev), (BR, NB, 8)), axis=2),
                    tl.max(tl.reshape(tl.abs(od), (BR, NB, 8)), axis=2))
    if TWO_D:
        # 16x16 blocks: the tile's rows start on a block boundary (BR % 16 == 0), so the
        # block amax is a max over each group of 16 rows; rows past R loaded as 0.
        am = tl.max(tl.reshape(am, (G, 16, NB)), axis=1)
    pre = tl.minimum(am * mult, 3.4028234663852886e38)
    pre = tl.minimum(tl.maximum(pre, -448.0), 448.0)
    sbits = fp32_to_fp8_bits(pre, True, EMULATE)
    sval = fp8_bits_to_fp32(sbits, True)
    enc = tl.math.div_rn(tl.full(sval.shape, 1.0, tl.float32), sval * s_dec)
    enc = tl.minimum(enc, 3.4028234663852886e38)
    if TWO_D:
        enc_r = tl.reshape(tl.broadcast_to(enc[:, None, :], (G, 16, NB)), (BR, NB))
    else:
        enc_r = enc
    enc_e = tl.reshape(tl.broadcast_to(enc_r[:, :, None], (BR, NB, 8)), (BR, HALF))
    se = tl.minimum(tl.maximum(ev * enc_e, -6.0), 6.0)
    so = tl.minimum(tl.maximum(od * enc_e, -6.0), 6.0)
    if SR:
        grow = (rows + row_offset).to(tl.int64)[:, None]
        gcol = (2 * pairs + col_offset).to(tl.int64)[None, :]
        ue = _uniform(seed_mixed, grow, gcol)
        uo = _uniform(seed_mixed, grow, gcol + 1)
    else:
        ue = se
        uo = so
    byte = _e2m1_code(se, ue, SR) | (_e2m1_code(so, uo, SR) << 4)
    tl.store(data_ptr + rows[:, None].to(tl.int64) * (C // 2) + pairs[None, :], byte.to(tl.uint8), mask=mask)
    blocks = pid_c * NB + tl.arange(0, NB)
    if TWO_D:
        srows = pid_r * G + tl.arange(0, G)
        smask = (srows < (R + 15) // 16)[:, None] & (blocks[None, :] < C // 16)
        tl.store(scale_ptr + srows[:, None].to(tl.int64) * (C // 16) + blocks[None, :], sbits, mask=smask)
    else:
        smask = rmask[:, None] & (blocks[None, :] < C // 16)
        tl.store(scale_ptr + rows[:, None].to(tl.int64) * (C // 16) + blocks[None, :], sbits, mask=smask)


def _mix32_host(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x45D9F3B) & _M32
    x ^= x >> 16
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def nvfp4_quantize_1x16(
    x: torch.Tensor,
    mult: torch.Tensor,
    s_dec: torch.Tensor,
    *,
    sr_seed: Optional[int] = None,
    row_offset: int = 0,
    col_offset: int = 0,
    block_rows: int = 16,
    block_cols: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [R, C/2], E4M3 scale bytes [R, C/16])`` of 2-D ``x`` (C % 16 == 0).

    ``mult``/``s_dec``: the per-tensor fp32 factors (``S_enc * fp32(1/6)``, ``1 / S_enc``).
    """
    return nvfp4_quantize(x, mult, s_dec, two_d=False, sr_seed=sr_seed, row_offset=row_offset,
                          col_offset=col_offset, block_rows=block_rows, block_cols=block_cols)


def nvfp4_quantize(
    x: torch.Tensor,
    mult: torch.Tensor,
    s_dec: torch.Tensor,
    *,
    two_d: bool,
    sr_seed: Optional[int] = None,
    row_offset: int = 0,
    col_offset: int = 0,
    block_rows: int = 16,
    block_cols: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [R, C/2], E4M3 scale bytes)`` of 2-D ``x`` (C % 16 == 0): 1x16
    blocks (scales ``[R, C/16]``) or, with ``two_d``, 16x16 blocks (``[ceil(R/16), C/16]``).

    ``x`` may be any strided view (a transposed view quantizes the column-wise copy without
    a copy). ``mult``/``s_dec``: the per-tensor fp32 factors (``S_enc * fp32(1/6)``,
    ``1 / S_enc``); ``sr_seed``: stochastic rounding (None: nearest); ``row_offset`` /
    ``col_offset``: where ``x`` sits in the whole tensor, for the rounding bits.
    """
    r, c = x.shape
    assert c % 16 == 0 and block_cols % 32 == 0 and (not two_d or block_rows % 16 == 0)
    data = torch.empty(r, c // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty((r + 15) // 16 if two_d else r, c // 16, dtype=torch.uint8, device=x.device)
    factors = torch.stack([mult.reshape(()), s_dec.reshape(())]).to(device=x.device, dtype=torch.float32)
    seed_mixed = 0 if sr_seed is None else _mix32_host(int(sr_seed) + 0x9E3779B)
    grid = (triton.cdiv(max(r, 1), block_rows), triton.cdiv(max(c, 1), block_cols))
    _nvfp4_1x16_kernel[grid](
        x, data, scales, factors, r, c, x.stride(0), x.stride(1), seed_mixed, row_offset, col_offset,
        SR=sr_seed is not None, TWO_D=bool(two_d), EMULATE=emulate_conversions(x.device), BR=block_rows, BC=block_cols,
    )
    return data, scales
