"""tp_fuse: tensor-parallel training with FP8 and communication/GEMM overlap.

``import tp_fuse as te`` gives the operation-fuser API under ``te.ops`` and the
FP8 entry points ``te.autocast``, ``te.quantized_model_init`` and
``te.recipe``, with Transformer Engine's names.
"""

from . import ops, recipe
from .distributed import checkpoint
from .ops.explain import explain
from .quantization import Float8Tensor, autocast, quantized_model_init

__all__ = ["Float8Tensor", "autocast", "checkpoint", "explain", "ops", "quantized_model_init", "recipe"]
__version__ = "0.1.0"
