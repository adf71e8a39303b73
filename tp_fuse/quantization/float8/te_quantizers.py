"""Transformer Engine's quantizer names: ``DType``, ``Float8Quantizer``,
``Float8CurrentScalingQuantizer``.

Users (and TE's tests) build quantizers directly and call them on tensors::

    q = Float8Quantizer(scale=torch.ones(()), amax=torch.zeros(1), fp8_dtype=DType.kFloat8E4M3)
    x8 = q(x)            # a Float8Tensor

* :class:`Float8Quantizer` quantizes with the ``scale`` tensor it was given (held by
  reference: writes to it change later casts) and folds ``max |x|`` into ``amax``.
* :class:`Float8CurrentScalingQuantizer` computes the scale from the tensor itself
  (``fp8_max / max(amax, amax_epsilon)``, all-reduced over a group when asked).

Both are :class:`~tp_fuse.quantization.Quantizer` s, so ops and ``fp8_gemm`` accept
what they produce. As in TE, ``quantizer(x)`` and ``quantizer.make_empty(shape)`` return
tensors that remember their quantizer, so ``t.quantize_(y)`` (and ``t.copy_(y)``)
re-quantize ``y`` with it; ``quantizer.copy()`` is TE's shallow copy.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from ...recipe import Float8CurrentScaling, Format, fp8_dtype_max
from .tensor import Float8Tensor
from ..te_dtype import DType, as_torch_dtype
from .current_scaling import CurrentScalingQuantizer
from ..quantizer import Quantizer, UsageMixin, amax_abs, cast_per_tensor, with_transpose

__all__ = ["DType", "Float8Quantizer", "Float8CurrentScalingQuantizer", "as_torch_dtype"]


def _fp8(dtype: Union[DType, torch.dtype], what: str) -> torch.dtype:
    out = as_torch_dtype(dtype, what)
    fp8_dtype_max(out)  # raises ValueError naming the FP8 dtypes for anything else
    return out


class _UsageMixin(UsageMixin):
    """TE's ``set_usage`` and ``quantizer(x)`` for Float8Tensors. A Float8Tensor always
    has its row-wise bytes and builds the column-wise (transposed) bytes on demand;
    ``columnwise`` only decides whether they are written at cast time."""

    def __call__(self, tensor: torch.Tensor) -> Float8Tensor:
        """Quantize ``tensor`` (differentiable, straight-through); the result keeps this
        quantizer (TE: ``quantize_`` and ``copy_`` into it re-quantize with it)."""
        out = self.quantize(tensor, transpose=self.columnwise_usage)  # type: ignore[attr-defined]
        out._quantizer = self
        return out


class Float8Quantizer(_UsageMixin, Quantizer):
    """Per-tensor FP8 with a given scale (Transformer Engine's delayed-scaling quantizer).

    Args:
        scale: one-element tensor; FP8 = cast(x * scale). Held by reference. Any dtype
            constructs (as in TE); casting needs fp32 (ValueError otherwise).
        amax: one-element tensor; each cast folds ``max |x|`` into it (max); fp32 to cast.
        fp8_dtype: ``DType.kFloat8E4M3`` / ``kFloat8E5M2`` (or the torch dtypes).
        rowwise, columnwise: layouts to produce (see ``set_usage``).
    """

    def __init__(
        self,
        scale: torch.Tensor,
        amax: torch.Tensor,
        fp8_dtype: Union[DType, torch.dtype],
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        dtype = _fp8(fp8_dtype, "Float8Quantizer fp8_dtype")
        # TE stores scale and amax as given and checks their dtype only when it casts
        # (its C++ cast refuses a non-fp32 amax). Code that builds a quantizer only to
        # hand over its fp8_dtype (TE's debug tests pass torch.tensor([1]), int64) must
        # construct; the dtype is checked in _quantize_impl, as in TE.
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.numel() != 1:
                raise ValueError(f"Float8Quantizer {name}: expected a one-element tensor, got {t!r}")
        super().__init__(dtype, "input")
        self.scale = scale
        self.amax = amax
        self.set_usage(rowwise=rowwise, columnwise=columnwise)

    def copy(self) -> "Float8Quantizer":
        """TE's shallow copy: the same ``scale`` and ``amax`` tensors and usage."""
        return Float8Quantizer(self.scale, self.amax, self.fp8_dtype, rowwise=self.rowwise_usage,
                               columnwise=self.columnwise_usage)

    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        for name in ("scale", "amax"):
            t = getattr(self, name)
            if t.dtype != torch.float32:
                raise ValueError(
                    f"Float8Quantizer {name}: casting needs a one-element fp32 tensor, got dtype {t.dtype} "
                    f"(e.g. torch.tensor([1.0]) rather than torch.tensor([1]))"
                )
        with torch.no_grad():
            scale = self.scale.reshape(()).to(device=x.device)
            data, data_t, amax = cast_per_tensor(x.detach(), scale, self.fp8_dtype, transpose=transpose)
            self.amax.copy_(torch.maximum(self.amax.reshape(()), amax.to(self.amax.device)).reshape(self.amax.shape))
            scale_inv = torch.reciprocal(scale)
        return with_transpose(Float8Tensor(data, scale_inv, x.dtype), data_t)

    def stats(self) -> dict[str, float]:
        return {"amax": float(self.amax.reshape(())), "scale": float(self.scale.reshape(()))}


class Float8CurrentScalingQuantizer(_UsageMixin, CurrentScalingQuantizer):
    """Per-tensor FP8 whose scale comes from the tensor being cast (TE's name).

    Args:
        fp8_dtype: ``DType.kFloat8E4M3`` / ``kFloat8E5M2`` (or the torch dtypes).
        device: accepted for TE compatibility (state follows the data).
        with_amax_reduction, amax_reduction_group: all-reduce (MAX) the amax over the
            group first, so every rank casts with one scale.
        force_pow_2_scales: round the scale down to a power of two.
        amax_epsilon: the amax used is ``max(amax, amax_epsilon)``.
    """

    def __init__(
        self,
        fp8_dtype: Union[DType, torch.dtype],
        device: Optional[Union[torch.device, str]] = None,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        with_amax_reduction: bool = False,
        amax_reduction_group: Optional[dist.ProcessGroup] = None,
        force_pow_2_scales: bool = False,
        amax_epsilon: float = 0.0,
    ) -> None:
        dtype = _fp8(fp8_dtype, "Float8CurrentScalingQuantizer fp8_dtype")
        if with_amax_reduction and amax_reduction_group is None:
            raise ValueError("Float8CurrentScalingQuantizer: with_amax_reduction=True needs amax_reduction_group")
        if not isinstance(amax_epsilon, (int, float)) or amax_epsilon < 0:
            raise ValueError(f"Float8CurrentScalingQuantizer amax_epsilon: expected a float >= 0, got {amax_epsilon!r}")
        fmt = Format.E4M3 if dtype == torch.float8_e4m3fn else Format.E5M2
        recipe = Float8CurrentScaling(fp8_format=fmt, power_2_scale=bool(force_pow_2_scales))
        super().__init__(recipe, "input", amax_reduction_group if with_amax_reduction else None)
        self.amax_epsilon = float(amax_epsilon)
        self.with_amax_reduction = bool(with_amax_reduction)
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.device = device
        self.set_usage(rowwise=rowwise, columnwise=columnwise)

    def copy(self) -> "Float8CurrentScalingQuantizer":
        """TE's shallow copy: the same settings and group, no shared state."""
        return Float8CurrentScalingQuantizer(
            self.fp8_dtype, self.device, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            with_amax_reduction=self.with_amax_reduction, amax_reduction_group=self.amax_reduction_group,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon,
        )

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, *, transpose: bool = False) -> Float8Tensor:
        if self.amax_epsilon > 0:
            amax = torch.clamp_min(amax, self.amax_epsilon)
        return super().quantize_with_amax(x, amax, transpose=transpose)

    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        return self.quantize_with_amax(x, amax_abs(x), transpose=transpose)
