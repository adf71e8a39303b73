"""The FP8/FP4 formats, the :class:`Recipe` base class and what every recipe shares."""

from __future__ import annotations

import enum
import os
from typing import Any, NamedTuple, Optional

import torch

class _FormatHelper(NamedTuple):
    """A :class:`Format`'s value, as in Transformer Engine: the largest finite
    values of its forward and backward FP8 dtypes (``Format.HYBRID.value.max_fwd``)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 formats used in the forward and backward passes.

    ``E4M3``: E4M3 everywhere (max 448, finer mantissa).
    ``E5M2``: E5M2 everywhere (max 57344, wider range).
    ``HYBRID``: E4M3 for forward tensors, E5M2 for gradients -- gradients need
    range more than precision.
    ``E2M1``: the FP4 format of :class:`NVFP4BlockScaling` (max 6); its torch dtype is
    ``torch.float4_e2m1fn_x2`` (two values packed per byte).

    Values are ``(max_fwd, max_bwd)`` named tuples, as in Transformer Engine.
    """

    E2M1 = _FormatHelper(max_fwd=6.0, max_bwd=6.0)
    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)

    @property
    def fwd_dtype(self) -> torch.dtype:
        """Low-precision dtype of forward-pass tensors (inputs, weights)."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """Low-precision dtype of backward-pass tensors (gradients)."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    @property
    def fwd_max(self) -> float:
        """Largest finite value of :attr:`fwd_dtype` (6, 448 or 57344)."""
        return low_precision_max(self.fwd_dtype)

    @property
    def bwd_max(self) -> float:
        """Largest finite value of :attr:`bwd_dtype` (6, 448 or 57344)."""
        return low_precision_max(self.bwd_dtype)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: FP4 E2M1 (two values per byte): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
FP4_DTYPE = torch.float4_e2m1fn_x2
FP4_MAX = 6.0


def low_precision_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype or of FP4 E2M1 (6.0)."""
    if dtype == FP4_DTYPE:
        return FP4_MAX
    return fp8_dtype_max(dtype)


def fp8_dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448.0 (E4M3) or 57344.0 (E5M2)."""
    if dtype not in _FP8_DTYPES:
        raise ValueError(
            f"fp8 dtype: expected one of {_FP8_DTYPES}, got {dtype}"
        )
    return float(torch.finfo(dtype).max)


def _check_type(name: str, value: Any, expected: type | tuple[type, ...], what: str) -> None:
    # bool is an int subclass; a flag passed as margin is a mistake, not a value.
    ok = isinstance(value, expected) and not (
        isinstance(value, bool) and expected is int
    )
    if not ok:
        raise ValueError(f"{name}: expected {what}, got {value!r} ({type(value).__name__})")


def _check_not_fp4(name: str, fmt: "Format") -> None:
    if fmt is Format.E2M1:
        raise ValueError(f"{name}.fp8_format: expected an FP8 format (E4M3, E5M2, HYBRID), got E2M1 "
                         "(FP4 training is NVFP4BlockScaling)")


class Recipe:
    """Base class of the recipes (Transformer Engine's ``Recipe``).

    The predicates are TE's: exactly one of them is True for a built-in recipe (each
    subclass names its ``_kind``)."""

    fp8_format: Format
    _kind: str = ""

    def delayed(self) -> bool:
        """Delayed (history-based) per-tensor scaling: :class:`DelayedScaling`."""
        return self._kind == "delayed"

    def float8_current_scaling(self) -> bool:
        """Current (just-in-time) per-tensor scaling: :class:`Float8CurrentScaling`."""
        return self._kind == "float8_current_scaling"

    def float8_per_tensor_scaling(self) -> bool:
        """Per-tensor FP8 scaling, delayed or current (TE's predicate)."""
        return self.delayed() or self.float8_current_scaling()

    def float8_block_scaling(self) -> bool:
        """128-element block FP8 scaling: :class:`Float8BlockScaling`."""
        return self._kind == "float8_block_scaling"

    def mxfp8(self) -> bool:
        """MXFP8 (32-element E8M0 blocks): :class:`MXFP8BlockScaling`."""
        return self._kind == "mxfp8"

    def nvfp4(self) -> bool:
        """NVFP4 (FP4 E2M1, 16-element E4M3 blocks): :class:`NVFP4BlockScaling`."""
        return self._kind == "nvfp4"

    def custom(self) -> bool:
        """A :class:`CustomRecipe` (TE's predicate of the same name)."""
        return self._kind == "custom"


#: TE's ``backward_override`` values: None (the backward GEMMs read the forward's quantized
#: tensors), "high_precision" (they read the unquantized ones), "dequantized".
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def check_backward_override(name: str, value: Any) -> None:
    """TE's values only (ValueError otherwise). A value other than None is accepted here, as
    TE accepts it, and refused where the recipe is used (``tp_fuse.autocast``): tp_fuse's
    backward GEMMs always read the forward's quantized tensors."""
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(f"{name}.backward_override (or NVTE_BACKWARD_OVERRIDE): expected one of {BACKWARD_OVERRIDES}, got {value!r}")


def env_backward_override() -> Optional[str]:
    """TE's default of ``backward_override``: the ``NVTE_BACKWARD_OVERRIDE`` environment variable."""
    return os.getenv("NVTE_BACKWARD_OVERRIDE", None)


def unsupported_recipe_options(recipe: "Recipe") -> list[str]:
    """The TE options set on ``recipe`` that tp_fuse's ops do not implement, as
    ``"<Class>.<field>=<value>"`` (empty: the recipe can run). Read where a recipe is put to
    use (``tp_fuse.autocast``), because TE code sets these fields after construction too."""
    cls = type(recipe).__name__
    found = []
    override = getattr(recipe, "backward_override", None)
    if override is not None:
        found.append(f"{cls}.backward_override={override!r} (only None is implemented: the backward "
                     "GEMMs read the forward's quantized tensors)")
    if getattr(recipe, "enable_2d_quantization", False):
        found.append(f"{cls}.enable_2d_quantization=True (only False is implemented: 1x32 blocks for "
                     "weights too)")
    if getattr(recipe, "row_scaled_activation", False):
        found.append(f"{cls}.row_scaled_activation=True (only False is implemented: one FP32 "
                     "scale per tensor)")
    return found
