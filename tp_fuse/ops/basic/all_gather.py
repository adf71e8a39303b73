"""``AllGather``: gather sequence shards from the tensor-parallel group."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm import all_gather_dim0, reduce_scatter_dim0

from ...quantization import BlockScaledTensor, Float8Tensor
from ...quantization.block import wire as block_wire
from ..op import OperationContext, require
from ._tp import TPCommOperation, check_first_dim_divisible
from ..compiled.comm import AllGatherSeq, tp_group


class AllGather(TPCommOperation):
    """All-gather along the first (sequence) dimension.

    Shapes: ``x [s/tp, ...] -> y [s, ...]`` with ``tp`` the size of
    ``process_group`` (rank r's shard lands in rows ``r*s/tp:(r+1)*s/tp``).

    Equations:
        forward: y  = concat_r(x_r)
        backward: dx = reduce_scatter(dy)   (sum over ranks, this rank's rows)

    A ``Float8Tensor`` input (e.g. from a ``Quantize`` op) is gathered as FP8 bytes, one
    byte per element, and re-wrapped with its scale. That is only correct when the scale
    is identical on all ranks of the group: with delayed scaling, make the autocast's
    amax reduction group cover the TP group; with current scaling, reduce the amax over
    it. Followed by a ``BasicLinear`` it fuses into an overlapped all-gather+GEMM
    (``UserbuffersForwardLinear``), which quantizes before gathering by itself. TP size
    1 is the identity. See :class:`~tp_fuse.ops.basic._tp.TPCommOperation` for ``overlap``.
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:

        require(input_.dim() >= 1, "AllGather: expected a tensor with a sequence dimension, got a scalar")
        if self.tp_size == 1:
            return input_
        self.check_agreement("AllGather", [input_])
        return gather_maybe_fp8(input_, self.process_group, all_gather_dim0)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):

        size = self.tp_size
        if size == 1:
            return grad_output, ()
        check_first_dim_divisible("AllGather (backward)", grad_output, size)
        return reduce_scatter_dim0(grad_output.contiguous(), self.process_group), ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: a functional all-gather over dim 0, reduce-scatter backward (``AllGatherSeq``)."""
        require(x.dim() >= 1, "AllGather: expected a tensor with a sequence dimension, got a scalar")
        return (x if self.tp_size == 1 else AllGatherSeq.apply(x, tp_group(self.process_group))), []


def gather_maybe_fp8(
    x: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    gather: Callable[[torch.Tensor, Optional[dist.ProcessGroup]], torch.Tensor],
) -> torch.Tensor:
    """All-gather a tensor along dim 0; a Float8Tensor travels as bytes and is re-wrapped.

    ``gather(tensor, group)`` is the dim-0 all-gather to use (``tp_fuse.comm.all_gather_dim0``).
    """
    if isinstance(x, BlockScaledTensor):
        # Data bytes and block scales travel together, one collective per quantized copy.
        return block_wire.gather_block_scaled(x, group, gather)
    if isinstance(x, Float8Tensor):
        data = gather(x._fp8.contiguous().view(torch.uint8), group).view(x._fp8.dtype)
        return Float8Tensor.from_parts(data, x._sinv, dtype=x.dtype)
    return gather(x.contiguous(), group)
