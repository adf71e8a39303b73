"""FP8 recipes: which FP8 formats to use and how to choose scaling factors.

Names and fields follow Transformer Engine's ``transformer_engine.common.recipe``
so that user code can switch between the two libraries:

* :class:`Format` -- the FP8 formats for forward tensors (activations, weights)
  and backward tensors (gradients); :class:`Recipe` -- the base class, with TE's
  predicates (``delayed()``, ``nvfp4()``...) (``base.py``).
* :class:`DelayedScaling` -- per-tensor scales computed from a history of past
  absolute maxima ("amax"), updated once per step after an amax reduction.
* :class:`Float8CurrentScaling` -- per-tensor scales computed from the tensor
  being quantized, at the moment it is quantized.
* :class:`CustomRecipe` -- Transformer Engine's per-role quantizer factory; constructible
  here, refused by ``autocast`` (see its docstring) (these three: ``per_tensor.py``).
* Block-scaled recipes (:class:`Float8BlockScaling`, :class:`MXFP8BlockScaling`,
  :class:`Float8RowwiseScaling`, ``block.py``) and :class:`NVFP4BlockScaling` (FP4 E2M1
  data, E4M3 block scales plus an FP32 per-tensor scale, ``nvfp4.py``).

Recipes are plain validated dataclasses. Equality is field-wise, so two recipes
built with the same arguments are interchangeable (quantizer state is reused);
callables compare by identity.

TE's ``backward_override`` (every recipe) and ``NVFP4BlockScaling.row_scaled_activation``
take TE's values at construction, because TE's code and tests build such recipes (and
set the fields afterwards); the ops do not implement them, so ``tp_fuse.autocast``
refuses a recipe with a value other than the default (:func:`unsupported_recipe_options`).
"""

from .base import (
    BACKWARD_OVERRIDES,
    FP4_DTYPE,
    FP4_MAX,
    Format,
    Recipe,
    fp8_dtype_max,
    low_precision_max,
    unsupported_recipe_options,
)
from .block import Float8BlockScaling, Float8RowwiseScaling, MMParams, MXFP8BlockScaling, QParams
from .nvfp4 import NVFP4BlockScaling
from .per_tensor import CustomRecipe, DelayedScaling, Float8CurrentScaling

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "QParams",
    "MMParams",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "Float8RowwiseScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "BACKWARD_OVERRIDES",
    "FP4_DTYPE",
    "FP4_MAX",
    "fp8_dtype_max",
    "low_precision_max",
    "unsupported_recipe_options",
]
