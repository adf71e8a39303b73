"""NVFP4 quantization math (torch reference, any device).

NVFP4 stores FP4 E2M1 values (``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives), two
per byte, with two levels of scaling (Transformer Engine's ``NVFP4BlockScaling``):

* a per-tensor FP32 scale from the tensor's amax: ``g = amax / (6 * 448)``;
* one E4M3 scale per block of 16 values of a row (``BlockSpec(1, 16)``) or per 16x16
  tile (``BlockSpec(16, 16)``, weights).

Quantizing a 2-D ``x [R, C]`` (fp32 arithmetic, in this order, as TE's reference)::

    S_enc   = min(448 * 6 / amax, FLT_MAX), 1 when that is 0     # per tensor
    S_dec   = 1 / S_enc
    s_blk   = e4m3(clamp(min(amax_blk * (S_enc * fp32(1/6)), FLT_MAX), -448, 448))
    enc_blk = min(1 / (fp32(s_blk) * S_dec), FLT_MAX)
    q       = e2m1(clamp(x * enc_blk, -6, 6))

``e4m3`` is torch's saturating-free cast (round to nearest even; the clamp keeps it
finite). ``e2m1`` rounds to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), or stochastically (below). ``-0.0``
encodes as +0; small negatives that round to zero keep their sign bit (``-0``).

Decoding (TE's dequantize kernel): ``x ~= e2m1 * (fp32(s_blk) * amax * fp32(1/2688))``.
A GEMM instead multiplies the exact products ``e2m1 * s_blk`` and applies
``alpha = amax_a * amax_b / (6 * 6 * 448 * 448)`` to the fp32 result, as the tensor
cores do (:func:`gemm_alpha`).

**Stochastic rounding** (gradients): ``|v|`` between neighbours ``lo < hi`` rounds up
with probability ``(|v| - lo) / (hi - lo)`` (unbiased). The uniform numbers come from a
counter-based hash of ``(seed, row, column)`` in the coordinates of the tensor being
quantized -- so a shard quantized with its global row offset gets exactly the bits the
whole tensor would, which keeps the overlapped all-gather bit-identical to quantizing
after the gather.

**Random Hadamard transform** (:func:`apply_rht`): each run of 16 values along the last
dimension is multiplied by ``diag(signs) @ H16 / 4`` (orthogonal; TE's fixed sign
vector). Computed in float64 and rounded once to fp32.

Packing: element ``2j`` of a row in the low nibble of byte ``j``, ``2j + 1`` in the high
nibble (TE's layout); bit 3 of a nibble is the sign.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ...recipe import FP4_DTYPE, FP4_MAX
from ..block.scaling import BlockSpec, block_amax, expand_scales

__all__ = [
    "NVFP4_BLOCK",
    "NVFP4_BLOCK_2D",
    "E4M3_MAX",
    "FP4_VALUES",
    "encode_e2m1",
    "encode_e2m1_stochastic",
    "decode_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "rht_matrix",
    "apply_rht",
    "sr_uniform",
    "global_scales",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "block_decode_values",
    "gemm_alpha",
]

NVFP4_BLOCK = BlockSpec(1, 16)
NVFP4_BLOCK_2D = BlockSpec(16, 16)
E4M3_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max
#: Magnitudes of codes 0..7; codes 8..15 are the negatives.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# TE's fixed sign vector of the wgrad RHT.
_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
_M32 = 0xFFFFFFFF


def _table(values: tuple, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _code_of(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """E2M1 code of representable magnitudes ``q`` (0..6) with the sign of ``v``."""
    # 0, .5, 1, 1.5 -> 2q; 2, 3 -> q + 2; 4, 6 -> q / 2 + 4 (exact in fp32).
    mag = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q * 0.5 + 4)).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def _step(a: torch.Tensor) -> torch.Tensor:
    # Spacing of E2M1 magnitudes around a: 0.5 below 2, 1 below 4, 2 up to 6.
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) of fp32 ``v`` already clamped to [-6, 6]; nearest, ties to even.

    Within each binade the magnitudes are multiples of its spacing, and even multiples are
    even codes, so ``torch.round`` (half to even) of ``a / step`` is the E2M1 rounding.
    """
    a = v.abs()
    step = _step(a)
    return _code_of(torch.round(a / step) * step, v)


def encode_e2m1_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``v`` (clamped to [-6, 6]) rounded up in magnitude when ``u < p``,
    ``p = (|v| - lo) / (hi - lo)``, ``u`` uniform in [0, 1) of ``v``'s shape."""
    a = v.abs()
    step = _step(a)
    lo = torch.floor(a / step) * step  # largest representable <= a (6 stays 6)
    p = (a - lo) / step
    return _code_of(torch.where(u < p, lo + step, lo), v)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (uint8 0..15)."""
    vals = _table(FP4_VALUES + tuple(-x for x in FP4_VALUES), codes.device, dtype)
    return vals[codes.to(torch.long)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` codes (C even) -> ``[R, C/2]`` ``torch.float4_e2m1fn_x2`` (element 2j low nibble)."""
    assert codes.dim() == 2 and codes.shape[1] % 2 == 0
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous().view(FP4_DTYPE)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C/2]`` packed FP4 -> ``[R, C]`` uint8 codes."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(b.shape[0], b.shape[1] * 2)


@functools.lru_cache(maxsize=None)
def _rht_matrix_cpu() -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < 16:  # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(_RHT_SIGNS, dtype=torch.float64)
    return (signs[:, None] * h) / 4.0


def rht_matrix(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The 16x16 RHT matrix ``diag(signs) @ H16 / 4`` in float64 (orthogonal: ``M @ M.T = I``)."""
    return _rht_matrix_cpu().to(device)


def apply_rht(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each run of 16 values along the last dim multiplied by :func:`rht_matrix` (fp32)."""
    if x.shape[-1] % 16:
        raise ValueError(
            f"random Hadamard transform: the transformed dimension ({x.shape[-1]}) must be a multiple of 16"
        )
    m = rht_matrix(x.device)
    out = x.detach().to(torch.float64).reshape(-1, 16) @ m
    return out.to(torch.float32).reshape(x.shape)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # 32-bit integer hash in int64 arithmetic; constants < 2**27 keep products below 2**63.
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def sr_uniform(
    seed: torch.Tensor, shape: tuple[int, int], device: torch.device, row_offset: int = 0, col_offset: int = 0
) -> torch.Tensor:
    """Uniform [0, 1) fp32 numbers for stochastic rounding of a ``shape`` tensor that sits at
    ``(row_offset, col_offset)`` of a larger one: a hash of ``(seed, global row, global column)``."""
    r, c = shape
    rows = torch.arange(row_offset, row_offset + r, device=device, dtype=torch.int64)[:, None]
    cols = torch.arange(col_offset, col_offset + c, device=device, dtype=torch.int64)[None, :]
    s = _mix32(seed.to(device=device, dtype=torch.int64).reshape(()) + 0x9E3779B)
    # Well-mixed row and column hashes (cheap: [R, 1] and [1, C]), then one
    # multiply-xorshift round per element.
    h = _mix32(s + _mix32(rows)) ^ _mix32(cols + 0x632BE5A)
    h = (h * 0x45D9F3B) & _M32
    h = h ^ (h >> 15)
    return (h & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def global_scales(amax: torch.Tensor, e4m3_max: float = E4M3_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S_enc, S_dec)`` fp32 0-d from the per-tensor amax (module docstring).

    ``e4m3_max``: the global bound ``M`` in ``S_enc = M * 6 / amax`` (448; 4over6 may use 256).
    """
    amax = amax.to(torch.float32).reshape(())
    enc = torch.clamp(torch.tensor(e4m3_max * FP4_MAX, device=amax.device) / amax, max=_FLT_MAX)
    enc = torch.where(enc == 0, torch.ones_like(enc), enc)
    return enc, torch.reciprocal(enc)


def _check_cols(x: torch.Tensor, what: str = "x") -> None:
    if x.dim() != 2 or x.shape[1] % 16:
        raise ValueError(
            f"NVFP4 quantization: {what} has shape {tuple(x.shape)}; the quantized (last) dimension must be "
            "a multiple of 16 (one E4M3 scale per 16 values, two values per byte)"
        )


def quantize_nvfp4(
    x: torch.Tensor,
    spec: BlockSpec,
    amax: torch.Tensor,
    *,
    sr_seed: Optional[torch.Tensor] = None,
    row_offset: int = 0,
    col_offset: int = 0,
    what: str = "x",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed data [R, C/2] float4_e2m1fn_x2, block scales e4m3)`` of 2-D ``x``.

    ``amax``: the per-tensor amax (0-d; the caller's, e.g. reduced over ranks).
    ``sr_seed``: stochastic rounding with this seed (None: round to nearest);
    ``row_offset`` / ``col_offset``: where ``x`` sits in the whole tensor (a shard), for the
    rounding bits.
    """
    _check_cols(x, what)
    xf = x.detach().to(torch.float32).contiguous()
    s_enc, s_dec = global_scales(amax)
    mult = s_enc * torch.reciprocal(torch.tensor(FP4_MAX, device=xf.device))
    blk_amax = block_amax(xf, spec)
    decode = torch.clamp(blk_amax * mult, max=_FLT_MAX).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    enc = torch.clamp(torch.reciprocal(decode.to(torch.float32) * s_dec), max=_FLT_MAX)
    scaled = (xf * expand_scales(enc, spec, tuple(xf.shape))).clamp(-FP4_MAX, FP4_MAX)
    if sr_seed is None:
        codes = encode_e2m1(scaled)
    else:
        codes = encode_e2m1_stochastic(scaled, sr_uniform(sr_seed, tuple(xf.shape), xf.device, row_offset, col_offset))
    return pack_fp4(codes), decode


def block_decode_values(data: torch.Tensor, scale_inv: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """fp32 ``e2m1 * block_scale`` per element (exact: 2 x 4 significant bits), no global scale."""
    vals = decode_e2m1(unpack_fp4(data))
    return vals * expand_scales(scale_inv.to(torch.float32), spec, tuple(vals.shape))


def dequantize_nvfp4(
    data: torch.Tensor, scale_inv: torch.Tensor, spec: BlockSpec, amax: torch.Tensor, e4m3_max: float = E4M3_MAX
) -> torch.Tensor:
    """fp32 ``e2m1 * (block_scale * amax * fp32(1/(6 * e4m3_max)))`` (TE's dequantize; 1/2688 for 448)."""
    vals = decode_e2m1(unpack_fp4(data))
    factor_inv = torch.tensor(1.0 / (FP4_MAX * e4m3_max), dtype=torch.float32, device=vals.device)
    per_block = scale_inv.to(torch.float32) * amax.to(torch.float32).reshape(()) * factor_inv
    return vals * expand_scales(per_block, spec, tuple(vals.shape))


def gemm_alpha(
    amax_a: torch.Tensor, amax_b: torch.Tensor, e4m3_max_a: float = E4M3_MAX, e4m3_max_b: float = E4M3_MAX
) -> torch.Tensor:
    """fp32 ``amax_a * amax_b / (6 * M_a * 6 * M_b)``: the global scale of an NVFP4 GEMM
    (``M`` = 448, or 256 for 4over6 tensors that use it; the constant is exact in fp32)."""
    prod = amax_a.to(torch.float32).reshape(()) * amax_b.to(torch.float32).reshape(())
    denom = (FP4_MAX * e4m3_max_a) * (FP4_MAX * e4m3_max_b)
    return prod / torch.tensor(denom, dtype=torch.float32, device=prod.device)
