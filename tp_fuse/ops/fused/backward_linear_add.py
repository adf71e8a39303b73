"""Backward fusion ``[MakeExtraOutput, BasicLinear]``: residual gradient accumulated by the dgrad GEMM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..basic.basic_linear import BasicLinear
from ..basic.make_extra_output import MakeExtraOutput
from ..fusion import Fuse, FusionLog, MatchResult, Reject, describe_next, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext


class BackwardLinearAdd(FusedOperation):
    """Backward pass of ``MakeExtraOutput, BasicLinear`` as one dgrad GEMM.

    Shapes: ``dy [..., out]``, ``W [out, in]``, ``dresidual [..., in]``
    (gradient of the extra output), ``dx [..., in]``, ``dW [out, in]``.

    Equations (forward was ``residual = x``, ``y = x W^T``):
        dx = dy W + dresidual     (one GEMM with beta = 1: ``addmm(dresidual, dy, W)``;
                                   FP8: the scaled GEMM, then the add)
        dW = dy^T x

    Backward only: this is ``MakeExtraOutput``'s ``dx = dy + dextra`` folded
    into ``BasicLinear.backward_gemm(..., grad_input_accumulate=dresidual)``.
    """

    def __init__(self, *, backward_add: MakeExtraOutput, linear: BasicLinear, fp8: bool = False) -> None:
        super().__init__([backward_add, linear])
        # Only for describing the fusion: BasicLinear decides the GEMM path at run time.
        self.fp8 = fp8

    def fusion_summary(self) -> str:
        if self.fp8:
            return "FP8: residual grad added after the scaled dgrad GEMM (no FP8 accumulate epilogue yet)"
        return "residual grad accumulated into dgrad GEMM (beta=1)"

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[Optional[torch.Tensor], ...]], list[tuple[()]]]:
        make_extra, linear = self.basic_ops
        assert isinstance(make_extra, MakeExtraOutput) and isinstance(linear, BasicLinear)
        (grad_residual,) = basic_op_grad_extra_outputs[0]
        dx, dw = linear.backward_gemm(basic_op_ctxs[1], grad_output, grad_input_accumulate=grad_residual)
        return dx, [(), (dw,)], [(), ()]


def fuse_backward_linear_add(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[MakeExtraOutput, BasicLinear]`` windows with ``BackwardLinearAdd``."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        make_extra = window[0]
        if not isinstance(make_extra, MakeExtraOutput):
            return None
        linear = window[1] if len(window) > 1 else None
        if isinstance(linear, BasicLinear):
            fused = BackwardLinearAdd(backward_add=make_extra, linear=linear, fp8=recipe is not None)
            return Fuse(fused, 2, fused.fusion_summary())
        return Reject(
            f"MakeExtraOutput is followed by {describe_next(window, 1)}, not BasicLinear: "
            "no dgrad GEMM to accumulate the residual gradient into",
            2 if linear is not None else 1,
        )

    return fuse_by_window(ops, matcher, fusion_log)
