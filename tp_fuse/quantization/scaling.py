"""Pure functions that turn amaxes into FP8 scaling factors.

Conventions (shared by every quantizer):

* ``scale`` multiplies high-precision values into FP8 range:
  ``fp8 = saturate(x * scale)``; ``scale_inv = 1 / scale`` undoes it.
* Scales are fp32 0-d tensors. The arithmetic is done in float64 and rounded to
  fp32 once, so a float64 reference reproduces it exactly.
* A scale that would overflow fp32 (amax tiny but positive) is clamped to the
  largest fp32 value, as Transformer Engine does, rather than becoming ``inf``
  (``0 * inf`` would turn zeros into NaN).
* Nothing here calls ``.item()``: decisions are ``torch.where`` selections, so a
  step's scale update does not synchronize a GPU with the host.

Delayed scaling (:func:`amax_from_history`, :func:`delayed_scale`,
:func:`roll_amax_history`) follows TE's order: slot 0 of the history is the
current step; after the update the history is rolled so that the current amax
moves to the last slot and a fresh, zeroed slot 0 starts the next step.

``"max"`` over a history that holds a NaN is NaN (``torch.amax`` semantics): a
step that produced NaNs keeps the scale frozen, and is counted, until it leaves
the window. (TE's CUDA kernel uses ``fmaxf``, which skips NaN; we prefer to make
divergence visible rather than silently scale from the remaining slots.)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch

from ..kernels._common import current_scale_torch, round_down_to_power_of_2

__all__ = [
    "amax_from_history",
    "delayed_scale",
    "roll_amax_history",
    "current_scale",
    "round_down_to_power_of_2",
    "is_nonfinite",
    "nan_to_inf",
]

_FP32_MAX = float(torch.finfo(torch.float32).max)


def _as_scalar_tensor(value: Any, name: str) -> torch.Tensor:
    """A 0-d fp32 tensor from a user callable's result (tensor or number)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(
            f"{name}: expected a number or a one-element tensor, got "
            f"{type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point result, got {value.dtype}")
    return value.detach().reshape(()).to(torch.float32)


def amax_from_history(
    history: torch.Tensor, algo: Union[str, Callable[[torch.Tensor], Any]]
) -> torch.Tensor:
    """The amax that sets the next scale, as a 0-d fp32 tensor.

    Args:
        history: 1-D fp32 amax history, slot 0 = the current step.
        algo: ``"max"`` (max over all slots, NaN-propagating), ``"most_recent"``
            (slot 0), or a callable receiving ``history`` and returning the amax.
    """
    if history.dim() != 1 or history.numel() == 0:
        raise ValueError(
            f"amax history: expected a non-empty 1-D tensor, got shape {tuple(history.shape)}"
        )
    if algo == "max":
        return history.amax().to(torch.float32)
    if algo == "most_recent":
        return history[0].to(torch.float32)
    if callable(algo):
        # The callable gets a copy: it must not be able to edit the live history.
        return _as_scalar_tensor(algo(history.clone()), "amax_compute_algo result")
    raise ValueError(
        f"amax_compute_algo: expected 'max', 'most_recent' or a callable, got {algo!r}"
    )


def is_nonfinite(amax: torch.Tensor) -> torch.Tensor:
    """Bool tensor: amax is NaN or +-inf (3 tensor ops; ``isfinite`` decomposes into 4)."""
    return ~(amax.abs() < math.inf)


def delayed_scale(
    amax: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
    margin: int,
    scaling_factor_compute_algo: Optional[Callable[..., Any]] = None,
    recipe: Any = None,
) -> torch.Tensor:
    """Next delayed-scaling scale (0-d fp32).

    ``(fp8_max / amax) / 2**margin`` -- or ``scaling_factor_compute_algo(amax,
    scale, fp8_max, recipe)`` when given -- if ``amax`` is finite and > 0;
    otherwise ``scale`` (the previous scale) unchanged.
    """
    amax64 = amax.detach().reshape(()).to(torch.float64)
    usable = torch.isfinite(amax64) & (amax64 > 0)
    if scaling_factor_compute_algo is None:
        # Division by a placeholder 1.0 where unusable avoids inf/NaN warnings; the
        # value is discarded by the where() below anyway.
        safe = torch.where(usable, amax64, torch.ones_like(amax64))
        new = (fp8_max / safe) / (2.0**margin)
    else:
        new = _as_scalar_tensor(
            scaling_factor_compute_algo(amax.detach().clone(), scale.detach().clone(), fp8_max, recipe),
            "scaling_factor_compute_algo result",
        ).to(torch.float64)
    new = new.clamp(max=_FP32_MAX)
    return torch.where(usable, new, scale.detach().reshape(()).to(torch.float64)).to(
        torch.float32
    )


def roll_amax_history(history: torch.Tensor) -> torch.Tensor:
    """History for the next step: shift left by one, zero the new slot 0.

    Slot 0 (this step) moves to the last slot, slot 1 (the oldest) is dropped --
    the same order as TE: ``torch.roll(h, -1); h[0] = 0``.
    """
    rolled = torch.roll(history, -1, 0)
    rolled[0] = 0.0
    return rolled


def current_scale(amax: torch.Tensor, fp8_max: float, power_2_scale: bool = False) -> torch.Tensor:
    """Current-scaling scale (0-d fp32): ``fp8_max / amax``.

    A zero or non-finite amax gives 1.0 (there is no sensible range to map;
    1.0 leaves values as they are and saturates infinities). A positive amax so
    small that the scale overflows fp32 gives the largest fp32 value. With
    ``power_2_scale`` the result is rounded down to a power of two.
    """
    return current_scale_and_checks(amax, fp8_max, power_2_scale)[0]


def current_scale_and_checks(
    amax: torch.Tensor, fp8_max: float, power_2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, nonfinite, zero)`` for an amax (``max |x|``: >= 0, or NaN/inf):
    :func:`current_scale`, and whether the amax is non-finite / zero (0-d bools). The one
    implementation is the kernels' (``tp_fuse.kernels._common.current_scale_torch``),
    which the Triton cast kernel reproduces."""
    return current_scale_torch(amax, fp8_max, power_2_scale)


def nan_to_inf(amax: torch.Tensor) -> torch.Tensor:
    """Replace NaN amaxes by +inf before a MAX all-reduce.

    Backends compare with ``<``, so ``max(NaN, x)`` depends on operand order
    and ranks could disagree; +inf is non-finite too but orders consistently.
    """
    return torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)
