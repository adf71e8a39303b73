"""``ReduceScatter``: sum partial results over the group, keep this rank's rows."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..op import BasicOperation, OperationContext
from ._tp import check_first_dim_divisible, group_size


class ReduceScatter(BasicOperation):
    """Reduce-scatter (sum) along the first (sequence) dimension.

    Shapes: ``x [s, ...] -> y [s/tp, ...]``.

    Equations:
        forward:  y_r = sum_q x_q[r*s/tp:(r+1)*s/tp]
        backward: dx  = all_gather(dy)

    Preceded by a ``BasicLinear`` it fuses into an overlapped GEMM+reduce-
    scatter. The reduction stays in high precision (partial sums in FP8 would
    lose the accuracy the reduction is meant to keep). TP size 1 is the identity.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.process_group = process_group

    @property
    def tp_size(self) -> int:
        return group_size(self.process_group)

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        from comm import reduce_scatter_dim0

        size = self.tp_size
        if size == 1:
            return input_
        check_first_dim_divisible("ReduceScatter", input_, size)
        return reduce_scatter_dim0(input_.contiguous(), self.process_group)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        from comm import all_gather_dim0

        if self.tp_size == 1:
            return grad_output, ()
        return all_gather_dim0(grad_output.contiguous(), self.process_group), ()
