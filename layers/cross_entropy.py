"""Cross-entropy over vocab-parallel logits, without gathering the full logits."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

from .sharding import tp_rank_and_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (Megatron-LM's algorithm).

    ======== ============================================ ===============================
             forward                                      backward
    ======== ============================================ ===============================
    shapes   logits ``[..., V/tp]``, labels ``[...]``     dloss ``[...]``
    math     ``m = allreduce_max(max_v z)``               ``dz = dloss * (p - onehot)``
             ``e = exp(z - m)``                           restricted to my vocab rows,
             ``S, zt = allreduce_sum(sum_v e, z[label]``  with ``p = e / S``
             ``- m`` on the owning rank)``
             ``loss = log S - zt``
    ======== ============================================ ===============================

    ``m`` only stabilizes the exponent (no gradient flows through it). ``S`` and ``zt``
    travel in ONE all-reduce (stacked). Math in float32 (float64 for float64 logits);
    ``dz`` comes back in the logits' dtype. Labels outside ``[0, V)`` (e.g. an ignore
    index) get a finite but meaningless loss; the caller masks them.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: Optional[dist.ProcessGroup],
                vocab_start: int) -> torch.Tensor:
        cdtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        z = logits.to(cdtype)
        vocab_local = z.shape[-1]
        z_max = z.max(dim=-1).values
        if group is not None:
            check_collective("all_reduce", [z_max], world_size=dist.get_world_size(group), op=dist.ReduceOp.MAX)
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        z = z - z_max.unsqueeze(-1)
        in_mine = (labels >= vocab_start) & (labels < vocab_start + vocab_local)
        local_label = (labels - vocab_start).masked_fill(~in_mine, 0)
        z_target = z.gather(-1, local_label.unsqueeze(-1)).squeeze(-1).masked_fill(~in_mine, 0.0)
        exp_z = z.exp_()  # z is a fresh tensor (subtraction above): reuse its storage
        sum_exp = exp_z.sum(dim=-1)
        if group is not None:
            both = torch.stack((sum_exp, z_target))  # one collective for both sums
            check_collective("all_reduce", [both], world_size=dist.get_world_size(group))
            dist.all_reduce(both, group=group)
            sum_exp, z_target = both[0], both[1]
        loss = sum_exp.log() - z_target
        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_label, in_mine)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        softmax, local_label, in_mine = ctx.saved_tensors
        grad = softmax  # p, then subtract the one-hot of the label on the owning rank
        grad.scatter_add_(-1, local_label.unsqueeze(-1), -in_mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup],
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over tokens whose label is not ``ignore_index``.

    Shapes: ``logits [..., V/tp]`` (this rank's vocabulary slice, rank order),
    ``labels [...]`` (int, global ids in ``[0, V)`` or ``ignore_index``). Returns a
    scalar, identical on every rank of ``tp_group``. ValueError on labels out of range.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:-1])}")
    rank, size = tp_rank_and_size(tp_group)
    vocab = logits.shape[-1] * size
    valid = labels != ignore_index
    count = valid.sum()
    # Checked on the device (torch._assert_async), not read by the host: the step stays
    # free of syncs and capturable. On a GPU a bad label fails the step at the next
    # synchronization; on the CPU the assert raises here and becomes a ValueError.
    if labels.numel():
        bad = valid & ((labels < 0) | (labels >= vocab))
        _assert_or_value_error(~bad.any(), f"labels must be in [0, {vocab}) or ignore_index={ignore_index}",
                               lambda: f" (got {labels[bad].unique()[:8].tolist()})")
    _assert_or_value_error(count > 0, "every label equals ignore_index: the mean loss is undefined", lambda: "")
    group = tp_group if size > 1 else None
    per_token = _VocabParallelCrossEntropy.apply(logits, labels, group, rank * logits.shape[-1])
    return (per_token * valid).sum() / count


def _assert_or_value_error(ok: torch.Tensor, message: str, detail: Callable[[], str]) -> None:
    """``torch._assert_async(ok, message)``; where it raises at once (the CPU) a
    ValueError with ``message`` and ``detail()`` (read on that failure path only)."""
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise ValueError(message + detail()) from None
