"""Tensor-parallel region ops that tp_fuse's dim-0 comm ops do not cover.

Each op sits beside its autograd dual (nanotron style). All are ``BasicOperation``s so
they can live inside a ``tp_fuse.ops.Sequential`` next to the GEMMs.

==================================  =========================  =============================
op                                  forward                    backward
==================================  =========================  =============================
CopyToTensorParallelRegion          identity                   all-reduce(dy) over TP
GatherFromTensorParallelRegion      all-gather, last dim       keep this rank's slice of dy
ScatterToTensorParallelRegion       keep this rank's slice     all-gather dy, last dim
==================================  =========================  =============================

``CopyToTensorParallelRegion`` is Megatron's ``copy_to_tensor_model_parallel_region``:
the input of a column-parallel GEMM without sequence parallelism is replicated, every
rank computes a partial ``dx`` from its weight shard, and the sum is the true ``dx``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.ops import BasicOperation, OperationContext
from tp_fuse.ops.compiled.comm import AllReduceBackward, tp_group

from .sharding import tp_rank_and_size
from tp_fuse.comm import all_reduce
from tp_fuse.comm import all_gather_dim0

__all__ = [
    "CopyToTensorParallelRegion",
    "GatherFromTensorParallelRegion",
    "ScatterToTensorParallelRegion",
    "all_gather_last_dim",
]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:

    return all_reduce(x.contiguous(), group)


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x [..., n]`` along the last dim -> ``[..., n * tp]``."""

    # comm gathers along dim 0: move the last dim first, gather, move it back.
    moved = x.movedim(-1, 0).contiguous()  # [n, ...]
    gathered = all_gather_dim0(moved, group)  # [n * tp, ...]
    return gathered.movedim(0, -1).contiguous()  # [..., n * tp]


class _TensorParallelRegionOp(BasicOperation):
    """Shared constructor: an explicit TP group (``None``: no TP, the op is the identity)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.process_group = process_group
        self.tp_rank, self.tp_size = tp_rank_and_size(process_group)

    def extra_repr(self) -> str:
        return f"tp_size={self.tp_size}"


class CopyToTensorParallelRegion(_TensorParallelRegionOp):
    """Identity forward, all-reduce backward (input of a column-parallel GEMM, no SP).

    Shapes: ``x [...] -> y [...]`` (replicated on every TP rank).

    Equations:
        forward:  y  = x
        backward: dx = sum_q dy_q    (each rank's dy is the partial dgrad of its shard)
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        return input_

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if self.tp_size == 1:
            return grad_output, ()
        return _all_reduce(grad_output, self.process_group), ()

    def compiled_forward(self, x: torch.Tensor, extra_inputs: Any, fp8: Any) -> tuple[torch.Tensor, list]:
        """Under torch.compile: the same identity / all-reduce pair, traced (tp_fuse/ops/compiled)."""
        return (x if self.tp_size == 1 else AllReduceBackward.apply(x, tp_group(self.process_group))), []


class GatherFromTensorParallelRegion(_TensorParallelRegionOp):
    """All-gather along the last dim (``gather_output=True`` of a column-parallel linear).

    Shapes: ``x [..., n/tp] -> y [..., n]``.

    Equations:
        forward:  y  = concat_q(x_q)   along the last dim
        backward: dx = dy[..., r*n/tp:(r+1)*n/tp]
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        if self.tp_size == 1:
            return input_
        return all_gather_last_dim(input_, self.process_group)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if self.tp_size == 1:
            return grad_output, ()
        return grad_output.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous(), ()


class ScatterToTensorParallelRegion(_TensorParallelRegionOp):
    """Keep this rank's slice of the last dim (``input_is_parallel=False`` of a row-parallel linear).

    Shapes: ``x [..., n] -> y [..., n/tp]``.

    Equations:
        forward:  y  = x[..., r*n/tp:(r+1)*n/tp]
        backward: dx = concat_q(dy_q)   along the last dim
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        if self.tp_size == 1:
            return input_
        n = input_.shape[-1]
        if n % self.tp_size != 0:
            raise ValueError(
                f"ScatterToTensorParallelRegion: last dimension {n} is not divisible by the "
                f"tensor-parallel size {self.tp_size}"
            )
        return input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if self.tp_size == 1:
            return grad_output, ()
        return all_gather_last_dim(grad_output, self.process_group), ()
