"""Forward fusion ``[BasicLinear, ConstantScale, AddExtraInput(in_place=True)]``:
``residual += alpha x W^T`` as one GEMM writing into the residual's buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..basic._checks import maybe_dequantize
from ..basic.add_extra_input import AddExtraInput
from ..basic.basic_linear import BasicLinear
from ..basic.constant_scale import ConstantScale
from ..fusion import Fuse, FusionLog, MatchResult, Reject, describe_next, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext


class ForwardLinearScaleAdd(FusedOperation):
    """Forward pass of ``BasicLinear, ConstantScale, AddExtraInput(in_place=True)``.

    Shapes: ``x [..., in]``, ``W [out, in]``, ``residual [..., out]`` (the output shape
    exactly: it is written in place), ``y [..., out]`` (aliases ``residual``).

    Equations (``alpha`` = ``ConstantScale.scale``):
        forward: y = residual + alpha x W^T
                 high precision: ``residual.addmm_(x, W^T, alpha=alpha)`` (beta = 1, the GEMM
                 accumulates into the residual's buffer; no output-sized temporary);
                 FP8: the scaled GEMM, then ``residual.add_(y, alpha=alpha)``.

    Forward only; the backward runs the basic ops' backward (``BackwardLinearScale``
    may fuse it). ``BasicLinear``'s ctx is filled by ``BasicLinear.forward_gemm`` as in
    its own forward; ``ConstantScale`` and ``AddExtraInput`` save nothing.

    Fires under Transformer Engine's conditions: the three ops in this order, the add
    in place, and the linear not row tensor-parallel (its collective must follow the GEMM).
    """

    def __init__(self, *, linear: BasicLinear, scale: ConstantScale, add: AddExtraInput, fp8: bool = False) -> None:
        super().__init__([linear, scale, add])
        # Only for describing the fusion: BasicLinear decides the GEMM path at run time.
        self.fp8 = fp8

    def fusion_summary(self) -> str:
        if self.fp8:
            return "FP8: scaled GEMM, then alpha * y added into the residual's buffer"
        return "alpha * x W^T accumulated by the GEMM into the residual's buffer (beta=1)"

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        linear, scale_op, add_op = self.basic_ops
        assert isinstance(linear, BasicLinear) and isinstance(scale_op, ConstantScale)
        assert isinstance(add_op, AddExtraInput) and add_op.in_place
        # Validate in the unfused order so a bad input raises what the basic ops would.
        linear.check_input(input_)
        out_shape = (*input_.shape[:-1], linear.out_features)
        residual = maybe_dequantize(basic_op_extra_inputs[2][0])
        add_op.check_extra_input(out_shape, input_.dtype, input_.device, residual)
        y = linear.forward_gemm(
            basic_op_ctxs[0], input_, residual=residual, alpha=scale_op.scale, into_residual=True
        )
        return y, [(), (), ()]


def fuse_forward_linear_scale_add(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[BasicLinear, ConstantScale, AddExtraInput(in_place=True)]`` windows with
    ``ForwardLinearScaleAdd``."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        linear = window[0]
        if not isinstance(linear, BasicLinear):
            return None
        scale = window[1] if len(window) > 1 else None
        if not isinstance(scale, ConstantScale):
            return None  # only [BasicLinear, ConstantScale, ...] windows are candidates
        add = window[2] if len(window) > 2 else None
        if not isinstance(add, AddExtraInput):
            return Reject(
                f"BasicLinear, ConstantScale is followed by {describe_next(window, 2)}, not AddExtraInput",
                min(3, len(window)),
            )
        if linear.tensor_parallel_mode == "row":
            return Reject("row tensor-parallel BasicLinear: its collective must run right after the GEMM", 3)
        if not add.in_place:
            return Reject(
                "AddExtraInput(in_place=False): the fused GEMM accumulates into the residual's buffer, "
                "which only in_place=True allows (Transformer Engine's condition)",
                3,
            )
        fused = ForwardLinearScaleAdd(linear=linear, scale=scale, add=add, fp8=recipe is not None)
        return Fuse(fused, 3, fused.fusion_summary())

    return fuse_by_window(ops, matcher, fusion_log)
