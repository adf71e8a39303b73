"""Backward fusion ``[BasicLinear, ConstantScale]``: the scale rides in the dgrad and wgrad GEMMs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..basic.basic_linear import BasicLinear
from ..basic.constant_scale import ConstantScale
from ..fusion import Fuse, FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext


class BackwardLinearScale(FusedOperation):
    """Backward pass of ``BasicLinear, ConstantScale`` as the linear's two GEMMs with alpha.

    Shapes: ``dy [..., out]`` (gradient of the scaled output), ``W [out, in]``,
    ``x [..., in]``, ``dx [..., in]``, ``dW [out, in]``.

    Equations (forward was ``y = alpha x W^T``, ``alpha`` = ``ConstantScale.scale``):
        dgrad: dx = alpha dy W        (GEMM alpha; no pass over dy to scale it)
        wgrad: dW = alpha dy^T x
    Under FP8 the unscaled ``dy`` is quantized (as Transformer Engine does) and alpha is
    applied to the GEMM outputs. ``accumulate_into_main_grad`` is honoured through
    ``BasicLinear.finish_wgrad``.

    Backward only. Fires under Transformer Engine's conditions: the two ops in this order
    and the linear not column tensor-parallel (its dgrad collective must follow the GEMM).
    """

    def __init__(self, *, linear: BasicLinear, scale: ConstantScale, fp8: bool = False) -> None:
        super().__init__([linear, scale])
        # Only for describing the fusion: BasicLinear decides the GEMM path at run time.
        self.fp8 = fp8

    def fusion_summary(self) -> str:
        where = "applied to the FP8 GEMM outputs" if self.fp8 else "as the GEMMs' alpha"
        return f"scale {where} in dgrad and wgrad (no separate pass over dy)"

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[Optional[torch.Tensor], ...]], list[tuple[()]]]:
        linear, scale_op = self.basic_ops
        assert isinstance(linear, BasicLinear) and isinstance(scale_op, ConstantScale)
        dx, dw = linear.backward_gemm(basic_op_ctxs[0], grad_output, alpha=scale_op.scale)
        return dx, [(dw,), ()], [(), ()]


def fuse_backward_linear_scale(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[BasicLinear, ConstantScale]`` windows with ``BackwardLinearScale``."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        linear = window[0]
        if not isinstance(linear, BasicLinear) or len(window) < 2 or not isinstance(window[1], ConstantScale):
            return None  # only [BasicLinear, ConstantScale] windows are candidates
        if linear.tensor_parallel_mode == "column":
            return Reject(
                "column tensor-parallel BasicLinear: its dgrad collective must run right after the "
                "dgrad GEMM (Transformer Engine's condition)",
                2,
            )
        fused = BackwardLinearScale(linear=linear, scale=window[1], fp8=recipe is not None)
        return Fuse(fused, 2, fused.fusion_summary())

    return fuse_by_window(ops, matcher, fusion_log)
