"""Model, FP8 recipe and overlap objects built from the typed config."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import torch

from layers import GPT, GPTConfig
from layers.fsdp import fully_shard_gpt
from layers.meta_init import deferred_inits, materialize
from tp_fuse import autocast
from tp_fuse.overlap_config import OverlapConfig as TPOverlapConfig
from tp_fuse.overlap_config import TPOverlap
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe

from .config import FP8Config, OverlapConfig, TrainConfig
from .fsdp import ShardedDataParallel
from .runtime import Runtime

__all__ = ["ModelFactory", "build_model", "build_overlap", "build_recipe", "dropout_seed", "fp8_autocast"]

#: ``factory(gpt_config, tp_group=..., sequence_parallel=..., dtype=..., device=..., seed=..., overlap=...,
#: dropout_seed=...)`` -- the signature of ``layers.GPT``.
ModelFactory = Callable[..., torch.nn.Module]


def build_recipe(cfg: FP8Config) -> Optional[Recipe]:
    """The tp_fuse recipe for ``fp8=...`` (None for ``fp8=none``)."""
    fmt = Format[cfg.format]
    if cfg.recipe == "delayed":
        return DelayedScaling(
            margin=cfg.margin,
            fp8_format=fmt,
            amax_history_len=cfg.amax_history_len,
            amax_compute_algo=cfg.amax_compute_algo,
        )
    if cfg.recipe == "current":
        return Float8CurrentScaling(fp8_format=fmt, power_2_scale=cfg.power_2_scale)
    return None


def build_overlap(cfg: OverlapConfig) -> TPOverlap:
    """``overlap=on``: Megatron-default methods or the given ``tp_comm_overlap_cfg`` YAML;
    ``overlap=off``: an explicitly disabled config (the layers' default would be on)."""
    if not cfg.enabled:
        return TPOverlap(TPOverlapConfig(enabled=False))
    if cfg.config is not None:
        return TPOverlap(TPOverlapConfig.from_yaml(cfg.config))
    return TPOverlap(TPOverlapConfig())


def dropout_seed(seed: int, dp_rank: int) -> int:
    """Seed of the dropout streams of DP replica ``dp_rank``."""
    return seed + 1_000_003 * dp_rank


def build_model(cfg: TrainConfig, rt: Runtime, factory: Optional[ModelFactory] = None,
                sharded_dp: Optional[ShardedDataParallel] = None) -> torch.nn.Module:
    """``layers.GPT`` (or ``factory``) for this rank's TP shard.

    ``layers.GPT`` is built on the ``meta`` device and materialized shard by shard
    (``layers.meta_init``: same values as an eager build; only the local TP -- and with
    ``sharded_dp``, FSDP2 -- shards are ever allocated). A custom ``factory`` builds
    eagerly on the run's device. Then activation recompute and ``torch.compile``
    (``trainer.activation_checkpointing``, ``trainer.compile``) are applied.
    """
    deferred = factory is None or factory is GPT
    factory = factory or GPT
    tp_group = rt.topology.tp_group if rt.layout.tp > 1 else None
    model = factory(
        GPTConfig(**vars(cfg.model.gpt)),
        tp_group=tp_group,
        sequence_parallel=cfg.parallel.sequence_parallel,
        dtype=rt.dtype,
        device=torch.device("meta") if deferred else rt.device,
        seed=cfg.trainer.seed,
        overlap=build_overlap(cfg.overlap),
        # Data-parallel replicas draw different dropout masks (TP ranks of a replica share
        # theirs where activations are replicated: layers.DropoutRNG).
        dropout_seed=dropout_seed(cfg.trainer.seed, rt.topology.dp_rank),
    )
    inits = deferred_inits(model) if deferred else None  # before fully_shard swaps the Parameters
    if sharded_dp is not None:
        fully_shard_gpt(model, sharded_dp.mesh)
    if deferred:
        materialize(model, rt.device, inits)
    mode = cfg.trainer.activation_checkpointing
    if mode != "none" or cfg.trainer.compile:
        if not hasattr(model, "set_activation_checkpointing") or not hasattr(model, "layers"):
            raise ValueError(f"trainer.activation_checkpointing / trainer.compile need a layers.GPT-like model "
                             f"(set_activation_checkpointing and layers), got {type(model).__name__}")
        model.set_activation_checkpointing(mode)
    if cfg.trainer.compile:
        compile_layers(model, full_recompute=mode == "full")
    model.train()
    return model


def compile_layers(model: torch.nn.Module, *, full_recompute: bool = False) -> None:
    """``torch.compile`` every TransformerLayer in place.

    tp-fuse's fusion groups (``OperationFuser``) run eagerly inside the compiled layers --
    documented graph breaks (docs/fsdp.md); the glue between them (QKV split, RoPE,
    attention core, residual plumbing) is compiled. ``tp_fuse.checkpoint`` is a graph
    break too, so under full recompute the layer body inside it is what gets compiled
    (the recompute then reruns the compiled code).
    """
    for layer in model.layers:
        if full_recompute:
            layer._forward = torch.compile(layer._forward)
        else:
            layer.compile()


def fp8_autocast(recipe: Optional[Recipe], group: Any) -> contextlib.AbstractContextManager:
    """``tp_fuse.autocast`` around a forward pass, or nothing when FP8 is off."""
    if recipe is None:
        return contextlib.nullcontext()
    return autocast(recipe=recipe, amax_reduction_group=group)
