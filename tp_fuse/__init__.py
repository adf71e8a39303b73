"""tp_fuse: tensor-parallel training with FP8 and communication/GEMM overlap.

``import tp_fuse as te`` gives the operation-fuser API under ``te.ops`` and the
FP8 entry points ``te.autocast``, ``te.quantized_model_init`` and
``te.recipe``, with Transformer Engine's names, and TE's module classes ``te.Linear``, ``te.LayerNormLinear``
and ``te.LayerNormMLP``
(``tp_fuse.module``), ``te.MultiheadAttention`` (``tp_fuse.attention``) and ``te.TransformerLayer``
(``tp_fuse.transformer``).
"""

from . import constants, cpp_extensions, module, ops, recipe, utils
from .availability import (
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .distributed import checkpoint
from .graphs import make_graphed_callables
from .module import LayerNormLinear, LayerNormMLP, Linear
from .ops.explain import explain
from .utils import get_device_compute_capability
from .quantization import (
    DType,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8BlockwiseQTensor,
    Float8Tensor,
    MXFP8Tensor,
    NVFP4Quantizer,
    MXFP8Quantizer,
    Float8BlockQuantizer,
    NVFP4Tensor,
    QuantizedTensor,
    Quantizer,
    QuantizerRole,
    autocast,
    quantized_model_init,
)
# Last: they import tp_fuse.layers, which imports the names above.
from . import attention, transformer
from .attention import MultiheadAttention
from .transformer import TransformerLayer

__all__ = [
    "DType",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8BlockwiseQTensor",
    "Float8Tensor",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MXFP8Tensor",
    "MultiheadAttention",
    "NVFP4Quantizer",
    "MXFP8Quantizer",
    "Float8BlockQuantizer",
    "NVFP4Tensor",
    "QuantizedTensor",
    "Quantizer",
    "QuantizerRole",
    "TransformerLayer",
    "attention",
    "autocast",
    "checkpoint",
    "cpp_extensions",
    "explain",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "make_graphed_callables",
    "module",
    "ops",
    "quantized_model_init",
    "recipe",
    "transformer",
    "utils",
]
__version__ = "0.1.0"
