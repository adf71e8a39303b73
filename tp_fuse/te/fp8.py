"""Transformer Engine's ``transformer_engine.pytorch.fp8`` (its pre-2.x FP8 module, still what
Megatron-Core imports): ``fp8_autocast``, ``fp8_model_init`` and the subset of
``FP8GlobalStateManager`` Megatron calls, over :func:`tp_fuse.autocast`.

TE keeps FP8 state in a process-wide global (``FP8GlobalStateManager``); tp_fuse keeps it in
``autocast``'s context (a ``contextvars.ContextVar``: per thread / task, restored on exit).
This module is a compatibility entry point that **reads the active autocast state**: every
``FP8GlobalStateManager`` query answers for the innermost ``tp_fuse.autocast`` /
``fp8_autocast`` around the caller, and ``fp8_autocast`` enters one. Nothing here is a second
store of FP8 state.

What TE's manager does for CUDA graphs (collecting ``fp8_meta`` into global amax buffers,
updating them on request, skipping weight casts via a device flag) has no counterpart:
tp_fuse's delayed-scaling quantizers join the step's amax reduction when they run, and the
outermost autocast reduces and updates at exit. Those methods raise ``NotImplementedError``
naming themselves, never silently do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch.distributed as dist

from tp_fuse.availability import (
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from tp_fuse.quantization.autocast import active_autocast, autocast, model_init_recipe, quantized_model_init
from tp_fuse.recipe import DelayedScaling, Recipe

__all__ = ["FP8GlobalStateManager", "fp8_autocast", "fp8_model_init", "get_align_size_for_quantization",
           "get_default_fp8_recipe"]

_NO_GRAPH_STATE = ("tp_fuse keeps FP8 state in autocast's context, not in TE's global buffers "
                   "(used by TE's CUDA-graph integration, not supported here)")


def get_default_fp8_recipe() -> Recipe:
    """TE's default recipe: ``DelayedScaling()``."""
    return DelayedScaling()


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """TE's ``quantization.get_align_size_for_quantization``: the multiple of rows a grouped
    quantized GEMM's splits are padded to (what ``Fp8Padding`` / MoE routers size with), TE's
    values: a custom recipe's ``quantization_alignment``, 32 for MXFP8 (its scaling block), 128
    for NVFP4, 16 for the other FP8 recipes (the FP8 GEMM's dimension multiple)."""
    if not isinstance(recipe, Recipe):
        raise ValueError(f"get_align_size_for_quantization: expected a tp_fuse.recipe recipe, got {recipe!r}")
    if recipe.custom():
        return recipe.quantization_alignment
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group: Optional[dist.ProcessGroup] = None, _graph: bool = False) -> Iterator[None]:
    """TE's ``fp8_autocast``: :func:`tp_fuse.autocast` under TE's keyword names
    (``fp8_recipe`` -> ``recipe``, ``fp8_group`` -> ``amax_reduction_group``).

    ``calibrating=True`` (TE: collect amaxes while computing in high precision) and ``_graph``
    are refused (ValueError). Yields None, as TE's does.
    """
    if calibrating is not False:
        raise ValueError(f"fp8_autocast: calibrating={calibrating!r} is not supported by tp_fuse (False)")
    if _graph is not False:
        raise ValueError(f"fp8_autocast: _graph={_graph!r} is not supported by tp_fuse (False)")
    with autocast(enabled=enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group):
        yield


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False) -> contextlib.AbstractContextManager:
    """TE's ``fp8_model_init``: :func:`tp_fuse.quantized_model_init`. tp_fuse's FP8 parameters
    always keep their high-precision master, so ``preserve_high_precision_init_val`` is satisfied
    either way."""
    if not isinstance(preserve_high_precision_init_val, bool):
        raise ValueError("fp8_model_init: preserve_high_precision_init_val must be a bool, "
                         f"got {preserve_high_precision_init_val!r}")
    return quantized_model_init(enabled=enabled, recipe=recipe)


class FP8GlobalStateManager:
    """TE's ``FP8GlobalStateManager``, answering from the active ``tp_fuse.autocast`` context
    (see the module docstring). Class methods only, as TE's."""

    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        return is_fp8_available(return_reason=True)

    @classmethod
    def is_mxfp8_available(cls) -> tuple[bool, str]:
        return is_mxfp8_available(return_reason=True)

    @classmethod
    def is_fp8_block_scaling_available(cls) -> tuple[bool, str]:
        return is_fp8_block_scaling_available(return_reason=True)

    @classmethod
    def is_nvfp4_available(cls) -> tuple[bool, str]:
        return is_nvfp4_available(return_reason=True)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """True inside an enabled ``autocast`` / ``fp8_autocast``."""
        return active_autocast() is not None

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """Always False: calibration mode is refused by :func:`fp8_autocast`."""
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return model_init_recipe() is not None

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The active autocast's recipe; outside one, TE's default ``DelayedScaling()``."""
        ctx = active_autocast()
        return ctx.recipe if ctx is not None else DelayedScaling()

    @classmethod
    def get_fp8_group(cls) -> Optional[dist.ProcessGroup]:
        """The active autocast's amax reduction group (None: no reduction, or outside autocast)."""
        ctx = active_autocast()
        return ctx.amax_reduction_group if ctx is not None else None

    @classmethod
    def reset(cls) -> None:
        """TE's reset of the process-wide FP8 state. Outside ``autocast`` / ``quantized_model_init``
        there is none here (the state lives in those contexts and ends with them), so this does
        nothing; inside one it raises ValueError (leave the context instead: resetting it from
        within would leave its exit to work on a state that no longer exists)."""
        if active_autocast() is not None or model_init_recipe() is not None:
            raise ValueError("FP8GlobalStateManager.reset: called inside autocast / quantized_model_init; tp_fuse "
                             "keeps the FP8 state in that context, which its exit ends (leave it instead)")

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        raise NotImplementedError(f"FP8GlobalStateManager.is_first_fp8_module: {_NO_GRAPH_STATE}")

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"FP8GlobalStateManager.add_fp8_tensors_to_global_buffer: {_NO_GRAPH_STATE}")

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        raise NotImplementedError(f"FP8GlobalStateManager.reduce_and_update_fp8_tensors: {_NO_GRAPH_STATE}")

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        raise NotImplementedError(f"FP8GlobalStateManager.set_skip_fp8_weight_update_tensor: {_NO_GRAPH_STATE}")
