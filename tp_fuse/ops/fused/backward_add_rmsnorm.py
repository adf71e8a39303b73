"""Backward fusion ``[MakeExtraOutput, RMSNorm]``: the residual gradient added by the norm's backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..basic._checks import maybe_dequantize
from ..basic.make_extra_output import MakeExtraOutput
from ..basic.rmsnorm import RMSNorm
from ..fusion import Fuse, FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext


class BackwardAddRMSNorm(FusedOperation):
    """Backward pass of ``MakeExtraOutput, RMSNorm`` as one RMSNorm backward with an add.

    Shapes: ``dy [..., H]`` (gradient of the norm output), ``dresidual [..., H]``
    (gradient of ``MakeExtraOutput``'s extra output), ``dx [..., H]``, ``dweight``
    like the norm weight.

    Equations (forward was ``residual = x``, ``y = RMSNorm(x)``; see ``RMSNorm``):
        dx      = rmsnorm_dgrad(dy) + dresidual   (the add in the norm's float32 math,
                                                   one rounding to the input dtype)
        dweight = sum_rows(dy * xhat)

    Backward only. Fires under Transformer Engine's conditions: ``MakeExtraOutput`` with
    ``in_place=False`` right before an ``RMSNorm``.
    """

    def __init__(self, *, add: MakeExtraOutput, rmsnorm: RMSNorm) -> None:
        super().__init__([add, rmsnorm])

    def fusion_summary(self) -> str:
        return "residual grad added inside the RMSNorm backward (one pass, one rounding)"

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[Optional[torch.Tensor], ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[Optional[torch.Tensor], ...]], list[tuple[()]]]:
        make_extra, norm = self.basic_ops
        assert isinstance(make_extra, MakeExtraOutput) and isinstance(norm, RMSNorm)
        (grad_residual,) = basic_op_grad_extra_outputs[0]
        if grad_residual is not None:
            grad_residual = maybe_dequantize(grad_residual)
        dx, grad_params = norm.norm_backward(basic_op_ctxs[1], maybe_dequantize(grad_output), grad_residual)
        return dx, [(), grad_params], [(), ()]


def fuse_backward_add_rmsnorm(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[MakeExtraOutput(in_place=False), RMSNorm]`` windows with ``BackwardAddRMSNorm``."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        make_extra = window[0]
        if not isinstance(make_extra, MakeExtraOutput) or len(window) < 2 or not isinstance(window[1], RMSNorm):
            return None  # only [MakeExtraOutput, RMSNorm] windows are candidates
        if make_extra.in_place:
            return Reject(
                "MakeExtraOutput(in_place=True) accumulates into the residual gradient's buffer; "
                "the fused RMSNorm backward writes a new dx (Transformer Engine's condition: in_place=False)",
                2,
            )
        fused = BackwardAddRMSNorm(add=make_extra, rmsnorm=window[1])
        return Fuse(fused, 2, fused.fusion_summary())

    return fuse_by_window(ops, matcher, fusion_log)
