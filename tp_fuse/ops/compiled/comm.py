"""Tensor-parallel collectives of compiled graphs: functional collectives under Megatron's autograd.

The eager comm ops (``AllGather``, ``ReduceScatter``, ``AllReduce``, the column-parallel
dgrad all-reduce) call ``torch.distributed`` directly inside the fuser's autograd function.
In a traced group they are these autograd functions over PyTorch's functional collectives
(``torch.distributed._functional_collectives``), which dynamo traces into the graph and
inductor schedules. Their backward passes are written out here: the functional
collectives' own autograd (``all_reduce``'s backward is another all-reduce) is not the
tensor-parallel one (Megatron's ``g``/``f`` pair: an all-reduce whose backward is the
identity, and the identity whose backward is an all-reduce).

All collectives are over dim 0 (the sequence dim under sequence parallelism) with SUM.
``group`` is the op's process group (the default group when the op has none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["AllGatherSeq", "AllReduceForward", "AllReduceBackward", "ReduceScatterSeq", "tp_group"]


def tp_group(group: "dist.ProcessGroup | None") -> dist.ProcessGroup:
    """An op's TP group for the functional collectives (None: the default group)."""
    return group if group is not None else dist.group.WORLD


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, group))


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group))


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


class AllGatherSeq(torch.autograd.Function):
    """Sequence-parallel all-gather (before a column-parallel GEMM).

    Shapes: ``x [s/tp, ...] -> y [s, ...]`` (rank r's rows at ``[r s/tp, (r+1) s/tp)``).
    forward: ``y = concat_r x_r``; backward: ``dx_r = (sum_q dy_q)[r-th block]``
    (a reduce-scatter: every rank's dy holds partial sums for all rows).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        return _reduce_scatter(dy, ctx.group), None


class ReduceScatterSeq(torch.autograd.Function):
    """Sequence-parallel reduce-scatter (after a row-parallel GEMM).

    Shapes: ``x [s, ...] -> y [s/tp, ...]``.
    forward: ``y_r = (sum_q x_q)[r-th block]``; backward: ``dx = concat_r dy_r`` (all-gather).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        return _all_gather(dy, ctx.group), None


class AllReduceForward(torch.autograd.Function):
    """All-reduce of a row-parallel GEMM's partial sums (no sequence parallelism).

    Shapes: ``x [...] -> y [...]``. forward: ``y = sum_q x_q``; backward: ``dx = dy`` (the
    output is replicated: every rank already holds the whole gradient).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        return dy, None


class AllReduceBackward(torch.autograd.Function):
    """Identity whose gradient is all-reduced: the replicated input of a column-parallel GEMM
    (``CopyToTensorParallelRegion``; ``BasicLinear``'s dgrad all-reduce without SP).

    Shapes: ``x [...] -> y [...]``. forward: ``y = x``; backward: ``dx = sum_q dy_q``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        return _all_reduce(dy, ctx.group), None
