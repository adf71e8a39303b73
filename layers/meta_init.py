"""Meta-device initialization: build a model on ``meta``, materialize only local shards.

A model built with ``device="meta"`` allocates nothing and draws no random numbers; each
seeded parameter carries ``tp_init`` (``tp_fuse.layers.sharding.set_deferred_init``), a callable
giving this TP rank's fp32 shard with exactly the values eager construction gives.
:func:`materialize` then allocates the local storage on the real device and fills it:

* TP shards come from ``tp_init``: the full (TP=1) tensor of ONE parameter is drawn on
  the CPU, sliced, copied, and dropped before the next one, so the peak is the local
  shards plus one full parameter, never the replicated model;
* parameters that FSDP2 (``fully_shard``) turned into DTensors over the data-parallel
  mesh keep only their DP slice (``compute_local_shape_and_global_offset`` of the
  DTensor layout: Shard(0) chunks, HSDP's replicate dimension included);
* constant-initialized parameters (norm gains, biases) come from their op's
  ``reset_parameters()``, derived buffers (RoPE frequencies) from ``reset_buffers()``,
  and dropout streams restart from their seeds on the real device;
* tied parameters stay one Parameter, with their attributes (``tp_shard``...) and the
  sequence-parallel gradient hook of ``tp_fuse.layers.grad_sync``.

Typical use (``launch`` does this for every run)::

    model = GPT(config, tp_group=tp, device="meta", seed=1234)
    inits = deferred_inits(model)          # before fully_shard replaces the Parameters
    fully_shard_gpt(model, dp_mesh)        # optional (tp_fuse.layers.fsdp)
    materialize(model, "cuda", inits)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .grad_sync import sync_sequence_parallel_grad
from .random import DropoutRNG

__all__ = ["deferred_inits", "materialize"]

InitFn = Callable[[], torch.Tensor]


def deferred_inits(model: torch.nn.Module) -> dict[str, Optional[InitFn]]:
    """``{parameter name: tp_init or None}`` (None: set by its op's ``reset_parameters``).

    Take it before ``fully_shard``, which replaces the Parameter objects (and their
    attributes) by DTensors. ValueError if a parameter has neither.
    """
    inits: dict[str, Optional[InitFn]] = {}
    resettable = {id(p) for m in model.modules() if hasattr(m, "reset_parameters")
                  for p in m.parameters(recurse=False)}
    missing = []
    for name, p in model.named_parameters():
        fn = getattr(p, "tp_init", None)
        if fn is None and id(p) not in resettable:
            missing.append(name)
        inits[name] = fn
    if missing:
        raise ValueError(f"materialize: parameters {missing} have no deferred initialization (not built by a "
                         "tp-fuse layer on device='meta') and no reset_parameters()")
    return inits


def _local_slice(local_tp: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the TP-local tensor: all of it, or its DTensor (DP) slice."""
    if not isinstance(param, DTensor):
        return local_tp
    shape, offset = compute_local_shape_and_global_offset(local_tp.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return local_tp[index]


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device | str,
                inits: Optional[dict[str, Optional[InitFn]]] = None) -> torch.nn.Module:
    """Allocate ``model``'s meta parameters on ``device`` and initialize them (in place).

    ``inits`` from :func:`deferred_inits` (taken before ``fully_shard``); default: taken
    now. Returns ``model``.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize: device must be a real device, not meta")
    if inits is None:
        inits = deferred_inits(model)
    names = {name for name, _ in model.named_parameters()}
    if set(inits) != names:
        raise ValueError(f"materialize: inits do not match the model's parameters "
                         f"(missing {sorted(names - set(inits))}, unexpected {sorted(set(inits) - names)})")
    # to_empty makes a new Parameter per module: tied parameters (GPT's tied embedding)
    # would come apart. Remember where each one sits and tie them again after.
    # The new Parameters also lack the old ones' attributes (tp_shard...) and tensor hooks.
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    attrs: dict[int, dict] = {}
    for m in model.modules():
        for attr, p in m.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((m, attr))
            attrs[id(p)] = dict(vars(p))
    model.to_empty(device=device)
    for key, group in places.items():
        first = getattr(group[0][0], group[0][1])
        for m, attr in group[1:]:
            setattr(m, attr, first)
        saved = attrs[key]
        sp_group = saved.pop("_sequence_parallel_grad_group", None)
        for name, value in saved.items():
            setattr(first, name, value)
        if sp_group is not None and not isinstance(first, DTensor):
            sync_sequence_parallel_grad(first, sp_group)  # the hook went with the old Parameter
        elif sp_group is not None:
            # FSDP2 owns the gradient path: tp_fuse.layers.fsdp.reduce_sequence_parallel_grads does the sync.
            first._sequence_parallel_grad_group = sp_group
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    for name, p in model.named_parameters():
        fn = inits[name]
        if fn is None:
            continue
        local = _local_slice(fn(), p)
        target = p.to_local() if isinstance(p, DTensor) else p
        if tuple(local.shape) != tuple(target.shape):
            raise ValueError(f"materialize: {name}: initializer gives {tuple(local.shape)}, "
                             f"the parameter's local shard is {tuple(target.shape)}")
        target.copy_(local)
    rngs = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, DropoutRNG)}
    for rng in rngs.values():
        rng.reset(device)
    return model
