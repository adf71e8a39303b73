"""Transformer Engine's ``transformer_engine.common.recipe`` as Megatron-Core constructs it:
``tp_fuse.recipe`` with a :class:`DelayedScaling` that takes TE's whole keyword set.

TE's recipes are pydantic dataclasses, which *ignore* unknown keywords: Megatron-Core's
``TEDelayedScaling`` passes ``override_linear_precision`` (a field of TE 1.x), ``fp8_dpa``,
``fp8_mha`` and even ``params_dtype`` / ``device``. ``tp_fuse.recipe.DelayedScaling`` is a plain
dataclass (unknown keywords are an error there, and stay so). This subclass accepts TE's
keywords and checks each: those that ask for nothing (``fp8_dpa=False``, ``fp8_mha=False``,
``override_linear_precision=(False, False, False)``) are accepted, anything else that would
change numerics is refused (ValueError naming it), and ``params_dtype`` / ``device`` (not
recipe fields; TE drops them) are dropped. It *is* a ``tp_fuse.recipe.DelayedScaling``, so
every op treats it as one.

Used where ``transformer_engine`` is mapped to tp_fuse by :mod:`tp_fuse.te.te_alias`.
"""

from __future__ import annotations

from typing import Any

from tp_fuse import recipe as _recipe
from tp_fuse.recipe import (
    CustomRecipe,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
]

#: Keywords TE's pydantic recipe silently drops that are not recipe settings at all.
_DROPPED = frozenset({"params_dtype", "device"})


class DelayedScaling(_recipe.DelayedScaling):
    """``tp_fuse.recipe.DelayedScaling`` with TE's keywords (see the module docstring)."""

    def __init__(self, margin: int = 0, fp8_format: Format = Format.HYBRID, amax_history_len: int = 1024,
                 amax_compute_algo: Any = "max", scaling_factor_compute_algo: Any = None,
                 reduce_amax: bool = True, fp8_dpa: bool = False, fp8_mha: bool = False,
                 override_linear_precision: tuple[bool, bool, bool] = (False, False, False),
                 **kwargs: Any) -> None:
        unknown = set(kwargs) - _DROPPED
        if unknown:
            raise ValueError(f"DelayedScaling: unexpected arguments {sorted(unknown)}")
        for name, value in (("fp8_dpa", fp8_dpa), ("fp8_mha", fp8_mha)):
            if value is not False:
                raise ValueError(f"DelayedScaling: {name}={value!r} is not supported by tp_fuse (False: "
                                 "attention runs in high precision)")
        if tuple(override_linear_precision) != (False, False, False):
            raise ValueError(f"DelayedScaling: override_linear_precision={override_linear_precision!r} is not "
                             "supported by tp_fuse ((False, False, False): fprop, dgrad and wgrad all in FP8)")
        super().__init__(margin=margin, fp8_format=fp8_format, amax_history_len=amax_history_len,
                         amax_compute_algo=amax_compute_algo,
                         scaling_factor_compute_algo=scaling_factor_compute_algo, reduce_amax=reduce_amax)
