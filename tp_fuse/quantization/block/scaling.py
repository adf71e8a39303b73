"""Block-scaled quantization math (torch reference, any device).

A 2-D tensor ``x [R, C]`` is cut into blocks of ``block = (br, bc)`` elements
(``bc = None``: the whole row, i.e. row-wise scaling); the last block of a row or
column may be partial. Every block gets one scale from its own amax; the stored
``scale_inv`` has shape ``[ceil(R/br), ceil(C/bc)]`` and the represented value is::

    x[i, j] ~= data[i, j] * scale_inv[i // br, j // bc]

Scale rules (:class:`ScaleRule`):

* ``"fp32"`` (blockwise 1x128 / 128x128, row-wise): ``scale = fp8_max / amax``
  (amax raised to ``amax_epsilon`` first), rounded down to a power of two when
  ``power_2``; an all-zero block (or a non-finite scale) gets scale 1. ``scale_inv``
  is fp32 and exactly ``1 / scale`` for power-of-two scales.
* ``"e8m0"`` (MXFP8, OCP MX v1.0 section 6.3): ``scale_inv = X = 2**(floor(log2(amax))
  - emax_elem)`` with the exponent clamped to [-127, 127]; an all-zero block gets
  ``2**-127``; a non-finite amax gives the E8M0 NaN. ``scale_inv`` is
  ``torch.float8_e8m0fnu``.

The cast is ``clamp(x * scale, -fp8_max, fp8_max).to(fp8_dtype)`` -- saturating,
round-to-nearest-even (OCP's "saturating" conversion); for E8M0, ``scale = 1 / X``
(exact: X is a power of two).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import torch

from ...kernels.fp8_emulation import fp8_to_float
from ...recipe import fp8_dtype_max

__all__ = ["ScaleRule", "BlockSpec", "quantize_blocks", "dequantize_blocks", "expand_scales", "block_amax"]

# Largest unbiased exponent of the element format (OCP MX emax_elem).
_EMAX_ELEM = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
# fp32 sign and exponent bits (0xFF800000 as int32).
_EXPONENT_MASK = -(1 << 23)


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """How a block's scale follows from its amax (see the module docstring)."""

    kind: Literal["fp32", "e8m0", "nvfp4"] = "fp32"
    power_2: bool = True
    amax_epsilon: float = 0.0


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """Block shape ``(rows, cols)`` of one quantized layout; ``cols=None``: whole rows."""

    rows: int = 1
    cols: Optional[int] = 128

    def __post_init__(self) -> None:
        assert self.rows >= 1 and (self.cols is None or self.cols >= 1)

    def cols_for(self, ncols: int) -> int:
        """Block width for a tensor of ``ncols`` columns (whole row when ``cols`` is None)."""
        return max(ncols, 1) if self.cols is None else self.cols

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        r, c = shape
        return (math.ceil(r / self.rows), math.ceil(c / self.cols_for(c)))

    def describe(self) -> str:
        return "1xK (row)" if self.cols is None else f"{self.rows}x{self.cols}"


def _pad_to_blocks(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    r, c = x.shape
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x


def block_amax(x: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """amax(|x|) per block, fp32 ``[ceil(R/br), ceil(C/bc)]``; NaN propagates."""
    assert x.dim() == 2
    br, bc = spec.rows, spec.cols_for(x.shape[1])
    xp = _pad_to_blocks(x.detach().abs().to(torch.float32), br, bc)
    gr, gc = xp.shape[0] // br, xp.shape[1] // bc
    # [gr, br, gc, bc] -> max over the two in-block axes. amax of NaN is NaN.
    return xp.view(gr, br, gc, bc).amax(dim=(1, 3))


def expand_scales(scale_inv: torch.Tensor, spec: BlockSpec, shape: tuple[int, int]) -> torch.Tensor:
    """Per-element fp32 ``scale_inv`` of shape ``shape`` (blocks repeated, cropped)."""
    r, c = shape
    br, bc = spec.rows, spec.cols_for(c)
    s = scale_inv.to(torch.float32)
    return s.repeat_interleave(br, dim=0)[:r].repeat_interleave(bc, dim=1)[:, :c]


def _mul_blocks(x: torch.Tensor, per_block: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """fp32 ``x * per_block`` with each block's value broadcast over its elements."""
    r, c = x.shape
    br, bc = spec.rows, spec.cols_for(c)
    x = fp8_to_float(x)
    if r % br == 0 and c % bc == 0:
        # Whole blocks: broadcast over a [gr, br, gc, bc] view, no per-element scale tensor.
        gr, gc = r // br, c // bc
        return (x.view(gr, br, gc, bc) * per_block.to(torch.float32).view(gr, 1, gc, 1)).view(r, c)
    return x * expand_scales(per_block, spec, (r, c))


def _floor_pow2(v: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``v`` for positive normal fp32 ``v`` (0 stays 0), exactly.

    Clears the mantissa bits, as Transformer Engine does. ``exp2(floor(log2(v)))`` is not
    exact: fp32 ``log2`` rounds ``log2(2**k * (1 - 2**-24))`` up to ``k``, which gives
    ``2**k`` -- larger than ``v`` -- for the float just below every power of two.
    """
    return (v.to(torch.float32).view(torch.int32) & _EXPONENT_MASK).view(torch.float32)


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """``floor(log2(v))`` of positive finite ``v`` (fp32 result), exactly, subnormals included."""
    return (torch.frexp(v.to(torch.float32))[1] - 1).to(torch.float32)


def _scales_from_amax(
    amax: torch.Tensor, fp8_dtype: torch.dtype, rule: ScaleRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale_inv as stored, fp32 multiplier applied before the cast)``."""
    fp8_max = fp8_dtype_max(fp8_dtype)
    if rule.kind == "e8m0":
        finite = torch.isfinite(amax)
        safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
        exp = _floor_log2(safe) - _EMAX_ELEM[fp8_dtype]
        exp = torch.where(amax > 0, exp, torch.full_like(exp, -127.0)).clamp(-127.0, 127.0)
        x = torch.exp2(exp)
        x = torch.where(finite, x, torch.full_like(x, float("nan")))
        return x.to(torch.float8_e8m0fnu), torch.reciprocal(x)
    amax = torch.clamp(amax, min=rule.amax_epsilon) if rule.amax_epsilon > 0 else amax
    # One correctly rounded division (TE's fp8_max / amax); ``fp8_max / amax`` with a
    # Python float is reciprocal-then-multiply in torch, two roundings.
    scale = torch.div(torch.full_like(amax, fp8_max), amax)
    # Zero amax (inf scale), NaN amax: scale 1 (the block's data is 0, or NaN anyway).
    scale = torch.where(torch.isfinite(scale) & (amax > 0), scale, torch.ones_like(scale))
    if rule.power_2:
        scale = _floor_pow2(scale)
    return torch.reciprocal(scale), scale


def quantize_blocks(
    x: torch.Tensor, spec: BlockSpec, fp8_dtype: torch.dtype, rule: ScaleRule, amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale_inv)`` of 2-D ``x`` quantized block by block (module docstring).

    ``amax``: the per-block amaxes when the caller already has them (e.g. reduced over
    ranks); default :func:`block_amax` of ``x``.
    """
    assert x.dim() == 2
    if amax is None:
        amax = block_amax(x, spec)
    assert tuple(amax.shape) == spec.scale_shape(tuple(x.shape))
    scale_inv, scale = _scales_from_amax(amax, fp8_dtype, rule)
    fp8_max = fp8_dtype_max(fp8_dtype)
    # Multiply by the scale (TE's convention); for power-of-two scales (always for
    # E8M0) this is exact and equals dividing by scale_inv.
    scaled = _mul_blocks(x.detach(), scale, spec)
    data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return data, scale_inv


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """fp32 ``data * scale_inv`` per block (the inverse of :func:`quantize_blocks`)."""
    return _mul_blocks(data, scale_inv, spec)
