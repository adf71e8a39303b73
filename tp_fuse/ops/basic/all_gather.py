"""``AllGather``: gather sequence shards from the tensor-parallel group."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..op import BasicOperation, OperationContext
from ._tp import check_first_dim_divisible, group_size


class AllGather(BasicOperation):
    """All-gather along the first (sequence) dimension.

    Shapes: ``x [s/tp, ...] -> y [s, ...]`` with ``tp`` the size of
    ``process_group`` (rank r's shard lands in rows ``r*s/tp:(r+1)*s/tp``).

    Equations:
        forward: y  = concat_r(x_r)
        backward: dx = reduce_scatter(dy)   (sum over ranks, this rank's rows)

    A ``Float8Tensor`` input is gathered as FP8 bytes (its scale is identical
    on all ranks by construction of the amax reduction). Followed by a
    ``BasicLinear`` it fuses into an overlapped all-gather+GEMM. TP size 1 is
    the identity.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.process_group = process_group

    @property
    def tp_size(self) -> int:
        return group_size(self.process_group)

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        from comm import all_gather_dim0

        if self.tp_size == 1:
            return input_
        return gather_maybe_fp8(input_, self.process_group, all_gather_dim0)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        from comm import reduce_scatter_dim0

        size = self.tp_size
        if size == 1:
            return grad_output, ()
        check_first_dim_divisible("AllGather (backward)", grad_output, size)
        return reduce_scatter_dim0(grad_output.contiguous(), self.process_group), ()


def gather_maybe_fp8(x: torch.Tensor, group, gather) -> torch.Tensor:
    """All-gather a tensor; a Float8Tensor travels as bytes and is re-wrapped."""
    from ...quantization import Float8Tensor

    if isinstance(x, Float8Tensor):
        data = gather(x._data.view(torch.uint8), group).view(x._data.dtype)
        return Float8Tensor.from_parts(data, x._scale_inv, dtype=x.dtype)
    return gather(x.contiguous(), group)
