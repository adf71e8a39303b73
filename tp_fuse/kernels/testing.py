"""Test utilities for FP8 kernels: an independent float64 FP8 rounding and ULP distances.

``fp8_round_reference`` does not use torch's float8 conversion: it rounds to the
nearest representable value from the format's value table, ties to the even code,
saturating at +-max, NaN to ``0x7F | sign``. Tests use it to check the torch reference
cast itself; the Triton kernels are then checked bit-for-bit against torch.
"""

from __future__ import annotations

import torch

from ._common import FP8_MAX

__all__ = ["fp8_round_reference", "fp8_ulp_distance", "max_fp8_ulp_distance"]


def _finite_table(fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative finite values of the format, ascending, and their codes."""
    codes = torch.arange(128, dtype=torch.int16).to(torch.uint8)
    vals = codes.view(fp8_dtype).double()
    keep = vals.isfinite()
    return vals[keep], codes[keep].long()


def fp8_round_reference(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating round-to-nearest-even of ``v`` (any float dtype, exact in float64)."""
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"fp8_dtype: expected float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    vals, codes = _finite_table(fp8_dtype)
    x = v.double().reshape(-1)
    mag = x.abs().clamp(max=FP8_MAX[fp8_dtype])
    hi = torch.searchsorted(vals, mag).clamp(max=len(vals) - 1)  # first value >= mag
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - vals[lo], vals[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    code = torch.where(pick_hi, codes[hi], codes[lo])
    code = torch.where(x.isnan(), torch.full_like(code, 0x7F), code)
    code = code | torch.where(torch.signbit(x), 0x80, 0)
    return code.to(torch.uint8).view(fp8_dtype).reshape(v.shape)


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude fp8 bytes -> integers that order like the values (+-0 -> 0)."""
    b = t.view(torch.uint8).long()
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def fp8_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in representable steps between two fp8 tensors.

    Both NaN: 0; exactly one NaN: 255 (never within tolerance).
    """
    if a.dtype != b.dtype or a.dtype not in FP8_MAX:
        raise ValueError(f"a, b: expected two tensors of one fp8 dtype, got {a.dtype} and {b.dtype}")
    dist = (_ordered(a) - _ordered(b)).abs()
    na, nb = a.float().isnan(), b.float().isnan()
    dist = torch.where(na & nb, 0, dist)
    return torch.where(na ^ nb, 255, dist)


def max_fp8_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    d = fp8_ulp_distance(a, b)
    return int(d.max()) if d.numel() else 0


LAYOUTS = ("contiguous", "transposed", "strided")


def make_input(shape: tuple[int, ...], dtype: torch.dtype, layout: str = "contiguous", *, seed: int = 0,
               std: float = 3.0, device: str = "cpu") -> torch.Tensor:
    """Random test input with a given memory layout.

    ``transposed``: a 2-D tensor stored column-major (the transpose of a contiguous one);
    ``strided``: every other column of a wider tensor (inner stride 2).
    """
    g = torch.Generator().manual_seed(seed)

    def randn(*s: int) -> torch.Tensor:
        return (torch.randn(s, generator=g) * std).to(device=device, dtype=dtype)

    # Cast before re-striding: .to() of a non-dense view would return a contiguous copy.
    if layout == "contiguous":
        return randn(*shape)
    if layout == "transposed":
        if len(shape) != 2:
            raise ValueError(f"shape: the transposed layout needs 2-D, got {shape}")
        return randn(*shape[::-1]).t()
    if layout == "strided":
        return randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
