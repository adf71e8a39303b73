"""Gradient reduction across data-parallel ranks, and the global gradient norm.

Sequence-parallel parameters need no work here: ``layers`` all-reduces their
gradient contributions over the TP group inside the backward pass
(``tp_fuse.layers.grad_sync``). What remains after ``loss.backward()``:

* data parallelism -- every DP replica holds the same shards; gradients are averaged
  with one coalesced all-reduce per dtype over the DP group;
* the norm for clipping -- a TP-sharded parameter's squared norm is the sum of its
  shards' (all-reduced over the TP group), a replicated parameter (identical on every
  TP rank) counts once. A parameter used twice (tied embedding) is one Parameter and
  counts once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from tp_fuse.comm.nccl_rules import check_collective
from tp_fuse.layers import get_shard_spec

__all__ = ["allreduce_dp_grads", "clip_grads", "global_grad_norm"]


def _grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def allreduce_dp_grads(params: list[torch.nn.Parameter], dp_group: dist.ProcessGroup, dp_size: int) -> None:
    """Average gradients over the DP group: one all-reduce per dtype (bucketed)."""
    if dp_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in _grads(params):
        by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        check_collective("all_reduce", [flat], world_size=dp_size)
        dist.all_reduce(flat, group=dp_group)
        flat.div_(dp_size)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


@torch.no_grad()
def global_grad_norm(
    model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup], tp_size: int,
    dp_shard_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """L2 norm of the full (unsharded) gradient, identical on every rank (0-d fp64).

    ``dp_shard_group``: with FSDP2 every parameter's gradient is a DTensor whose local
    shards over this group are disjoint: their squared norms are summed over it too.
    """
    device = next(model.parameters()).device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for _, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        sq = g.detach().to(torch.float64).square().sum()
        if get_shard_spec(p) is not None:
            sharded += sq
        else:
            replicated += sq
    if dp_shard_group is not None:
        both = torch.stack([sharded, replicated])
        dist.all_reduce(both, group=dp_shard_group)
        sharded, replicated = both.unbind(0)
    if tp_size > 1:
        check_collective("all_reduce", [sharded], world_size=tp_size)
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()


@torch.no_grad()
def clip_grads(params: list[torch.nn.Parameter], total_norm: torch.Tensor, max_norm: float,
               norm_value: Optional[float] = None) -> float:
    """Scale gradients so that their global norm is at most ``max_norm`` (0: off).

    ``norm_value``: ``float(total_norm)`` when the caller has already read it (the
    launcher's non-finite guard reads it with the step's other values in one transfer);
    without it, ``total_norm`` is read here (one host sync).

    Returns the coefficient applied (1.0 when no clipping happened).
    """
    norm = float(total_norm) if norm_value is None else norm_value
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    for g in _grads(params):
        g.mul_(coef)
    return coef
