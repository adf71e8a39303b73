"""Gradient sync for replicated parameters used on sequence-parallel shards.

With sequence parallelism a norm (or a row-parallel bias, or a learned position
embedding) is replicated on every TP rank but only sees this rank's ``s/tp`` rows, so
its gradient on one rank is a partial sum: the true gradient is the sum over the TP
group. Megatron-LM leaves this to ``finalize_model_grads`` (an explicit call after the
backward pass that all-reduces every parameter tagged ``sequence_parallel``). Here the
layers do it themselves, so a model is correct with a plain ``loss.backward()``:

* a tensor hook on the parameter all-reduces each gradient contribution over the TP
  group *before* autograd accumulates it into ``.grad`` -- so gradient accumulation over
  micro-batches stays correct, and data-parallel hooks that fire on accumulation (DDP)
  see the complete gradient.

The collective is issued from inside the backward pass in autograd's (deterministic)
order, the same on every TP rank. Parameters tagged here carry
``param.sequence_parallel_grad_synced = True`` (and NOT Megatron's ``sequence_parallel``
attribute, which would make Megatron's ``finalize_model_grads`` reduce them a second time).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .sharding import tp_rank_and_size
from tp_fuse.comm import all_reduce

__all__ = ["sync_sequence_parallel_grad", "sync_sharded_activation_grad", "is_sequence_parallel_grad_synced"]


def _make_hook(group: dist.ProcessGroup):
    def hook(grad: torch.Tensor) -> torch.Tensor:

        # Not in place (comm's default copies): the incoming grad may be shared with
        # other autograd branches.
        return all_reduce(grad, group)

    return hook


def sync_sequence_parallel_grad(param: torch.nn.Parameter, tp_group: Optional[dist.ProcessGroup]) -> None:
    """Make ``param``'s gradient the sum over ``tp_group`` of its per-rank contributions.

    A no-op without TP (``tp_group`` None or of size 1). Idempotent per parameter; a
    parameter already synced over a different group is an error.
    """
    _, size = tp_rank_and_size(tp_group)
    if size == 1:
        return
    previous = getattr(param, "_sequence_parallel_grad_group", None)
    if previous is not None:
        if previous is not tp_group:
            raise ValueError("parameter is already sequence-parallel-synced over a different process group")
        return
    param.register_hook(_make_hook(tp_group))
    param._sequence_parallel_grad_group = tp_group  # type: ignore[attr-defined]
    param.sequence_parallel_grad_synced = True  # type: ignore[attr-defined]


def sync_sharded_activation_grad(param: torch.nn.Parameter, tp_group: Optional[dist.ProcessGroup]) -> None:
    """The same sum over ``tp_group`` for a replicated parameter used on TP-*sharded*
    activations (``wrap()`` finds them: ``tp_fuse.layers.wrap.trace``), e.g. Qwen3's ``q_norm``
    applied to this rank's heads only: each rank's gradient covers its heads, the sum
    covers all of them.

    The gradient is a partial sum over TP exactly as for a sequence-parallel norm, so the
    parameter is tagged the same way (``sequence_parallel_grad_synced``: FSDP2's
    after-backward reduction, ``tp_fuse.layers.fsdp.sequence_parallel_params``, picks it up too)
    and additionally ``sharded_activation_grad_synced = True``.
    """
    sync_sequence_parallel_grad(param, tp_group)
    if tp_rank_and_size(tp_group)[1] > 1:
        param.sharded_activation_grad_synced = True  # type: ignore[attr-defined]


def is_sequence_parallel_grad_synced(param: torch.Tensor) -> bool:
    """Whether :func:`sync_sequence_parallel_grad` was applied to ``param``."""
    return bool(getattr(param, "sequence_parallel_grad_synced", False))
