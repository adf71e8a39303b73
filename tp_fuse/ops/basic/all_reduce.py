"""``AllReduce``: sum over the tensor-parallel group."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..op import BasicOperation, OperationContext
from ._tp import group_size


class AllReduce(BasicOperation):
    """All-reduce (sum) over ``process_group``; shapes unchanged.

    Equations:
        forward:  y  = sum_q x_q
        backward: dx = dy   (every rank already holds the full gradient)

    Preceded by a ``BasicLinear`` it fuses into a chunked GEMM+all-reduce.
    TP size 1 is the identity.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.process_group = process_group

    @property
    def tp_size(self) -> int:
        return group_size(self.process_group)

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        from comm import all_reduce

        if self.tp_size == 1:
            return input_
        return all_reduce(input_.contiguous(), self.process_group)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        return grad_output, ()
