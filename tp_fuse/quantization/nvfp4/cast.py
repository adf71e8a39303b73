"""NVFP4 quantization of one layout: the torch reference or the Triton kernel.

:func:`quantize_nvfp4_layout` is what :class:`~tp_fuse.quantization.nvfp4.quantizer.NVFP4Quantizer`
calls for each copy (row-wise ``x``; column-wise ``x.T``, after the random Hadamard
transform where the recipe asks for it -- the RHT is a torch matmul before the kernel). It
picks the implementation with ``tp_fuse.kernels.dispatch`` under the kernel name
``nvfp4_quantize``, with the rules of every tp_fuse kernel: auto (``backend=None``) is
Triton for CUDA tensors when triton imports and torch elsewhere (also on CPU with
``TRITON_INTERPRET=1``); ``backend="triton"`` runs Triton or raises; float64 takes torch.
The path that ran is recorded for ``record_kernel_paths``.

Both paths give the same bytes and scales (``tests/test_nvfp4_triton.py``, under the
interpreter): :func:`~tp_fuse.quantization.nvfp4.scaling.quantize_nvfp4` (torch) and
:func:`tp_fuse.kernels.nvfp4_cast_triton.nvfp4_quantize` (1x16 and 16x16 blocks, round to
nearest or stochastic rounding with the shard offsets, strided inputs). The per-tensor
factors are computed once on the host side with torch (two fp32 scalars); the
stochastic-rounding seed is passed to the kernel as an integer (one device-to-host copy).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...kernels import dispatch
from ...kernels._common import triton_dtype_issue
from ...recipe import FP4_DTYPE, FP4_MAX
from ..block.scaling import BlockSpec
from .scaling_4over6 import quantize_nvfp4_4over6
from .scaling import NVFP4_BLOCK, NVFP4_BLOCK_2D, _check_cols, global_scales, quantize_nvfp4

__all__ = ["KERNEL", "quantize_nvfp4_layout"]

#: Kernel name in dispatch records and ``explain``.
KERNEL = "nvfp4_quantize"


def _triton_issue(x: torch.Tensor, spec: BlockSpec, four_over_six: bool = False) -> Optional[str]:
    """Why the Triton kernel cannot quantize this (None: it can)."""
    if four_over_six:
        return "4over6 block selection (nvfp4_4over6): the NVFP4 Triton kernel only maps block amaxes to 6"
    issue = triton_dtype_issue(x.dtype)
    if issue is not None:
        return issue
    if spec not in (NVFP4_BLOCK, NVFP4_BLOCK_2D):
        return f"block {spec.describe()}: the NVFP4 Triton kernel takes 1x16 and 16x16 blocks"
    if x.numel() == 0:
        return "an empty tensor (nothing to launch)"
    return None


def quantize_nvfp4_layout(
    x: torch.Tensor,
    spec: BlockSpec,
    amax: torch.Tensor,
    *,
    sr_seed: Optional[torch.Tensor] = None,
    row_offset: int = 0,
    col_offset: int = 0,
    what: str = "x",
    backend: Optional[str] = None,
    four_over_six: Optional[tuple[int, str]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed data [R, C/2] float4_e2m1fn_x2, block scales float8_e4m3fn)`` of 2-D ``x``.

    Same arguments and result as :func:`~tp_fuse.quantization.nvfp4.scaling.quantize_nvfp4`
    (``amax``: the per-tensor amax; ``sr_seed``: stochastic rounding; ``row_offset`` /
    ``col_offset``: the shard's place in the whole tensor), plus ``backend``: None (auto),
    "torch" or "triton", and ``four_over_six``: ``(e4m3_max, err_mode)`` to quantize with
    4over6 (:mod:`.nvfp4_4over6`, torch only: auto routes it to torch with the reason
    recorded, ``backend="triton"`` raises); it takes no stochastic rounding.
    """
    _check_cols(x, what)
    issue = _triton_issue(x, spec, four_over_six is not None)
    choice = dispatch.select_backend(KERNEL, x.device, backend, triton_unsupported=issue)
    if four_over_six is not None:
        assert sr_seed is None, "4over6 rounds to nearest (the quantizer refuses stochastic rounding)"
        out = quantize_nvfp4_4over6(x, spec, amax, e4m3_max=four_over_six[0], err_mode=four_over_six[1], what=what)
        variant = "reference_4over6"
    elif choice.backend == "torch":
        out = quantize_nvfp4(x, spec, amax, sr_seed=sr_seed, row_offset=row_offset, col_offset=col_offset,
                             what=what)
        variant = "reference"
    else:
        out, variant = _triton(x, spec, amax, sr_seed, row_offset, col_offset)
    dispatch.log_call(KERNEL, choice, variant, x.device)
    return out


def _triton(
    x: torch.Tensor, spec: BlockSpec, amax: torch.Tensor, sr_seed: Optional[torch.Tensor], row_offset: int,
    col_offset: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], str]:
    # Imported here, not at the top: importing triton is slow and CPU-only use never needs
    # it (the same lazy import as block/cast.py and kernels/cast.py); not an import cycle.
    from ...kernels import nvfp4_cast_triton

    s_enc, s_dec = global_scales(amax.to(x.device))
    # The same fp32 product as quantize_nvfp4: S_enc * fp32(1/6).
    mult = s_enc * torch.reciprocal(torch.tensor(FP4_MAX, device=x.device))
    two_d = spec == NVFP4_BLOCK_2D
    data, scales = nvfp4_cast_triton.nvfp4_quantize(
        x, mult, s_dec, two_d=two_d, sr_seed=None if sr_seed is None else int(sr_seed),
        row_offset=row_offset, col_offset=col_offset,
    )
    variant = ("16x16" if two_d else "1x16") + ("_sr" if sr_seed is not None else "")
    return (data.view(FP4_DTYPE), scales.view(torch.float8_e4m3fn)), variant
