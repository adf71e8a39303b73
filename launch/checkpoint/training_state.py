"""What a checkpoint captures, and how it maps onto DCP's state dict and back.

``model/<param>`` and ``optim/<param>/{exp_avg,exp_avg_sq,step}`` hold TP-sharded tensors
as DTensors in their full (TP=1) layout, so a checkpoint loads at any TP size (a tensor of
unequal fused parts, ``tp_fuse.layers.ShardSpec.sizes``, part by part under
``<key>/part<i>``); ``rank<r>/fp8/...`` holds delayed-scaling state, ``rank<r>/rng/...`` the
torch and dropout RNG states, ``train/{step,consumed_samples}`` the position in the data.
Saving, loading and the directory itself are :mod:`tp_fuse.launch.checkpoint.manager`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from tp_fuse.layers import get_shard_spec
from tp_fuse.layers.fsdp import copy_dp_shard_, dp_shard_like, dp_unsharded, dp_unsharded_empty
from tp_fuse.quantization import DelayedScalingQuantizer
from tp_fuse.recipe import Recipe

from ..data import BatchLoader
from ..models.build import dropout_seed, fp8_quantizers
from ..runtime import Runtime

__all__ = ["QUANTIZER_FIELDS", "TrainingState", "apply_state_dict", "build_state_dict", "reseed_rng"]

#: The delayed-scaling quantizer state a checkpoint carries (current scaling has none).
QUANTIZER_FIELDS = ("scale", "amax_history", "last_amax", "nonfinite_amax_count")


@dataclasses.dataclass
class TrainingState:
    """What a checkpoint captures (references to the live objects, plus the step)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: BatchLoader
    recipe: Optional[Recipe]
    fp8_group: Optional[dist.ProcessGroup]
    seed: int
    model_config: dict[str, Any]
    step: int = 0
    last_loss: Optional[float] = None  # training loss of ``step`` (recorded in the manifest)


def _global_view(local: torch.Tensor, spec: Any, rt: Runtime) -> torch.Tensor:
    """A TP shard as a DTensor of the full tensor (replicated tensors as they are).

    The sharded dim of size ``extent`` is viewed as ``(blocks, extent / blocks)`` so that
    every block is split evenly over the TP ranks (``tp_fuse.layers.ShardSpec``): the stored
    global shape is the same at every TP size.
    """
    if spec is None:
        return local
    d, b = spec.dim, spec.blocks
    shape = list(local.shape)
    view = local.reshape(shape[:d] + [b, shape[d] // b] + shape[d + 1 :])
    return DTensor.from_local(view, rt.topology.mesh, [Replicate(), Shard(d + 1)], run_check=False)


def _global_views(key: str, local: torch.Tensor, spec: Any, rt: Runtime) -> dict[str, torch.Tensor]:
    """``{checkpoint key: global view}`` of one TP shard.

    A tensor of unequal parts (``ShardSpec.sizes``, e.g. a fused GQA ``[q; k; v]``
    projection: the shard is ``[q_r; k_r; v_r]``) cannot be one DTensor whose global
    shape is the same at every TP size; each part is stored as its own DTensor under
    ``<key>/part<i>`` (global extent: the part's full size), so it reshards like any
    other tensor. Everything else is one entry under ``key`` (:func:`_global_view`).
    """
    if spec is None or getattr(spec, "sizes", None) is None:
        return {key: _global_view(local, spec, rt)}
    tp = rt.topology.tp_size
    pieces = local.split([s // tp for s in spec.sizes], dim=spec.dim)
    return {f"{key}/part{i}": DTensor.from_local(piece.contiguous(), rt.topology.mesh, [Replicate(), Shard(spec.dim)],
                                                 run_check=False)
            for i, piece in enumerate(pieces)}


def _local_shard(sd: dict[str, Any], key: str, spec: Any, shape: torch.Size) -> torch.Tensor:
    """This rank's shard of ``key`` from a loaded state dict (inverse of :func:`_global_views`)."""
    def local(t: Any) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    if spec is None or getattr(spec, "sizes", None) is None:
        return local(sd[key]).reshape(shape)
    return torch.cat([local(sd[f"{key}/part{i}"]) for i in range(len(spec.sizes))], dim=spec.dim).reshape(shape)


def _fp8_quantizers(state: TrainingState) -> dict[str, dict[str, DelayedScalingQuantizer]]:
    """Delayed-scaling quantizers of every BasicLinear, by module path and role (their
    state is what a checkpoint carries; current scaling has none)."""
    out: dict[str, dict[str, DelayedScalingQuantizer]] = {}
    for qualname, qs in fp8_quantizers(state.model, state.recipe, state.fp8_group).items():
        delayed = {role: q for role, q in qs.items() if isinstance(q, DelayedScalingQuantizer)}
        if delayed:
            out[qualname] = delayed
    return out


def build_state_dict(state: TrainingState, rt: Runtime, *, fp8_rank: int, with_rng: bool,
                     for_load: bool) -> dict[str, Any]:
    """``state`` as DCP's state dict: TP shards as global views (:func:`_global_views`), FP8
    delayed-scaling state under ``rank<fp8_rank>/``, RNG states under ``rank<r>/`` when
    ``with_rng``. ``for_load``: empty tensors of the right shapes for ``dcp.load`` to fill."""
    sd: dict[str, Any] = {}
    optimized = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    for name, p in state.model.named_parameters():
        spec = get_shard_spec(p)
        # FSDP2 parameters (DTensors over DP) are stored as their whole TP shard.
        local = dp_unsharded_empty(p) if for_load else dp_unsharded(p.detach())
        sd.update(_global_views(f"model/{name}", local, spec, rt))
        if id(p) not in optimized:
            continue  # frozen parameter: no optimizer state
        # A parameter that never had a gradient has no AdamW state yet: zeros and
        # step 0 are exactly what AdamW would start from.
        opt_state = state.optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            t = opt_state.get(key) if not for_load else None
            t = dp_unsharded(t) if t is not None else torch.zeros_like(dp_unsharded_empty(p))
            sd.update(_global_views(f"optim/{name}/{key}", t, spec, rt))
        step = opt_state.get("step") if not for_load else None
        sd[f"optim/{name}/step"] = step.detach().cpu() if step is not None else torch.zeros((), dtype=torch.float32)
    sd["train/step"] = torch.tensor(state.step, dtype=torch.int64)
    sd["train/consumed_samples"] = torch.tensor(state.loader.consumed_samples, dtype=torch.int64)
    for qualname, qs in _fp8_quantizers(state).items():
        for role, q in qs.items():
            for field in QUANTIZER_FIELDS:
                t = getattr(q, field)
                sd[f"rank{fp8_rank}/fp8/{qualname}/{role}/{field}"] = torch.empty_like(t) if for_load else t.detach()
    if with_rng:
        for key, t in _rng_state(state, rt).items():
            sd[f"rank{rt.rank}/rng/{key}"] = torch.empty_like(t) if for_load else t
    return sd


def _rng_state(state: TrainingState, rt: Runtime) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if rt.device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(rt.device)
    rng = getattr(state.model, "dropout_rng", None)
    if rng is not None:
        out.update({f"dropout/{k}": v for k, v in rng.state_dict().items()})
    return out


@torch.no_grad()
def apply_state_dict(sd: dict[str, Any], state: TrainingState, rt: Runtime, same_layout: bool) -> None:
    """Copy a loaded state dict into the live model, optimizer, FP8 quantizers and (same layout
    only) RNG streams; FP8 state of rank 0 everywhere after a layout change."""
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    index = {id(p): i for i, p in enumerate(p for g in state.optimizer.param_groups for p in g["params"])}
    for name, p in state.model.named_parameters():
        spec, shape = get_shard_spec(p), p.shape
        copy_dp_shard_(p, _local_shard(sd, f"model/{name}", spec, shape))
        if id(p) in index:
            opt_state[index[id(p)]] = {
                "step": sd[f"optim/{name}/step"].clone(),
                "exp_avg": dp_shard_like(_local_shard(sd, f"optim/{name}/exp_avg", spec, shape).clone(), p),
                "exp_avg_sq": dp_shard_like(_local_shard(sd, f"optim/{name}/exp_avg_sq", spec, shape).clone(), p),
            }
    opt_sd = state.optimizer.state_dict()
    opt_sd["state"] = opt_state
    state.optimizer.load_state_dict(opt_sd)

    rank = rt.rank if same_layout else 0
    for qualname, qs in _fp8_quantizers(state).items():
        for role, q in qs.items():
            for field in QUANTIZER_FIELDS:
                getattr(q, field).copy_(sd[f"rank{rank}/fp8/{qualname}/{role}/{field}"])
    if same_layout:
        prefix = f"rank{rt.rank}/rng/"
        rng = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng:
            torch.cuda.set_rng_state(rng["torch_cuda"], rt.device)
        dropout = getattr(state.model, "dropout_rng", None)
        if dropout is not None:
            dropout.load_state_dict({k[len("dropout/"):]: v for k, v in rng.items() if k.startswith("dropout/")})


def reseed_rng(state: TrainingState, rt: Runtime) -> None:
    """After a layout change per-rank RNG streams cannot be mapped: start fresh ones."""
    seed = state.seed + 1_000_003 * state.step
    torch.manual_seed(seed + rt.rank)
    dropout = getattr(state.model, "dropout_rng", None)
    if dropout is not None:
        fresh = type(dropout)(dropout_seed(seed, rt.topology.dp_rank), rt.topology.tp_rank,
                              dropout.device)
        dropout.load_state_dict(fresh.state_dict())
