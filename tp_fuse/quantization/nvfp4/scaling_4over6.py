"""NVFP4 "4over6" block scaling (Transformer Engine's ``nvfp4_4over6`` / ``nvfp4_use_4over6``).

Plain NVFP4 maps each block's amax to the largest E2M1 value 6. The E2M1 grid is coarse
at the top (4 -> 6 skips 5), so 4over6 also tries mapping the block amax to 4 -- a block
scale 1.5x larger, where values near the amax land on 4 instead of rounding between 4 and
6 -- and keeps, per block, whichever candidate reconstructs the block with less error.

For 2-D ``x [R, C]``, per-tensor amax ``A`` and global bound ``M`` (``e4m3_max``: 256 or
448; TE's ``nvfp4_4over6_e4m3_use_256`` picks 256 by default, which leaves the map-to-4
scale ``1.5 * s`` room below the E4M3 maximum 448), fp32 arithmetic in this order::

    S_enc = min(M * 6 / A, FLT_MAX), 1 when that is 0;  S_dec = 1 / S_enc
    base  = (amax_blk / 6) * S_enc
    s6    = e4m3(clamp(base, -448, 448))          s4 = e4m3(clamp(base * 1.5, -448, 448))
    enc_k = min(1 / (fp32(s_k) * S_dec), FLT_MAX)
    q_k   = e2m1(clamp(x * enc_k, -6, 6))         (round to nearest even)
    err_k = sum over the block's 16 values, in index order, of |d| (MAE) or d*d (MSE),
            d = ((q_k * s_k) * A) / (6 * M) - x
    pick map-to-4 iff err_4 < err_6               (ties, e.g. zero blocks: map-to-6)

16x16 blocks (2-D weights): each row's 1x16 error is summed over the tile's 16 rows in
the tree order ``(r, r+8)``, then ``(r, r+4)``, ``(r, r+2)``, ``(r, r+1)`` -- TE's warp
reduction, which the tie rule makes observable. The column-wise copy of a 16x16 tensor is
the transpose of the row-wise one (same tiles, same choices).

Dequantization and GEMMs use the stored block scale as usual, with the global scale
``A / (6 * M)``; the tensor carries ``M`` (``BlockPayload.e4m3_max``).

TE restricts 4over6 to round-to-nearest without the random Hadamard transform (its
quantizer raises for RHT or stochastic rounding); so does
:class:`~tp_fuse.quantization.nvfp4.quantizer.NVFP4Quantizer`.
"""

from __future__ import annotations

import torch

from ...recipe import FP4_MAX
from ..block.scaling import BlockSpec, block_amax, expand_scales
from .scaling import E4M3_MAX, _check_cols, decode_e2m1, encode_e2m1, global_scales, pack_fp4, unpack_fp4

__all__ = ["ERR_MODES", "E4M3_MAXES", "quantize_nvfp4_4over6", "transpose_nvfp4_2d"]

ERR_MODES = ("MAE", "MSE")
#: Allowed global E4M3 bounds ``M`` (TE's ``nvfp4_e4m3_max``).
E4M3_MAXES = (448, 256)
_FLT_MAX = torch.finfo(torch.float32).max


def _tree_sum_16(err: torch.Tensor) -> torch.Tensor:
    """``[R, G]`` per-row block errors (R a multiple of 16) -> ``[R/16, G]``, TE's tree order."""
    rows = err.reshape(err.shape[0] // 16, 16, err.shape[1])
    rows = rows[:, 0:8] + rows[:, 8:16]
    rows = rows[:, 0:4] + rows[:, 4:8]
    rows = rows[:, 0:2] + rows[:, 2:4]
    return rows[:, 0] + rows[:, 1]


def quantize_nvfp4_4over6(
    x: torch.Tensor, spec: BlockSpec, amax: torch.Tensor, *, e4m3_max: int = 256, err_mode: str = "MAE",
    what: str = "x",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed data [R, C/2] float4_e2m1fn_x2, block scales e4m3)`` of 2-D ``x`` (module doc rule).

    ``spec``: 1x16 or 16x16 (a partial last 16x16 tile is padded with zero rows);
    ``amax``: the per-tensor amax (0-d); ``e4m3_max``: 256 or 448; ``err_mode``: "MAE"/"MSE".
    """
    _check_cols(x, what)
    if (spec.rows, spec.cols) not in ((1, 16), (16, 16)):
        raise ValueError(f"NVFP4 4over6: expected 1x16 or 16x16 blocks, got {spec.describe()}")
    if int(e4m3_max) not in E4M3_MAXES:
        raise ValueError(f"NVFP4 4over6: e4m3_max must be 448 or 256, got {e4m3_max!r}")
    mode = str(err_mode).upper()
    if mode not in ERR_MODES:
        raise ValueError(f"NVFP4 4over6: err_mode must be 'MAE' or 'MSE', got {err_mode!r}")
    xf = x.detach().to(torch.float32).contiguous()
    rows = xf.shape[0]
    if spec.rows == 16 and rows % 16:
        # A partial last tile: zero rows quantize to 0 under both candidates (error 0), so
        # padding leaves the tile's choice as TE's (its reference pads the same way).
        xf = torch.cat([xf, xf.new_zeros(16 - rows % 16, xf.shape[1])])
    r, c = xf.shape
    dev = xf.device
    amax32 = amax.to(device=dev, dtype=torch.float32).reshape(())
    s_enc, s_dec = global_scales(amax32, float(e4m3_max))
    six = torch.tensor(FP4_MAX, dtype=torch.float32, device=dev)
    base = (block_amax(xf, spec) / six) * s_enc
    cands = []
    for blk_scale in (base * 1.5, base):  # map-to-4, map-to-6
        s = blk_scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        enc = torch.clamp(torch.reciprocal(s.to(torch.float32) * s_dec), max=_FLT_MAX)
        codes = encode_e2m1((xf * expand_scales(enc, spec, (r, c))).clamp(-FP4_MAX, FP4_MAX))
        # The error in x's units, with TE's fp32 operation order (not the scale's reciprocal).
        val = decode_e2m1(codes) * expand_scales(s, spec, (r, c))
        val = (val * amax32) / torch.tensor(FP4_MAX * float(e4m3_max), dtype=torch.float32, device=dev)
        d = (val - xf).reshape(r, c // 16, 16)
        terms = d * d if mode == "MSE" else d.abs()
        err = terms[:, :, 0]
        for i in range(1, 16):  # sequential: the sum order decides near-ties
            err = err + terms[:, :, i]
        if spec.rows == 16:
            err = _tree_sum_16(err)
        cands.append((codes, s, err))
    (codes4, s4, err4), (codes6, s6, err6) = cands
    pick4 = err4 < err6
    codes = torch.where(expand_scales(pick4.to(torch.float32), spec, (r, c)) > 0, codes4, codes6)
    scales = torch.where(pick4, s4.to(torch.float32), s6.to(torch.float32)).to(torch.float8_e4m3fn)
    return pack_fp4(codes[:rows]), scales


def transpose_nvfp4_2d(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-wise copy of a 16x16-block NVFP4 layout: codes and tile scales transposed."""
    return pack_fp4(unpack_fp4(data).t().contiguous()), scale_inv.t().contiguous()
