"""FP8 autocast and quantized model initialization contexts.

``autocast`` turns on FP8 compute for ops run inside it; ``quantized_model_init``
makes ops created inside it keep FP8 weights. Both live in ``contextvars``, not
module globals: two models driven from different contexts (threads, asyncio
tasks, or simply separate ``with`` blocks) never see each other's state, and
nothing leaks past a ``with`` block.

Amax bookkeeping for delayed scaling belongs to the *outermost* autocast:
nested autocasts join its buffers, keyed by (recipe, amax_reduction_group).
When the outermost autocast exits normally, each forward buffer issues one
all-reduce(MAX) and updates its quantizers. If the block raises, no collective
is issued (other ranks may not reach it) and the step's amaxes stay in the
quantizers' slot 0, folded into the next step.

Typical op usage::

    ctx = active_autocast()
    if ctx is not None:
        qs = self.quantizers.get(ctx.recipe, ctx.amax_reduction_group)
        x8 = qs["input"].quantize(x); ctx.track_forward(qs["input"])
        autograd_ctx.tracker = ctx.backward_tracker   # backward: tracker.track(qs["grad_output"])
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Optional

import torch.distributed as dist

from ..recipe import CustomRecipe, DelayedScaling, Recipe, unsupported_recipe_options
from .amax_reduction import AmaxReductionBuffer, BackwardAmaxTracker
from .block.quantizer import BlockScalingQuantizer
from .compile_state import compile_key, set_traced_key
from .gemm_choice import GemmChoice, resolve_gemms, set_traced_gemms_auto
from .float8.current_scaling import CurrentScalingQuantizer
from .float8.delayed_scaling import DelayedScalingQuantizer
from .quantizer import Quantizer
from .weight_cache import FP8WeightCache, check_weight_cache

__all__ = [
    "AutocastContext",
    "autocast",
    "active_autocast",
    "quantized_model_init",
    "model_init_recipe",
    "current_autocast",
    "reenter_autocast",
]


class _Entry:
    """Reduction state of one (recipe, group) within one step."""

    def __init__(self, recipe: Recipe, group: Optional[dist.ProcessGroup]) -> None:
        self.recipe = recipe
        self.group = group
        # Current-scaling recipes have no reduce_amax; delayed-scaling quantizers
        # tracked under them (e.g. FP8 weights) still reduce over the group.
        reduce_amax = recipe.reduce_amax if isinstance(recipe, DelayedScaling) else True
        self.forward = AmaxReductionBuffer(group, reduce_amax)
        # Created lazily: a forward-only step never needs one.
        self._backward: Optional[BackwardAmaxTracker] = None
        self._reduce_amax = reduce_amax

    @property
    def backward(self) -> BackwardAmaxTracker:
        if self._backward is None:
            self._backward = BackwardAmaxTracker(self.group, self._reduce_amax)
        return self._backward


class _StepState:
    """Buffers shared by an outermost autocast and every autocast nested in it."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def entry(self, recipe: Recipe, group: Optional[dist.ProcessGroup]) -> _Entry:
        # Recipes are mutable dataclasses (unhashable): linear search, few entries.
        for e in self.entries:
            if e.group is group and type(e.recipe) is type(recipe) and e.recipe == recipe:
                return e
        e = _Entry(recipe, group)
        self.entries.append(e)
        return e

    def finish_forward(self) -> None:
        for e in self.entries:
            e.forward.reduce_and_update()


class AutocastContext:
    """The state an op sees inside ``autocast``: recipe, group, amax tracking.

    Attributes:
        recipe: the FP8 recipe in force.
        amax_reduction_group: process group for amax reductions (or None).
        enabled: False inside ``autocast(enabled=False)``.
        gemm_choice: None when every GEMM runs FP8 (``gemms="all"``), else the
            :class:`~tp_fuse.quantization.gemm_choice.GemmChoice` that decides per Linear.
        weight_cache: the :class:`~tp_fuse.quantization.weight_cache.FP8WeightCache` whose
            FP8 weights later micro-batches reuse, or None (every forward casts).
    """

    def __init__(
        self,
        enabled: bool,
        recipe: Recipe,
        amax_reduction_group: Optional[dist.ProcessGroup],
        state: _StepState,
        gemm_choice: Optional[GemmChoice] = None,
        weight_cache: Optional[FP8WeightCache] = None,
    ) -> None:
        self.enabled = enabled
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self.gemm_choice = gemm_choice
        self.weight_cache = weight_cache
        self._state = state
        self._fusion_key: Optional[tuple[str, str]] = None

    @property
    def fusion_key(self) -> tuple[str, str]:
        """What the fuser's fusion decisions depend on: the recipe's type and ``repr``
        (a recipe mutated in place between steps, or an equal new one, is seen as such).
        Computed once per context: ``repr`` of a recipe costs ~20 us, and every fusion
        group asks on every call."""
        if self._fusion_key is None:
            self._fusion_key = (type(self.recipe).__name__, repr(self.recipe))
        return self._fusion_key

    def _entry(self) -> _Entry:
        return self._state.entry(self.recipe, self.amax_reduction_group)

    def track_forward(self, quantizer: Quantizer) -> None:
        """Make ``quantizer`` part of this step's forward amax reduction.

        Idempotent within a step. A no-op for current-scaling and block-scaled
        quantizers (their scales come from local data at quantize time).
        """
        if isinstance(quantizer, (CurrentScalingQuantizer, BlockScalingQuantizer)):
            return
        if not isinstance(quantizer, DelayedScalingQuantizer):
            raise ValueError(
                f"track_forward: expected a Quantizer, got {type(quantizer).__name__}"
            )
        self._entry().forward.register(quantizer)

    @property
    def backward_tracker(self) -> BackwardAmaxTracker:
        """Tracker for this step's grad quantizers; save it in the autograd ctx."""
        return self._entry().backward

    def __repr__(self) -> str:
        return (
            f"AutocastContext(enabled={self.enabled}, recipe={self.recipe!r}, "
            f"amax_reduction_group={self.amax_reduction_group!r})"
        )


_ACTIVE: contextvars.ContextVar[Optional[AutocastContext]] = contextvars.ContextVar(
    "tp_fuse_autocast", default=None
)
_MODEL_INIT: contextvars.ContextVar[Optional[Recipe]] = contextvars.ContextVar(
    "tp_fuse_quantized_model_init", default=None
)


def _check_args(fn: str, enabled: object, recipe: object) -> None:
    if not isinstance(enabled, bool):
        raise ValueError(f"{fn}: enabled: expected a bool, got {enabled!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(
            f"{fn}: recipe: expected a tp_fuse.recipe.Recipe or None, got {type(recipe).__name__}"
        )
    if isinstance(recipe, CustomRecipe):
        # The ops choose GEMM and cast kernels by recipe type and assume one format per
        # GEMM; a factory's per-role quantizers could mix formats they cannot run.
        raise ValueError(
            f"{fn}: recipe: CustomRecipe (per-role quantizers from qfactory) is not supported by "
            "tp_fuse's ops; expected a built-in recipe (DelayedScaling, Float8CurrentScaling, "
            "Float8BlockScaling, MXFP8BlockScaling, Float8RowwiseScaling, NVFP4BlockScaling)"
        )
    if isinstance(recipe, Recipe):
        # TE options a recipe accepts (TE code sets them) but the ops do not implement.
        unsupported = unsupported_recipe_options(recipe)
        if unsupported:
            raise ValueError(f"{fn}: recipe: not supported by tp_fuse's ops: {'; '.join(unsupported)}")


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    recipe: Optional[Recipe] = None,
    amax_reduction_group: Optional[dist.ProcessGroup] = None,
    gemms: Optional[str | GemmChoice] = None,
    weight_cache: Optional[FP8WeightCache] = None,
) -> Iterator[AutocastContext]:
    """Run ops inside with FP8 compute under ``recipe`` (default ``DelayedScaling()``).

    Yields the :class:`AutocastContext`. ``enabled=False`` turns FP8 off inside
    (``active_autocast()`` is None there). At exit of the outermost autocast the
    forward amaxes are reduced over ``amax_reduction_group`` and scales updated.

    ``gemms`` (not a Transformer Engine argument): ``"all"`` (the default outermost) runs
    every Linear's GEMMs in FP8; ``"auto"`` only those where FP8 is faster at their
    shape (measured once per shape on CUDA, torchao's rule as the prior; see
    :mod:`tp_fuse.quantization.gemm_choice`); a ``GemmChoice`` decides with its own
    clock and cache; None inherits the enclosing autocast's.

    ``weight_cache`` (Transformer Engine's weight caching, as an object): an
    :class:`~tp_fuse.quantization.weight_cache.FP8WeightCache` that keeps each weight's
    FP8 cast for the later micro-batches of an optimizer step (call its ``clear()`` after
    ``optimizer.step()``); None inherits the enclosing autocast's.
    """
    _check_args("autocast", enabled, recipe)
    check_weight_cache("autocast", weight_cache)
    if amax_reduction_group is not None and not isinstance(amax_reduction_group, dist.ProcessGroup):
        raise ValueError(
            "autocast: amax_reduction_group: expected a torch.distributed.ProcessGroup or "
            f"None, got {type(amax_reduction_group).__name__}"
        )
    outer = _ACTIVE.get()
    state = outer._state if outer is not None else _StepState()
    choice = resolve_gemms("autocast", gemms, outer.gemm_choice if outer is not None else None)
    if weight_cache is None and outer is not None:
        weight_cache = outer.weight_cache
    ctx = AutocastContext(
        enabled, recipe if recipe is not None else DelayedScaling(), amax_reduction_group, state, choice,
        weight_cache,
    )
    token = _ACTIVE.set(ctx)
    # torch.compile cannot read the ContextVar: it reads this mirror (compile_state).
    prev_view = set_traced_key(compile_key(ctx), amax_reduction_group)
    prev_auto = set_traced_gemms_auto(enabled and choice is not None)
    completed = False
    try:
        yield ctx
        completed = True
    finally:
        _ACTIVE.reset(token)
        set_traced_key(*prev_view)
        set_traced_gemms_auto(prev_auto)
        if outer is None and completed:
            state.finish_forward()


def active_autocast() -> Optional[AutocastContext]:
    """The innermost enabled autocast context, or None when FP8 is off."""
    ctx = _ACTIVE.get()
    return ctx if ctx is not None and ctx.enabled else None


def current_autocast() -> Optional[AutocastContext]:
    """The innermost autocast context, enabled or not (None outside any autocast).

    For activation recompute (``tp_fuse.checkpoint``): what the first forward ran under,
    to be re-entered by :func:`reenter_autocast` when the backward pass recomputes it.
    """
    return _ACTIVE.get()


@contextlib.contextmanager
def reenter_autocast(ctx: Optional[AutocastContext]) -> Iterator[None]:
    """Make ``ctx`` (from :func:`current_autocast`) the active context again.

    Joins the step state of the autocast ``ctx`` belonged to (same backward amax
    tracker) and, unlike ``autocast``, reduces nothing at exit: the forward amaxes of
    that step were reduced once already. ``None`` runs the block with FP8 off.
    """
    token = _ACTIVE.set(ctx)
    prev_view = set_traced_key(compile_key(ctx), None if ctx is None else ctx.amax_reduction_group)
    prev_auto = set_traced_gemms_auto(ctx is not None and ctx.enabled and ctx.gemm_choice is not None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        set_traced_key(*prev_view)
        set_traced_gemms_auto(prev_auto)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None) -> Iterator[None]:
    """Ops created inside keep their weights in FP8 (with a high-precision master).

    Ops read :func:`model_init_recipe` when they create parameters and build them
    with :func:`~tp_fuse.quantization.make_fp8_parameter`. ``recipe`` defaults to
    ``DelayedScaling()``; ``enabled=False`` turns it off inside.
    """
    _check_args("quantized_model_init", enabled, recipe)
    value = (recipe if recipe is not None else DelayedScaling()) if enabled else None
    token = _MODEL_INIT.set(value)
    try:
        yield
    finally:
        _MODEL_INIT.reset(token)


def model_init_recipe() -> Optional[Recipe]:
    """Recipe of the enclosing ``quantized_model_init``, or None outside it."""
    return _MODEL_INIT.get()
