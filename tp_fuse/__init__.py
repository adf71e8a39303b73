"""tp_fuse: tensor-parallel training with FP8 and communication/GEMM overlap.

``import tp_fuse as te`` gives the operation-fuser API under ``te.ops`` and the
FP8 entry points ``te.autocast``, ``te.quantized_model_init`` and
``te.recipe``, with Transformer Engine's names, and TE's module classes ``te.Linear``, ``te.LayerNormLinear``
and ``te.LayerNormMLP`` (``tp_fuse.module``), ``te.MultiheadAttention`` (``tp_fuse.attention``) and
``te.TransformerLayer`` (``tp_fuse.transformer``).

The TE names live in the TE room, ``tp_fuse.te``, the top floor (it builds on
``tp_fuse.layers``). They are loaded on first use (module ``__getattr__`` here, and
:mod:`tp_fuse._te_paths` for TE's module paths), so importing ``tp_fuse`` or a lower floor such
as ``tp_fuse.comm`` does not import the floors above it.
"""

import importlib

from . import _te_paths, ops, recipe, utils
from .availability import (
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .distributed import checkpoint
from .graphs import make_graphed_callables
from .ops.explain import explain
from .utils import get_device_compute_capability
from .quantization import (
    DType,
    FP8WeightCache,
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

_te_paths.install()

#: Names served by the TE room on first use (it imports tp_fuse.layers, a floor above this one).
_TE_NAMES = frozenset({"DotProductAttention", "Fp8Padding", "Fp8Unpadding", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP",
                       "Linear", "MultiheadAttention", "RMSNorm", "TransformerLayer", "fp8_autocast",
                       "fp8_model_init", *_te_paths.TE_MODULES})


def __getattr__(name: str):
    if name == "layers":
        # `import tp_fuse; tp_fuse.layers.GPT` worked while this package imported the TE room
        # eagerly; the floor above is now imported on first use instead.
        return importlib.import_module("tp_fuse.layers")
    if name in _TE_NAMES:
        # Lazy: the TE room sits on tp_fuse.layers, which imports this package.
        from . import te
        value = getattr(te, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tp_fuse' has no attribute {name!r}")

__all__ = [
    "DType",
    "FP8WeightCache",
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
    "constants",
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
