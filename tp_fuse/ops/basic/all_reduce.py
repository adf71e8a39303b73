"""``AllReduce``: sum over the tensor-parallel group."""

from __future__ import annotations

from typing import Any

import torch

from ..op import OperationContext
from ._checks import maybe_dequantize
from ._tp import TPCommOperation
from tp_fuse.comm import all_reduce
from ..compiled.comm import AllReduceForward, tp_group


class AllReduce(TPCommOperation):
    """All-reduce (sum) over ``process_group``; shapes unchanged.

    Equations:
        forward:  y  = sum_q x_q
        backward: dx = dy   (every rank already holds the full gradient)

    Preceded by a ``BasicLinear`` it fuses into a chunked GEMM+all-reduce
    (``UserbuffersForwardLinearAllReduce``). The sum stays in high precision (a
    Float8Tensor input is dequantized first). TP size 1 is the identity. See
    :class:`~tp_fuse.ops.basic._tp.TPCommOperation` for ``overlap``.
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:

        if self.tp_size == 1:
            return input_
        self.check_agreement("AllReduce", [input_])
        return all_reduce(maybe_dequantize(input_).contiguous(), self.process_group)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        return grad_output, ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: a functional all-reduce, identity backward (``AllReduceForward``)."""
        return (x if self.tp_size == 1 else AllReduceForward.apply(x, tp_group(self.process_group))), []
