"""``ReduceScatter``: sum partial results over the group, keep this rank's rows."""

from __future__ import annotations

from typing import Any

import torch

from tp_fuse.comm import all_gather_dim0, reduce_scatter_dim0

from ..op import OperationContext
from ._checks import maybe_dequantize
from ._tp import TPCommOperation, check_first_dim_divisible
from ..compiled.comm import ReduceScatterSeq, tp_group


class ReduceScatter(TPCommOperation):
    """Reduce-scatter (sum) along the first (sequence) dimension.

    Shapes: ``x [s, ...] -> y [s/tp, ...]``.

    Equations:
        forward:  y_r = sum_q x_q[r*s/tp:(r+1)*s/tp]
        backward: dx  = all_gather(dy)

    Preceded by a ``BasicLinear`` it fuses into an overlapped GEMM+reduce-scatter
    (``UserbuffersForwardLinear``/``UserbuffersBackwardLinear``). The reduction stays in
    high precision: the summands are GEMM partial sums with no FP8 scale of their own,
    and collectives cannot add FP8 numbers (a Float8Tensor input is dequantized first).
    TP size 1 is the identity. See :class:`~tp_fuse.ops.basic._tp.TPCommOperation` for
    ``overlap``.
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:

        size = self.tp_size
        check_first_dim_divisible("ReduceScatter", input_, size)
        if size == 1:
            return input_
        self.check_agreement("ReduceScatter", [input_])
        return reduce_scatter_dim0(maybe_dequantize(input_).contiguous(), self.process_group)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):

        if self.tp_size == 1:
            return grad_output, ()
        return all_gather_dim0(grad_output.contiguous(), self.process_group), ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: a functional reduce-scatter over dim 0, all-gather backward (``ReduceScatterSeq``)."""
        check_first_dim_divisible("ReduceScatter", x, self.tp_size)
        return (x if self.tp_size == 1 else ReduceScatterSeq.apply(x, tp_group(self.process_group))), []
