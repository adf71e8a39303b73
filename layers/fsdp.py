"""FSDP2 over the data-parallel mesh dimension, tp-fuse tensor parallelism on the TP one.

tp-fuse layers hold their TP shard as ordinary local tensors (``tp_shard`` says how it
maps onto the full tensor). PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``)
then shards those local tensors once more over the data-parallel ranks of a 2-D
``DeviceMesh`` -- the layout of torchtitan's 2-D parallelism, with tp-fuse ops in the TP
role. Nothing of the sharding engine is ours: :func:`fully_shard_gpt` only decides the
units (one per TransformerLayer, plus the root for embedding, final norm and output)
and keeps what tp-fuse needs across the swap FSDP2 makes of every Parameter:

* the layout attributes (``tp_shard``, Megatron's ``tensor_model_parallel`` /
  ``partition_dim``...), copied onto the new DTensor parameters, so that the gradient
  norm still counts TP shards once (``tp_fuse.layers.sharding.grad_norm``, ``tp_fuse.launch.grads``);
* sequence-parallel gradient sync. The TP all-reduce that ``tp_fuse.layers.grad_sync`` hooks on
  a replicated parameter's gradient cannot ride on FSDP2's unsharded parameter (a new
  tensor each unit owns), so those parameters are listed (``sequence_parallel_params``)
  and :func:`reduce_sequence_parallel_grads` all-reduces their *sharded* gradients over
  the TP group after the backward pass (Megatron's ``finalize_model_grads`` does the
  same). Summing over TP commutes with FSDP2's reduce-scatter over DP, and with
  gradient accumulation, so the result equals the replicated-DP gradient.

FSDP2 averages gradients over all data-parallel ranks (reduce-scatter over the shard
dimension, all-reduce over the replicate dimension with HSDP): the same mean as the
bucketed all-reduce of replicated data parallelism. FP8 compute is unaffected -- ops see
ordinary unsharded weights during forward and backward. FP8 *weights*
(``quantized_model_init``) are Float8Tensor parameters, which FSDP2 cannot all-gather
here: :func:`fully_shard_gpt` raises a ValueError naming them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from tp_fuse.quantization import is_fp8_parameter

from .grad_sync import is_sequence_parallel_grad_synced

__all__ = ["copy_dp_shard_", "dp_shard_like", "dp_unsharded", "dp_unsharded_empty", "fully_shard_gpt",
           "is_fsdp_sharded", "reduce_sequence_parallel_grads", "sequence_parallel_params"]

# Parameter attributes tp-fuse (and Megatron-style tooling) read; FSDP2's new Parameters lack them.
_LAYOUT_ATTRS = ("tp_shard", "tensor_model_parallel", "partition_dim", "partition_stride",
                 "sequence_parallel_grad_synced", "_sequence_parallel_grad_group")


def is_fsdp_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 DTensors."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"fully_shard_gpt: expected a model with a `layers` ModuleList (tp_fuse.layers.GPT), "
                         f"got {type(model).__name__}")
    return list(layers)


def fully_shard_gpt(
    model: torch.nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
) -> torch.nn.Module:
    """Apply ``fully_shard`` over ``dp_mesh`` to every TransformerLayer, then the root.

    ``dp_mesh``: 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) sub-mesh of the
    data-parallel ranks; its ranks must hold identical TP shards (same TP rank). Works on
    a model still on the ``meta`` device (materialize after, ``tp_fuse.layers.meta_init``).
    Returns ``model`` (sharded in place).
    """
    if not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard_gpt: dp_mesh must be a 1-D or 2-D DeviceMesh, got {dp_mesh!r}")
    fp8_weights = [n for n, p in model.named_parameters() if is_fp8_parameter(p)]
    if fp8_weights:
        raise ValueError(
            f"FSDP2 with FP8 weights (quantized_model_init) is not supported: {fp8_weights[:3]}... are Float8Tensor "
            "parameters, which FSDP2 cannot shard and all-gather; build the model without quantized_model_init "
            "(FP8 compute under tp_fuse.autocast works with FSDP2) or use replicated data parallelism"
        )
    saved = {name: {a: getattr(p, a) for a in _LAYOUT_ATTRS if hasattr(p, a)}
             for name, p in model.named_parameters()}
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in _units(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root keeps its parameters unsharded after forward: backward needs them first.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for name, p in model.named_parameters():
        for attr, value in saved[name].items():
            setattr(p, attr, value)
    return model


def sequence_parallel_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters whose gradient is a partial sum over the TP group (sequence parallelism)."""
    return [p for p in model.parameters() if is_sequence_parallel_grad_synced(p)]


@torch.no_grad()
def reduce_sequence_parallel_grads(params: list[torch.nn.Parameter], tp_group: Optional[dist.ProcessGroup]) -> None:
    """All-reduce (sum) the sharded gradients of ``params`` over ``tp_group``: one
    coalesced collective. Call after the backward pass(es), before clipping."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# ---- checkpoint helpers: FSDP2 DTensors <-> this rank's whole TP shard --------------
# DCP checkpoints store TP shards in their full (TP=1) layout (launch/checkpoint/manager.py). An
# FSDP2 parameter is first gathered over the DP ranks into its TP shard (one parameter
# at a time while the state dict is built), and on load its DP slice is cut back out,
# so checkpoints move freely between TP x FSDP and TP x DDP layouts.


def dp_unsharded(t: torch.Tensor) -> torch.Tensor:
    """This rank's whole TP shard of ``t`` (all-gathered over DP if ``t`` is a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def dp_unsharded_empty(p: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like :func:`dp_unsharded` ``(p)`` (no communication)."""
    if isinstance(p, DTensor):
        return torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
    return torch.empty_like(p.detach())


def _dp_slice(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def dp_shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (a TP shard) laid out like ``like``: its DP slice as a DTensor, or ``full``."""
    if not isinstance(like, DTensor):
        return full
    return DTensor.from_local(_dp_slice(full, like).clone(), like.device_mesh, like.placements,
                              shape=like.shape, stride=like.stride(), run_check=False)


@torch.no_grad()
def copy_dp_shard_(p: torch.Tensor, full: torch.Tensor) -> None:
    """``p.copy_(full)`` where ``p`` may be an FSDP2 DTensor (copies its DP slice)."""
    if isinstance(p, DTensor):
        p.to_local().copy_(_dp_slice(full, p))
    else:
        p.copy_(full)
