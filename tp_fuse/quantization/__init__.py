"""FP8 quantization: Float8 tensors, quantizers, amax reduction, autocast, FP8 GEMM.

See ``docs/internals.md`` for the contracts other packages rely on.
"""

from .amax_reduction import AmaxReductionBuffer, BackwardAmaxTracker
from .autocast import (
    AutocastContext,
    active_autocast,
    autocast,
    model_init_recipe,
    quantized_model_init,
)
from .block import wire as block_wire
from .block.quantizer import BlockScalingQuantizer, is_block_recipe
from .block.tensor import BlockPayload, BlockScaledTensor, Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor
from .nvfp4.quantizer import NVFP4Quantizer
from .block.te_quantizers import Float8BlockQuantizer, MXFP8Quantizer
from .float8.tensor import Float8Tensor
from .quantized_tensor import QuantizedTensor
from .role import QuantizerRole
from .float8.te_quantizers import DType, Float8CurrentScalingQuantizer, Float8Quantizer
from .gemm import fp8_gemm
from .parameter import is_fp8_parameter, make_fp8_parameter
from .float8.current_scaling import CurrentScalingQuantizer
from .float8.delayed_scaling import DelayedScalingQuantizer
from .op_quantizers import OpQuantizers, make_quantizer
from .quantizer import Quantizer, is_backward_role

from .scaling import delayed_scale as _delayed_scale
from .weight_cache import FP8WeightCache

QUANTIZED_TENSOR_TYPES = (Float8Tensor, BlockScaledTensor)


def _default_sf_compute(amax: "torch.Tensor", scale: "torch.Tensor", fp8_max: float, margin: int) -> "torch.Tensor":
    """Transformer Engine's delayed-scaling scale update under its name: ``(fp8_max / amax)
    / 2**margin`` where amax is finite and > 0, else the old ``scale``; written into
    ``scale`` (as TE does) and returned. tp_fuse's own function is ``scaling.delayed_scale``."""
    new = _delayed_scale(amax, scale, fp8_max, margin)
    scale.copy_(new.reshape(scale.shape).to(scale.dtype))
    return scale


def is_quantized_tensor(t: object) -> bool:
    """Whether ``t`` is quantized (per-tensor Float8Tensor or block-scaled)."""
    return isinstance(t, QUANTIZED_TENSOR_TYPES)


__all__ = [
    "AmaxReductionBuffer",
    "AutocastContext",
    "BlockPayload",
    "BlockScaledTensor",
    "BlockScalingQuantizer",
    "is_block_recipe",
    "is_quantized_tensor",
    "BackwardAmaxTracker",
    "CurrentScalingQuantizer",
    "DType",
    "DelayedScalingQuantizer",
    "FP8WeightCache",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8BlockwiseQTensor",
    "Float8Tensor",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "MXFP8Quantizer",
    "Float8BlockQuantizer",
    "NVFP4Tensor",
    "QuantizedTensor",
    "QuantizerRole",
    "OpQuantizers",
    "Quantizer",
    "active_autocast",
    "autocast",
    "fp8_gemm",
    "is_backward_role",
    "is_fp8_parameter",
    "make_fp8_parameter",
    "make_quantizer",
    "model_init_recipe",
    "quantized_model_init",
]
