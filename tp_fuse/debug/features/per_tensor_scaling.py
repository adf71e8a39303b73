"""``PerTensorScaling``: cast the listed GEMM inputs with per-tensor current scaling."""

from __future__ import annotations

from typing import Any, Optional

import torch
from nvdlfw_inspect.registry import api_method

from tp_fuse.debug.features.api import DebugFeature
from tp_fuse.quantization import Float8CurrentScalingQuantizer, Float8Tensor
from tp_fuse.quantization.float8.current_scaling import CurrentScalingQuantizer
from tp_fuse.quantization.float8.delayed_scaling import DelayedScalingQuantizer

__all__ = ["PerTensorScaling"]


class PerTensorScaling(DebugFeature):
    """TE's ``PerTensorScaling``: the listed tensors of the listed GEMMs are cast to FP8
    with a scale computed from the tensor itself (current scaling,
    ``scale = fp8_max / amax``) instead of the recipe's scale; the GEMM stays in FP8.

    Options: ``gemms`` / ``gemms_struct`` and ``tensors`` / ``tensors_struct``
    (activation, weight, gradient). The FP8 format is the one of the layer's own
    quantizer for that tensor (``default_quantizer``), so the feature needs a per-tensor
    FP8 recipe in force (``DelayedScaling`` or ``Float8CurrentScaling``); a block-scaled
    recipe's GEMM cannot take a per-tensor operand, which is an error.
    """

    options = frozenset()
    allowed_tensors = frozenset({"activation", "weight", "gradient"})

    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return True, iteration + 1

    @api_method
    @torch.no_grad()
    def modify_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        default_quantizer: Any,
        iteration: int = 0,
        out: Optional[torch.Tensor] = None,
        **_: Any,
    ) -> Float8Tensor:
        if not isinstance(default_quantizer, (DelayedScalingQuantizer, CurrentScalingQuantizer)):
            raise ValueError(
                f"PerTensorScaling on {layer_name}/{gemm}/{tensor_name}: needs a per-tensor FP8 recipe "
                f"(DelayedScaling or Float8CurrentScaling) in force, got quantizer "
                f"{type(default_quantizer).__name__ if default_quantizer is not None else None}")
        quantizer = Float8CurrentScalingQuantizer(default_quantizer.fp8_dtype)
        # The transposed copy is made here too: dgrad and wgrad read operands transposed.
        return quantizer.quantize(tensor.detach(), transpose=True)
