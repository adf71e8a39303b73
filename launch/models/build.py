"""Model, FP8 recipe and overlap objects built from the typed config."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch

from tp_fuse.layers import GPT, GPTConfig
from tp_fuse.layers.fsdp import fully_shard_gpt
from tp_fuse.layers.meta_init import deferred_inits, materialize
from tp_fuse import FP8WeightCache, autocast
from tp_fuse.debug import name_linears
from tp_fuse.overlap.auto import OverlapAutoTuner
from tp_fuse.overlap.config import OverlapConfig, TPOverlap
from tp_fuse.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

from ..config import FP8Config, OverlapSettings, TrainConfig
from .hf import build_hf_model
from .megatron import build_megatron_gpt, require_cuda
from ..fsdp import ShardedDataParallel
from ..runtime import Runtime

__all__ = [
    "OVERLAP_CHOICE_FILE",
    "ModelFactory",
    "build_model",
    "build_overlap",
    "build_recipe",
    "dropout_seed",
    "fp8_autocast",
    "fp8_quantizers",
    "ignored_summary",
]

#: File in the run directory holding the measured ``overlap.method=auto`` choices.
OVERLAP_CHOICE_FILE = "overlap_choices.json"

#: ``factory(gpt_config, tp_group=..., sequence_parallel=..., dtype=..., device=..., seed=..., overlap=...,
#: dropout_seed=...)`` -- the signature of ``tp_fuse.layers.GPT``.
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
    if cfg.recipe == "blockwise":
        return Float8BlockScaling(fp8_format=fmt)
    if cfg.recipe == "mxfp8":
        return MXFP8BlockScaling(fp8_format=fmt)
    if cfg.recipe == "nvfp4":
        return NVFP4BlockScaling(disable_rht=cfg.disable_rht, disable_stochastic_rounding=cfg.disable_stochastic_rounding,
                                 disable_2d_quantization=cfg.disable_2d_quantization)
    if cfg.recipe == "rowwise":
        return Float8RowwiseScaling(fp8_format=fmt, power_2_scale=cfg.power_2_scale)
    return None


def build_overlap(cfg: OverlapSettings, run_dir: Optional[str] = None, is_rank0: bool = False,
                  report: Optional[Callable[[str], None]] = None) -> TPOverlap:
    """``overlap=on``: ``overlap.method`` (``auto`` or Megatron's defaults) for the GEMM
    stages the ``tp_comm_overlap_cfg`` YAML (if given) does not name; ``overlap=off``: an
    explicitly disabled config (the layers' default would be on).

    With ``auto`` and a ``run_dir``, choices are read from ``<run_dir>/overlap_choices.json``
    when it exists (all ranks; a malformed file is a ValueError naming it) and rank 0
    rewrites it after each new measurement and prints each decision.

    Settings of the YAML without effect on this build (GPU-only knobs such as ``num_sm``)
    are summarized in one short line passed to ``report`` (rank 0's printer; None: silent)
    instead of ``tp_fuse.overlap.OverlapConfig``'s full per-field warning on every rank.
    """
    if not cfg.enabled:
        return TPOverlap(OverlapConfig(enabled=False))
    auto = cfg.method == "auto"
    if cfg.config is not None:
        config = OverlapConfig.from_yaml(cfg.config, auto=auto, warn_ignored=False)
        line = ignored_summary(config, cfg.config)
        if line and report is not None:
            report(line)
    else:
        config = OverlapConfig(auto=auto)
    if not auto or run_dir is None:
        return TPOverlap(config)
    tuner = OverlapAutoTuner(
        choice_file=os.path.join(run_dir, OVERLAP_CHOICE_FILE),
        write_choices=is_rank0,
        log=(lambda line: print(f"[tp-fuse] {line}", file=sys.stderr, flush=True)) if is_rank0 else None,
    )
    return TPOverlap(config, tuner=tuner)


def ignored_summary(config: OverlapConfig, path: str) -> Optional[str]:
    """``overlap.config=<path>: N settings have no effect here (num_sm, cga_size, ...)``, or None."""
    ignored = config.ignored_fields()  # "<gemm>.<field>=<value> (why)"
    if not ignored:
        return None
    fields = sorted({item.split(".", 1)[1].split("=", 1)[0] for item in ignored})
    return (f"overlap.config={path}: {len(ignored)} setting(s) have no effect on this build "
            f"({', '.join(fields)}); OverlapConfig.ignored_fields() lists them")


def dropout_seed(seed: int, dp_rank: int) -> int:
    """Seed of the dropout streams of DP replica ``dp_rank``."""
    return seed + 1_000_003 * dp_rank


def build_model(cfg: TrainConfig, rt: Runtime, factory: Optional[ModelFactory] = None,
                report: Optional[Callable[[str], None]] = None,
                sharded_dp: Optional[ShardedDataParallel] = None) -> torch.nn.Module:
    """``tp_fuse.layers.GPT`` (or ``factory``) for this rank's TP shard; ``+model=hf`` and
    ``+model=megatron_gpt`` build and wrap a Hugging Face / megatron-core model instead.
    ``report``: see :func:`build_overlap`.

    ``tp_fuse.layers.GPT`` is built on the ``meta`` device and materialized shard by shard
    (``tp_fuse.layers.meta_init``: same values as an eager build; only the local TP -- and with
    ``sharded_dp``, FSDP2 -- shards are ever allocated). A custom ``factory`` builds
    eagerly on the run's device. Then activation recompute and ``torch.compile``
    (``trainer.activation_checkpointing``, ``trainer.compile``) are applied.
    """
    overlap = build_overlap(cfg.overlap, rt.run_dir, rt.is_rank0, report)
    deferred = factory is None or factory is GPT
    tp_group = rt.topology.tp_group if rt.layout.tp > 1 else None
    if factory is None and cfg.model.name == "hf":
        # Wrapped also at TP size 1 (a one-rank group) so that FP8 reaches the GEMMs.
        model = build_hf_model(cfg.model.path, tp_group=rt.topology.tp_group, dtype=rt.dtype, device=rt.device,
                               seed=cfg.trainer.seed, overlap=overlap, verify=cfg.model.verify,
                               plan=cfg.model.plan, progress_bar=rt.is_rank0)
        model.train()
        return model
    if factory is None and cfg.model.name == "megatron_gpt":
        if cfg.model.spec == "local":
            require_cuda()
        model = build_megatron_gpt(cfg.model.gpt, tp_group=tp_group, sequence_parallel=cfg.parallel.sequence_parallel,
                                   dtype=rt.dtype, device=rt.device, seed=cfg.trainer.seed,
                                   overlap=overlap, spec=cfg.model.spec)
        model.train()
        return model
    factory = factory or GPT
    model = factory(
        GPTConfig(**vars(cfg.model.gpt)),
        tp_group=tp_group,
        sequence_parallel=cfg.parallel.sequence_parallel,
        dtype=rt.dtype,
        device=torch.device("meta") if deferred else rt.device,
        seed=cfg.trainer.seed,
        overlap=overlap,
        # Data-parallel replicas draw different dropout masks (TP ranks of a replica share
        # theirs where activations are replicated: tp_fuse.layers.DropoutRNG).
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
            raise ValueError(f"trainer.activation_checkpointing / trainer.compile need a tp_fuse.layers.GPT-like model "
                             f"(set_activation_checkpointing and layers), got {type(model).__name__}")
        model.set_activation_checkpointing(mode)
    if cfg.trainer.compile:
        check_compile_mode(cfg.trainer.compile_mode, rt.device)
        compile_layers(model, full_recompute=mode == "full", mode=cfg.trainer.compile_mode)
    model.train()
    return model


#: torch.compile modes that record CUDA graphs on a GPU.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_mode(mode: str, device: torch.device) -> None:
    """Refuse the CUDA-graph modes on CUDA: they fail there, after the compile.

    On an H200 (torch 2.11) the default GPT with ``trainer.compile_mode=reduce-overhead``
    failed in its first backward with "accessing tensor output of CUDAGraphs that has been
    overwritten by a subsequent run" (the compiled layers share one graph, replayed per
    layer and micro-batch; marking each micro-batch with
    ``torch.compiler.cudagraph_mark_step_begin()`` did not help). Until that is fixed and
    verified on a GPU, the modes are refused there; on CPU inductor records no CUDA graph
    and they run. The likely cause (issue 36): with ``zero_grad(set_to_none=True)``,
    ``AccumulateGrad`` keeps the first micro-batch's weight gradients -- outputs of the
    graph -- as ``.grad``, and the next micro-batch's replay overwrites them. The trainer
    gives these modes the static gradient buffers of ``trainer.cuda_graphs``
    (``launch/cuda_graphs.py``: allocated once, zeroed in place), which rule that out;
    lifting this refusal awaits a GPU run that confirms it.
    """
    if device.type == "cuda" and mode in CUDA_GRAPH_MODES:
        raise ValueError(
            f"trainer.compile_mode={mode} records CUDA graphs, which fail with tp-fuse's compiled layers on CUDA "
            f"(first backward: 'accessing tensor output of CUDAGraphs that has been overwritten by a subsequent "
            f"run', measured on an H200); use trainer.compile_mode=default (compiled bf16: 1.4-1.5x the eager "
            f"tokens/s of the default GPT there) or max-autotune-no-cudagraphs, or trainer.cuda_graphs=true "
            f"(one CUDA graph per layer with static gradient buffers: docs/cuda-graphs.md)"
        )


def compile_layers(model: torch.nn.Module, *, full_recompute: bool = False, mode: str = "default") -> None:
    """``torch.compile`` every TransformerLayer in place, with torch.compile's ``mode``.

    ``mode="reduce-overhead"`` (``trainer.compile_mode``) records each compiled layer as a
    CUDA graph on a GPU, which cuts the per-kernel launch cost that makes small models
    host-bound; nothing inside the compiled layers syncs with the host
    (``tests/test_no_host_sync.py``). On CPU inductor ignores the CUDA-graph part.

    tp-fuse's fusion groups (``OperationFuser``) are traced into each layer's graph
    (``tp_fuse/ops/compiled``): fp32/bf16, FP8 delayed/current scaling through the custom
    ops ``tp_fuse::fp8_cast`` / ``tp_fuse::fp8_gemm``, the block-scaled recipes and NVFP4
    through ``tp_fuse::block_cast`` / ``tp_fuse::block_gemm``; without tensor parallelism
    the layers share one graph. Groups the traced path does not handle (debug features, FP8
    parameters...) run eagerly behind a graph break (docs/fsdp.md). ``tp_fuse.checkpoint`` is
    a graph break too, so under full recompute the layer body inside it is what gets
    compiled (the recompute then reruns the compiled code).

    Layers with tensor-parallel comm/GEMM windows compile one graph each (the window plan is
    decided per layer while tracing: ``tp_fuse/ops/compiled/overlap.py``). torch.compile
    keeps one cache per code object -- every layer's ``forward`` -- with
    ``torch._dynamo.config.recompile_limit`` entries (8): past it, dynamo would run the
    remaining layers eagerly (a warning, and the speed of eager). The limit is raised to
    fit the model's layers (twice: a last batch of another size may recompile each layer).
    """
    needed = 2 * len(model.layers) + 8
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed
    if torch._dynamo.config.accumulated_recompile_limit < needed:
        torch._dynamo.config.accumulated_recompile_limit = needed
    for layer in model.layers:
        if full_recompute:
            layer._forward = torch.compile(layer._forward, mode=mode)
        else:
            layer.compile(mode=mode)


def fp8_autocast(
    recipe: Optional[Recipe], group: Any, gemms: str = "all", weight_cache: Optional[FP8WeightCache] = None
) -> contextlib.AbstractContextManager:
    """``tp_fuse.autocast`` around a forward pass, or nothing when FP8 is off. ``gemms``:
    ``fp8.gemms`` (``all``: every GEMM FP8; ``auto``: only where faster at the shape);
    ``weight_cache``: the step's FP8 weights, cast by its first micro-batch."""
    if recipe is None:
        return contextlib.nullcontext()
    return autocast(recipe=recipe, amax_reduction_group=group, gemms=gemms, weight_cache=weight_cache)


def fp8_quantizers(model: torch.nn.Module, recipe: Optional[Recipe], group: Any) -> dict[str, dict[str, Any]]:
    """FP8 quantizers of every ``BasicLinear`` under ``recipe``: ``{module path: {role: quantizer}}``.

    Asking the ops inside an autocast creates missing quantizers (e.g. before the first
    step of a resumed run) with the recipe the training loop uses.
    """
    if recipe is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    # gemms="all": every Linear's quantizers, whatever fp8.gemms keeps in high precision
    # (those are created here, never registered for amax reduction or used).
    with autocast(recipe=recipe, amax_reduction_group=group, gemms="all"):
        for name in name_linears(model):
            qs = name.op.fp8_quantizers() or {}
            if qs:
                out[name.qualname] = dict(qs)
    return out
