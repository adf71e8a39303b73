"""Triton building blocks shared by the kernels: FP8/BF16 conversions, amax, GELU math.

Imported lazily (only when a Triton path is selected), so that importing
``tp_fuse.kernels`` never imports triton. Whether kernels run in the interpreter is
fixed when this module is imported (Triton decides it when ``@triton.jit`` decorates).

Float conversions and why some are emulated
-------------------------------------------
The torch reference casts fp32 to FP8 with round-to-nearest-even (RTNE) after a clamp
to +-fp8_max. On sm_89+ GPUs Triton lowers ``.to(fp8, fp_downcast_rounding="rtne")`` to
``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``, which is RTNE and saturating: bit-identical to
torch for every clamped finite input (NaN input gives the canonical NaN 0x7F without
the sign torch keeps; only NaN-ness is comparable there).

The Triton interpreter (``TRITON_INTERPRET=1``, used to test these kernels on CPU;
checked with triton 3.9.0) converts floats in ``interpreter._convert_float`` and gets
several cases wrong, with or without ``fp_downcast_rounding="rtne"``. Found by
comparing every bf16 bit pattern (with 7 low halves each) and all fp8 halfway points
against torch; tests/test_kernels_interpret.py fails (96 cases) if EMULATE is turned
off in the interpreter:

* fp32 -> fp8 rounds ties away from zero instead of to even (0.0166015625 -> 0x09
  instead of 0x08);
* a mantissa carry is OR-ed into the exponent instead of added, so values just below a
  power of two can come out halved (e4m3: 0.0302734375 -> 0.015625 instead of 0.03125);
* results in the fp8 subnormal range are truncated, not rounded; fp32 subnormal inputs
  produce garbage (2.7e-40 -> 0.0078 in e4m3); NaN becomes 256 (e4m3) or inf (e5m2);
* fp32 -> bf16 truncates (rounds toward zero) instead of RTNE, and mangles bf16
  subnormals even when the value is exactly representable;
* fp8 -> fp16/fp32 decodes e5m2 subnormals wrongly (0x01 -> 0) and NaN/inf as finite
  numbers; ``tl.dot`` on fp8 operands uses that decode.

So kernels take ``EMULATE: tl.constexpr``: when true, every fp32->fp8, fp32->bf16 and
fp8->float conversion is done in integer arithmetic here (RTNE, exact, identical on
any backend). It is on in the interpreter and on GPUs without native FP8 conversions
(< sm_89); elsewhere the hardware conversions are used. fp32 <-> fp16 and bf16 -> fp32
are correct in the interpreter and are not emulated.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .dispatch import cuda_capability

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton without the knobs module
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

TL_DTYPE = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
}


def emulate_conversions(device: torch.device) -> bool:
    """Whether kernels on ``device`` must emulate float conversions (see module doc)."""
    if INTERPRETED:
        return True
    return cuda_capability(device) < (8, 9)


def variant(name: str, emulated: bool) -> str:
    return name + ("+emulated-casts" if emulated else "")


def amax_buffer(device: torch.device) -> torch.Tensor:
    """int32 accumulator for ``abs_max_bits`` partial results (atomic max)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def amax_target(
    device: torch.device, with_amax: bool, amax_out: Optional[torch.Tensor], placeholder: torch.Tensor
) -> tuple[torch.Tensor, bool, Optional[torch.Tensor]]:
    """Where a kernel folds its ``abs_max_bits``: ``(int32 pointer, WITH_AMAX, fp32 amax
    to return)``.

    ``amax_out`` (a one-element fp32 tensor holding a value >= 0 or NaN, e.g. a delayed
    quantizer's history slot): the kernel maxes into it directly -- no zero-filled
    buffer, no ``maximum`` after. Else, with ``with_amax``, a fresh zeroed buffer (one
    fill); without, no amax at all (``placeholder`` is passed, never touched).
    """
    if amax_out is not None:
        return amax_out.view(torch.int32), True, amax_out
    if with_amax:
        buf = amax_buffer(device)
        return buf, True, amax_from_buffer(buf)
    return placeholder, False, None


def amax_from_buffer(buf: torch.Tensor) -> torch.Tensor:
    """Reinterpret the int32 accumulator as the fp32 0-d amax."""
    return buf.view(torch.float32).reshape(())


def pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(n, 1)))


@triton.jit
def fp32_to_fp8_bits(v, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr):
    """RTNE fp32 -> fp8 byte (uint8). ``v`` must already be clamped to +-fp8_max or NaN."""
    if EMULATE:
        MANT: tl.constexpr = 3 if FP8_E4M3 else 2
        BIAS: tl.constexpr = 7 if FP8_E4M3 else 15
        SHIFT: tl.constexpr = 23 - MANT
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        e = a >> 23
        # Normal results: round the SHIFT dropped mantissa bits to nearest even. A carry
        # out of the mantissa correctly bumps the exponent (plain integer addition).
        normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
        # Subnormal results: q = m * 2**(e_eff - 150) / 2**(1 - BIAS - MANT), rounded to
        # nearest even; shifts past 26 bits leave 0 with a sub-half remainder.
        m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        s = tl.minimum(tl.maximum((151 - BIAS - MANT) - tl.maximum(e, 1), 1), 26)
        q = m >> s
        rem = m - (q << s)
        half = 1 << (s - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        sub = q + up.to(tl.int32)
        code = tl.where(e >= 128 - BIAS, normal, sub)
        code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN, as torch encodes it
        return (code | sign).to(tl.uint8)
    else:
        if FP8_E4M3:
            return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            return v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def fp8_bits_to_fp32(c, FP8_E4M3: tl.constexpr):
    """Exact fp8 byte -> fp32 decode in integer arithmetic (e4m3fn or e5m2)."""
    MANT: tl.constexpr = 3 if FP8_E4M3 else 2
    BIAS: tl.constexpr = 7 if FP8_E4M3 else 15
    EMAX: tl.constexpr = 15 if FP8_E4M3 else 31
    c = c.to(tl.int32) & 0xFF
    negative = (c & 0x80) != 0
    e = (c >> MANT) & EMAX
    m = c & ((1 << MANT) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    subnormal = m.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))
    mag = tl.where(e == 0, subnormal, normal)
    if FP8_E4M3:
        mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)  # e4m3fn: no inf, one NaN
    else:
        mag = tl.where(e == EMAX, tl.where(m == 0, float("inf"), float("nan")), mag)
    return tl.where(negative, -mag, mag)


@triton.jit
def round_to(v, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> DTYPE (fp32/bf16/fp16) with RTNE."""
    if DTYPE == tl.bfloat16:
        if EMULATE:
            bits = v.to(tl.int32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # arithmetic shift: fits int16
            r = tl.where(v != v, 0x7FC0, r)
            # Build the bf16 from its bits: even an exact fp32 -> bf16 cast mangles
            # subnormals in the interpreter.
            return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(tl.bfloat16)
    else:
        return v.to(DTYPE)


@triton.jit
def quantize_values(v, scale, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``v`` -> fp8 bytes of clamp(v * scale, -max, max); NaN stays NaN."""
    FP8_MAX: tl.constexpr = 448.0 if FP8_E4M3 else 57344.0
    q = tl.clamp(v * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return fp32_to_fp8_bits(q, FP8_E4M3, EMULATE)


@triton.jit
def fold_amax(amax_ptr, v, mask, WITH_AMAX: tl.constexpr):
    """``atomic_max`` of the tile's ``abs_max_bits`` into ``amax_ptr`` when ``WITH_AMAX``."""
    if WITH_AMAX:
        tl.atomic_max(amax_ptr, abs_max_bits(v, mask))


@triton.jit
def write_scale_inv(sinv_ptr, scale, WRITE_SINV: tl.constexpr):
    """The first program stores ``1 / scale`` (IEEE division, as ``torch.reciprocal``)."""
    if WRITE_SINV:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(sinv_ptr, tl.div_rn(tl.full([], 1.0, tl.float32), scale))


@triton.jit
def current_scale(amax, FP8_E4M3: tl.constexpr, POW2: tl.constexpr):
    """``(scale, nonfinite, zero)`` from an fp32 amax, as
    ``quantization.scaling.current_scale_and_checks`` computes them: ``fp8_max / amax`` in
    float64 (PTX div.rn.f64, correctly rounded), clamped to the fp32 range, rounded down to
    a power of two with ``POW2`` (the float64's mantissa cleared: exact for the normal
    values the clamp leaves), rounded to fp32 once; 1.0 for a zero or non-finite amax."""
    FP8_MAX: tl.constexpr = 448.0 if FP8_E4M3 else 57344.0
    amax64 = amax.to(tl.float64)
    finite = amax64 < float("inf")  # False for NaN too
    zero = amax64 == 0.0
    usable = finite & (amax64 > 0.0)
    scale64 = tl.minimum(FP8_MAX / tl.where(usable, amax64, 1.0), 3.4028234663852886e38)
    if POW2:
        scale64 = (scale64.to(tl.int64, bitcast=True) & -4503599627370496).to(tl.float64, bitcast=True)
    scale = tl.where(usable, scale64.to(tl.float32), 1.0)
    return scale, ~finite, zero


@triton.jit
def abs_max_bits(v, mask):
    """max |v| over the unmasked elements, as the int32 bit pattern of an fp32.

    For non-negative floats the bit patterns order like the values, and every NaN
    pattern is above +inf: an integer max is an exact, NaN-propagating float max
    (``tl.max`` on floats would drop NaN on GPUs), and ``tl.atomic_max`` on int32 then
    combines programs exactly.
    """
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(tl.where(mask, bits, 0))


@triton.jit
def store_result(ptrs, v, mask, scale, QUANT: tl.constexpr, FP8_E4M3: tl.constexpr, EMULATE: tl.constexpr):
    """Store fp32 ``v`` as the output dtype of ``ptrs``, or as fp8 bytes when QUANT."""
    if QUANT:
        tl.store(ptrs, quantize_values(v, scale, FP8_E4M3, EMULATE), mask=mask)
    else:
        tl.store(ptrs, round_to(v, ptrs.dtype.element_ty, EMULATE), mask=mask)


@triton.jit
def sigmoid_parts(z):
    """fp32 (sigmoid(z), 1 - sigmoid(z)) without cancellation or overflow (see _common)."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    er = e * r
    pos = z >= 0
    return tl.where(pos, r, er), tl.where(pos, er, r)


@triton.jit
def gelu_parts(x):
    """fp32 (s, 1 - s), s = sigmoid(2u), u = k (x + c x^3): tanh-GELU = x s."""
    return sigmoid_parts((2.0 * 0.7978845608028654) * (x + 0.044715 * (x * x * x)))
