"""Getting a model back out of ``wrap()``: the original, unsharded ``state_dict``.

``tp_fuse.layers.full_state_dict`` gives every *parameter* gathered to its full size, by name, in
the layout the GEMMs use -- the inverse of ``load_full_state_dict`` (resharding,
checkpoints). What the original model's ``load_state_dict(..., strict=True)`` needs is
different in three ways, and :func:`original_state_dict` gives exactly that:

* every key of the model's own ``state_dict()``: tied parameters under each of their
  names (``lm_head.weight`` and ``model.embed_tokens.weight``, sharing one tensor), and
  persistent buffers;
* GPT-2 ``Conv1D`` weights in their ``[in, out]`` layout (the converted module computes
  with ``[out, in]``);
* sharded tensors gathered over the TP group (fused ``[q; k; v]`` parts reassembled,
  ``tp_fuse.layers.sharding.gather_tensor``).

:func:`save_pretrained` writes a Hugging Face directory from a wrapped model (rank 0
writes; every rank must call it): ``transformers`` loads it back as the original model.
For a launcher checkpoint, load it into the wrapped model first (the launcher's resume),
then call :func:`save_pretrained`.

Megatron-core models are sharded before ``wrap`` too: their original ``state_dict`` is the
per-rank one, ``model.state_dict()``; here their tensor-parallel parameters are gathered
to full size like the others.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..sharding import gather_tensor, tp_rank_and_size
from .modules import ParallelLinearAdapter

__all__ = ["original_state_dict", "save_pretrained"]


def original_state_dict(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    """The unsharded ``state_dict`` of the model before ``wrap`` (collective over
    ``tp_group``: call on every rank; every rank gets the full dict)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    transposed = {f"{n}.weight" for n, m in model.named_modules()
                  if isinstance(m, ParallelLinearAdapter) and m.transposed}
    gathered: dict[int, torch.Tensor] = {}  # by Parameter: tied names share one tensor
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        p = params.get(key)
        if p is None:  # a buffer or an _extra_state: replicated, as saved
            out[key] = value
            continue
        if id(p) not in gathered:
            full = gather_tensor(p, getattr(p, "tp_shard", None), tp_group)
            gathered[id(p)] = full.t().contiguous() if key in transposed else full
        out[key] = gathered[id(p)]
    return out


def save_pretrained(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup], path: str,
                    **kwargs: Any) -> None:
    """Write ``path`` as a Hugging Face model directory (``config.json`` + safetensors) of
    the original, unsharded model: ``transformers.AutoModelForCausalLM.from_pretrained``
    loads it. Collective over ``tp_group``; TP rank 0 writes. ``kwargs`` go to the model's
    ``save_pretrained`` (not ``state_dict``)."""
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ValueError(f"save_pretrained: expected a Hugging Face model (with save_pretrained and config), "
                         f"got {type(model).__name__}; use tp_fuse.layers.wrap.export.original_state_dict")
    if "state_dict" in kwargs:
        raise ValueError("save_pretrained: the state_dict is the model's own (gathered); do not pass one")
    state = original_state_dict(model, tp_group)
    rank, _ = tp_rank_and_size(tp_group)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        # The wrapped modules hold this rank's shards: save the gathered tensors instead.
        model.save_pretrained(path, state_dict={k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
                              **kwargs)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.barrier(group=tp_group)
