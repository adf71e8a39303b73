"""Quantizers per recipe: :func:`make_quantizer` builds one for a role, and
:class:`OpQuantizers` keeps an op's set by role across steps, rebuilt only when the
recipe changes. Recipes defined outside the per-tensor ones (block-scaled, NVFP4) are
built through the factories they register with
:func:`~tp_fuse.quantization.quantizer.register_recipe_quantizer`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch.distributed as dist

from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe
from .compile_ref import CompileRef
from .float8.current_scaling import CurrentScalingQuantizer
from .float8.delayed_scaling import DelayedScalingQuantizer
from .quantizer import Quantizer, RECIPE_QUANTIZERS
from .role import QuantizerRole, role_tensor_type

__all__ = ["OpQuantizers", "make_quantizer"]


def make_quantizer(
    recipe: Recipe, role: Union[str, QuantizerRole], amax_reduction_group: Optional[dist.ProcessGroup] = None
) -> Quantizer:
    """A fresh quantizer for ``role`` (a role name, or a :class:`QuantizerRole`, whose
    ``tensor_type`` names it) under ``recipe``."""
    role = role_tensor_type(role)
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingQuantizer(recipe, role)
    if isinstance(recipe, Float8CurrentScaling):
        return CurrentScalingQuantizer(recipe, role, amax_reduction_group)
    factory = RECIPE_QUANTIZERS.get(type(recipe))
    if factory is not None:
        return factory(recipe, role)
    known = ["DelayedScaling", "Float8CurrentScaling"] + [t.__name__ for t in RECIPE_QUANTIZERS]
    raise ValueError(f"recipe: expected one of {known}, got {type(recipe).__name__}")


class OpQuantizers:
    """The quantizers of one op, by role, persisting across steps.

    ``get(recipe, group)`` returns the same quantizer objects on every call
    while the recipe is unchanged -- the same object, or an equal one (a new
    ``DelayedScaling()`` per step keeps the amax history). A recipe that
    differs (or was mutated in place since) rebuilds all quantizers. A new
    ``amax_reduction_group`` does not rebuild: it is handed to the current-
    scaling quantizers (delayed scaling reduces per autocast, not per quantizer).
    """

    def __init__(self, roles: Sequence[str]) -> None:
        roles = tuple(roles)
        if not roles or not all(isinstance(r, str) and r for r in roles):
            raise ValueError(f"OpQuantizers roles: expected non-empty role names, got {roles!r}")
        if len(set(roles)) != len(roles):
            raise ValueError(f"OpQuantizers roles: expected distinct names, got {roles!r}")
        self.roles = roles
        self._recipe_snapshot: Optional[Recipe] = None
        self._quantizers: dict[str, Quantizer] = {}
        # How torch.compile'd graphs name this object in custom-op calls (compile_state).
        self.compile_ref = CompileRef(self)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "compile_ref"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (copy/deepcopy/unpickle) is another object: it gets its own ref, or a
        # compiled graph of the copy would quantize with the original's state.
        self.__dict__.update(state)
        self.compile_ref = CompileRef(self)

    def get(
        self, recipe: Recipe, amax_reduction_group: Optional[dist.ProcessGroup] = None
    ) -> dict[str, Quantizer]:
        """Quantizers by role for ``recipe`` (built on first use or recipe change)."""
        if not isinstance(recipe, Recipe):
            raise ValueError(f"recipe: expected a tp_fuse.recipe.Recipe, got {type(recipe).__name__}")
        snap = self._recipe_snapshot
        # Compare against a snapshot, not the caller's object: equality then also
        # catches a recipe edited in place after the quantizers were built.
        if snap is None or type(snap) is not type(recipe) or snap != recipe:
            self._recipe_snapshot = copy.copy(recipe)
            # Quantizers get the snapshot too, so later edits to the caller's
            # object cannot change their behaviour behind this check.
            self._quantizers = {
                role: make_quantizer(self._recipe_snapshot, role, amax_reduction_group)
                for role in self.roles
            }
        for q in self._quantizers.values():
            if isinstance(q, CurrentScalingQuantizer):
                q.amax_reduction_group = amax_reduction_group
        return dict(self._quantizers)

    @property
    def quantizers(self) -> dict[str, Quantizer]:
        """The quantizers built by the last :meth:`get` (empty before)."""
        return dict(self._quantizers)
