"""Transformer Engine's block-quantizer names: ``MXFP8Quantizer``, ``Float8BlockQuantizer``.

Users (and TE's tests) build them directly and call them on tensors::

    x8 = MXFP8Quantizer(fp8_dtype=DType.kFloat8E4M3)(x)                    # an MXFP8Tensor
    w8 = Float8BlockQuantizer(fp8_dtype=DType.kFloat8E4M3, rowwise=True,
                              columnwise=True, block_scaling_dim=2)(w)     # 128x128 blocks

They are the recipes' :class:`~tp_fuse.quantization.block.quantizer.BlockScalingQuantizer`
with the block layout and scale rule given by TE's constructor arguments instead of a
recipe role, so what they produce is what ops and ``block_gemm`` consume (and an op uses
such a tensor as is when it holds the copies its GEMMs read).
"""

from __future__ import annotations

from typing import Union

import torch

from ...recipe import Float8BlockScaling, MXFP8BlockScaling
from ..quantizer import UsageMixin
from .quantizer import BlockScalingQuantizer
from .scaling import BlockSpec, ScaleRule
from .tensor import BlockScaledTensor
from ..te_dtype import DType, as_torch_dtype

__all__ = ["MXFP8Quantizer", "Float8BlockQuantizer"]


def _fp8(dtype: Union[DType, torch.dtype], what: str) -> torch.dtype:
    out = as_torch_dtype(dtype, what)
    if out not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{what}: expected DType.kFloat8E4M3 or DType.kFloat8E5M2, got {dtype!r}")
    return out


class _BlockUsage(UsageMixin):
    """TE's ``quantizer(x)`` for block-scaled tensors: the copies (row-wise, column-wise)
    ``set_usage`` asked for, both quantized from high precision."""

    def __call__(self, tensor: torch.Tensor) -> BlockScaledTensor:
        """Quantize ``tensor`` into the copies set by ``set_usage`` (straight-through autograd);
        the result keeps this quantizer (TE: ``quantize_`` re-quantizes with it)."""
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: neither rowwise nor columnwise usage is set")
        q = self.quantize(tensor, transpose=self.columnwise_usage)  # type: ignore[attr-defined]
        if not self.rowwise_usage:
            q.update_usage(rowwise_usage=False)
        q._quantizer = self
        return q


class MXFP8Quantizer(_BlockUsage, BlockScalingQuantizer):
    """MXFP8 (OCP MX v1.0): 32-element blocks along the last dim, E8M0 scales; the
    column-wise copy has its blocks along the first dim (the transposed tensor's rows).

    Args (Transformer Engine's): ``fp8_dtype`` (``DType.kFloat8E4M3`` or ``kFloat8E5M2``),
    ``rowwise`` / ``columnwise`` (the copies ``quantizer(x)`` makes). ``role``: the tensor
    role, for statistics.
    """

    def __init__(
        self,
        fp8_dtype: Union[DType, torch.dtype] = DType.kFloat8E4M3,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        role: str = "input",
    ) -> None:
        dtype = _fp8(fp8_dtype, "MXFP8Quantizer fp8_dtype")
        super().__init__(MXFP8BlockScaling(), role)
        self.fp8_dtype = dtype
        self.rowwise_usage, self.columnwise_usage = bool(rowwise), bool(columnwise)

    def copy(self) -> "MXFP8Quantizer":
        """TE's shallow copy: the same settings (no state to share)."""
        return MXFP8Quantizer(self.fp8_dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                              role=self.role)


class Float8BlockQuantizer(_BlockUsage, BlockScalingQuantizer):
    """DeepSeek-V3-style FP8 block scaling: 1x128 (``block_scaling_dim=1``) or 128x128
    (``block_scaling_dim=2``) blocks, one fp32 scale each (``fp8_max / amax``, raised to
    ``amax_epsilon`` first, rounded down to a power of two when ``force_pow_2_scales``).

    Args (Transformer Engine's): ``fp8_dtype``, ``rowwise``, ``columnwise``,
    ``amax_epsilon``, ``force_pow_2_scales``, ``block_scaling_dim``. ``role``: the tensor
    role, for statistics.
    """

    def __init__(
        self,
        fp8_dtype: Union[DType, torch.dtype],
        *,
        rowwise: bool,
        columnwise: bool,
        amax_epsilon: float = 0.0,
        force_pow_2_scales: bool = True,
        block_scaling_dim: int = 2,
        role: str = "input",
    ) -> None:
        dtype = _fp8(fp8_dtype, "Float8BlockQuantizer fp8_dtype")
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer block_scaling_dim: expected 1 (1x128) or 2 (128x128), "
                             f"got {block_scaling_dim!r}")
        if not amax_epsilon >= 0.0:
            raise ValueError(f"Float8BlockQuantizer amax_epsilon: expected >= 0, got {amax_epsilon!r}")
        super().__init__(Float8BlockScaling(), role)
        self.fp8_dtype = dtype
        self.spec = BlockSpec(128, 128) if block_scaling_dim == 2 else BlockSpec(1, 128)
        self.rule = ScaleRule("fp32", power_2=bool(force_pow_2_scales), amax_epsilon=float(amax_epsilon))
        self.block_scaling_dim = block_scaling_dim
        self.amax_epsilon, self.force_pow_2_scales = float(amax_epsilon), bool(force_pow_2_scales)
        self.rowwise_usage, self.columnwise_usage = bool(rowwise), bool(columnwise)

    def copy(self) -> "Float8BlockQuantizer":
        """TE's shallow copy: the same settings (no state to share)."""
        return Float8BlockQuantizer(
            self.fp8_dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
            block_scaling_dim=self.block_scaling_dim, role=self.role,
        )
