"""GEMMs on :class:`BlockScaledTensor` operands: ``a @ b.T`` from the row-wise copies.

``block_gemm(a, b)`` reads ``a``'s and ``b``'s row-wise payloads (``a [M, K]``, ``b [N, K]``;
the transposed operands of dgrad/wgrad come from :meth:`BlockScaledTensor.transpose_fp8`,
i.e. their column-wise copies). Both operands' blocks run along K, the reduction dim.

Backends:

* **CPU emulation** (every device; the numerical reference): dequantize each operand
  block by block (``data * scale_inv``, exact in fp32: an FP8 value times a power of
  two, or times an fp32 scale with one rounding), then one fp32 GEMM, bias added in
  fp32, cast to ``out_dtype``. Hardware block-scaled GEMMs also apply the scales to
  fp32 partial sums per K block; they differ from this only by fp32 summation order.
* **row-wise** recipe: ``torch._scaled_mm`` with row-wise scale vectors (``[M, 1]``,
  ``[1, N]``), which has a CPU kernel in torch >= 2.6 and a CUDA one on sm89+.
* **CUDA blockwise / MXFP8**: ``torch.nn.functional.scaled_mm`` with
  ``BlockWise1x128``/``BlockWise128x128`` (sm90) or ``BlockWise1x32`` + swizzled E8M0
  scales (sm100). Other GPUs raise a ValueError naming the requirement. This path is
  written against torch's API but untested here (CI has no GPU).
* **NVFP4**: the emulation multiplies the exact products ``e2m1 * e4m3_block_scale`` of
  both operands in one fp32-accumulating GEMM (on CPUs with AMX-BF16 on the bf16 units,
  where these values are exact too: ``kernels.fp8_emulation.exact_values_mm``) and applies the global ``alpha = amax_a * amax_b /
  (6*6*448*448)`` to the result (what the FP4 tensor cores do with their alpha). On CUDA
  ``torch.nn.functional.scaled_mm`` with ``[BlockWise1x16, TensorWise]`` scales (swizzled
  E4M3 block scales plus the fp32 global scale) on sm100+; other GPUs raise. Untested here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ...kernels import cuda_rules
from ...kernels.dispatch import cuda_capability
from ...kernels.fp8_emulation import exact_values_mm
from .scaling import BlockSpec
from .tensor import BlockPayload, BlockScaledTensor
from ..nvfp4.scaling import block_decode_values, gemm_alpha

__all__ = ["block_gemm", "emulated_block_gemm", "swizzle_mx_scales"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(a: BlockScaledTensor, b: BlockScaledTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> None:
    if not isinstance(a, BlockScaledTensor) or not isinstance(b, BlockScaledTensor):
        raise ValueError(
            f"block_gemm: expected BlockScaledTensor operands, got {type(a).__name__} and {type(b).__name__} "
            "(block-scaled and per-tensor FP8 operands cannot be mixed in one GEMM)"
        )
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"block_gemm: expected a [M, K] and b [N, K] with equal K, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.recipe_name != b.recipe_name:
        raise ValueError(f"block_gemm: operands of different recipes: {a.recipe_name} and {b.recipe_name}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"block_gemm: out_dtype: expected one of {_OUT_DTYPES}, got {out_dtype}")
    if a.device != b.device:
        raise ValueError(f"block_gemm: operands on different devices: a {a.device}, b {b.device}")
    if bias is not None and (bias.shape != (b.shape[0],) or bias.device != a.device):
        raise ValueError(
            f"block_gemm: bias: expected shape ({b.shape[0]},) on {a.device}, got {tuple(bias.shape)} on {bias.device}"
        )


def emulated_block_gemm(
    a: BlockPayload, b: BlockPayload, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The reference: per-block dequantization, fp32 GEMM (+ fp32 bias), cast.

    NVFP4: ``alpha * (A @ B.T)`` with ``A``, ``B`` the exact ``e2m1 * block_scale`` values
    and ``alpha`` the product of the two global scales (module docstring).
    """
    if a.is_fp4 or b.is_fp4:
        assert a.is_fp4 and b.is_fp4 and a.amax is not None and b.amax is not None
        va = block_decode_values(a.data, a.scale_inv, a.spec)
        vb = block_decode_values(b.data, b.scale_inv, b.spec).t()
        # e2m1 x E4M3 block scale: at most 6 significant bits, exact in bf16 too (the CPU's
        # AMX-BF16 units may take the GEMM: kernels.fp8_emulation).
        exact_in_bf16 = a.scale_inv.dtype == b.scale_inv.dtype == torch.float8_e4m3fn
        out = exact_values_mm(va, vb) if exact_in_bf16 else va @ vb
        out = out * gemm_alpha(a.amax, b.amax, a.e4m3_max, b.e4m3_max)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)
    out = a.dequantize() @ b.dequantize().t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def swizzle_mx_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales ``[rows, K/32]`` in cuBLAS's blocked layout for MX GEMMs.

    The layout tiles the scale matrix in 128x4 tiles (zero-padded), each stored as
    4 interleaved groups of 32 rows: tile element ``(r, c)`` goes to position
    ``(r % 32) * 16 + (r // 32) * 4 + c``; tiles are laid out row-tile-major.
    """
    rows, cols = scales.shape
    rt, ct = math.ceil(rows / 128), math.ceil(cols / 4)
    padded = torch.zeros(rt * 128, ct * 4, dtype=scales.dtype, device=scales.device)
    padded[:rows, :cols] = scales
    # [rt, 128, ct, 4] -> [rt, ct, 128, 4] -> split 128 = 4 x 32 -> [rt, ct, 32, 4, 4]
    tiles = padded.view(rt, 128, ct, 4).permute(0, 2, 1, 3).reshape(rt, ct, 4, 32, 4)
    return tiles.transpose(2, 3).contiguous().flatten()


def blockwise_scale_layout(p: BlockPayload) -> torch.Tensor:
    """``p``'s fp32 block scales in the layout torch's blockwise ``scaled_mm`` reads (sm90).

    1x128 scales ``[rows, K/128]`` are read outer-dimension-major: the same shape with
    strides ``(1, rows)``. 128x128 scales ``[rows/128, K/128]`` are read K-major with the K
    dimension padded to a multiple of 4: shape ``[round_up(K/128, 4), rows/128]``, strides
    ``(1, round_up(K/128, 4))``; the padding is never read as a real block (zeros).
    (torch's ``_meta_registrations.py``, ``_scaled_mm_v2``; the first H200 run of a 128x128
    weight failed with "scale_b must have shape 4 x 8 Float elements, got [8, 2]".)
    """
    s = p.scale_inv.to(torch.float32)
    if p.spec.rows == 1:
        return s.t().contiguous().t()
    outer, k_blocks = s.shape
    padded = torch.zeros(outer, math.ceil(k_blocks / 4) * 4, dtype=torch.float32, device=s.device)
    padded[:, :k_blocks] = s
    return padded.t()


def blockwise_scaled_mm(
    a: BlockPayload, b: BlockPayload, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``a @ b.T`` for Float8BlockScaling operands (1x128 or 128x128 blocks) through torch's
    blockwise ``F.scaled_mm`` (CUDA sm90; on meta tensors it runs torch's shape checks)."""
    kinds = {BlockSpec(1, 128): F.ScalingType.BlockWise1x128, BlockSpec(128, 128): F.ScalingType.BlockWise128x128}
    # cuBLASLt reads row-major A and column-major B; a column-wise copy may be a transposed
    # view (the CPU cast writes it so), which .contiguous() makes dense (a no-op otherwise).
    return F.scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(), blockwise_scale_layout(a), kinds[a.spec],
        blockwise_scale_layout(b), kinds[b.spec],
        bias=bias, output_dtype=out_dtype,
    )


def _cuda_block_gemm(
    a: BlockPayload, b: BlockPayload, recipe_name: str, out_dtype: torch.dtype, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    cap = cuda_capability(a.data.device)  # cached per device: no query per GEMM
    st = F.ScalingType
    if recipe_name == "blockwise":
        if cap != (9, 0):
            raise ValueError(
                f"Float8BlockScaling GEMM on CUDA needs an sm90 GPU (Hopper) for torch's blockwise "
                f"scaled_mm, got sm{cap[0]}{cap[1]}; run on CPU (exact emulation) instead"
            )
        return blockwise_scaled_mm(a, b, out_dtype, bias)
    if recipe_name == "mxfp8":
        if cap[0] < 10:
            raise ValueError(
                f"MXFP8BlockScaling GEMM on CUDA needs an sm100+ GPU (Blackwell), got sm{cap[0]}{cap[1]}; "
                "run on CPU (exact emulation) instead"
            )
        sw = F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_mm(
            a.data, b.data.t(), swizzle_mx_scales(a.scale_inv), st.BlockWise1x32,
            swizzle_mx_scales(b.scale_inv), st.BlockWise1x32, swizzle_a=sw, swizzle_b=sw,
            bias=bias, output_dtype=out_dtype,
        )
    if recipe_name == "nvfp4":
        if cap[0] < 10:
            raise ValueError(
                f"NVFP4BlockScaling GEMM on CUDA needs an sm100+ GPU (Blackwell), got sm{cap[0]}{cap[1]}; "
                "run on CPU (exact emulation) instead"
            )
        sw = F.SwizzleType.SWIZZLE_32_4_4

        def scales(p: BlockPayload) -> list[torch.Tensor]:
            # 16x16 (2-D) weight scales repeat over their 16 rows: cuBLAS reads one per 1x16.
            s = p.scale_inv.repeat_interleave(p.spec.rows, dim=0)[: p.data.shape[0]] if p.spec.rows > 1 else p.scale_inv
            glob = (p.amax.to(torch.float32) / (6.0 * p.e4m3_max)).reshape(1)
            return [swizzle_mx_scales(s.contiguous()), glob]

        return F.scaled_mm(
            a.data, b.data.t(), scales(a), [st.BlockWise1x16, st.TensorWise], scales(b),
            [st.BlockWise1x16, st.TensorWise], swizzle_a=[sw, F.SwizzleType.NO_SWIZZLE],
            swizzle_b=[sw, F.SwizzleType.NO_SWIZZLE], bias=bias, output_dtype=out_dtype,
        )
    raise AssertionError(recipe_name)


def _vector(scale_inv: torch.Tensor) -> torch.Tensor:
    # Dense 1-D fp32: _scaled_mm checks strides, and a [K, 1] scale sliced out of a
    # gathered buffer can carry a stride on its size-1 dimension.
    return scale_inv.to(torch.float32).reshape(-1).contiguous()


def block_gemm(
    a: BlockScaledTensor, b: BlockScaledTensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` in ``out_dtype`` from the row-wise copies of ``a [M, K]`` and ``b [N, K]``."""
    _check(a, b, out_dtype, bias)
    pa, pb = a.payload("rowwise"), b.payload("rowwise")
    if a.recipe_name == "rowwise":
        # One scale per row of each operand: torch._scaled_mm's row-wise form (CPU and CUDA).
        # Through the project's one _scaled_mm call site (CUDA rules checked in strict mode).
        out = cuda_rules.scaled_mm(
            pa.data, pb.data.t(), _vector(pa.scale_inv).view(-1, 1), _vector(pb.scale_inv).view(1, -1),
            torch.float32,
        )
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)
    if a.device.type == "cuda":
        return _cuda_block_gemm(pa, pb, a.recipe_name, out_dtype, bias)
    return emulated_block_gemm(pa, pb, out_dtype, bias)
