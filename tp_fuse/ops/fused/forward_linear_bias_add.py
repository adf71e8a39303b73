"""Forward fusion ``[BasicLinear, (Bias,) AddExtraInput]``: the residual add rides in the GEMM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..basic._checks import maybe_dequantize
from ..basic.add_extra_input import AddExtraInput
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..fusion import Fuse, FusionLog, MatchResult, Reject, describe_next, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext
from .forward_linear_bias_activation import linear_bias_mismatch


class ForwardLinearBiasAdd(FusedOperation):
    """Forward pass of ``BasicLinear, (Bias,) AddExtraInput`` as one GEMM.

    Shapes: ``x [..., in]``, ``W [out, in]``, ``b [out]``,
    ``residual`` broadcastable to ``[..., out]``, ``y [..., out]``.

    Equations:
        forward: y = x W^T (+ b) + residual
                 high precision: one ``addmm`` whose accumulator starts at the
                 residual (+ b), so no separate add pass over y;
                 FP8: the scaled GEMM (bias in its epilogue), then the add.

    With ``AddExtraInput(in_place=True)`` (the only case Transformer Engine fuses) the
    GEMM accumulates into the residual's own buffer and ``y`` aliases it, as the
    unfused in-place add does.

    Forward only. Contexts are filled as the basic ops fill them
    (``BasicLinear.forward_gemm`` saves the GEMM operands; ``Bias`` and
    ``AddExtraInput`` need nothing).
    A broadcast residual is expanded (a view, no copy) to the output shape.
    """

    def __init__(
        self,
        *,
        linear: BasicLinear,
        bias: Optional[Bias],
        add: AddExtraInput,
        fp8: bool = False,
    ) -> None:
        ops: list[FusibleOperation] = [linear] + ([bias] if bias is not None else []) + [add]
        super().__init__(ops)
        # Only for describing the fusion: BasicLinear decides the GEMM path at run time.
        self.fp8 = fp8

    def fusion_summary(self) -> str:
        if self.fp8:
            with_bias = "bias in the scaled-GEMM epilogue, " if len(self.basic_ops) == 3 else ""
            return f"FP8: {with_bias}residual added after the scaled GEMM (no FP8 residual epilogue yet)"
        with_bias = " + bias" if len(self.basic_ops) == 3 else ""
        where = " (in place: written into the residual's buffer)" if self.basic_ops[-1].in_place else ""
        return f"residual{with_bias} as the GEMM accumulator{where}"

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        linear, add_op = self.basic_ops[0], self.basic_ops[-1]
        bias_op = self.basic_ops[1] if len(self.basic_ops) == 3 else None
        assert isinstance(linear, BasicLinear) and isinstance(add_op, AddExtraInput)
        # Validate in the unfused order so a bad input raises what the basic ops would.
        linear.check_input(input_)
        out_shape = (*input_.shape[:-1], linear.out_features)
        bias = None
        if bias_op is not None:
            assert isinstance(bias_op, Bias)
            bias_op.check_input_spec(out_shape, input_.dtype, input_.device)
            bias = bias_op.bias
        extra = maybe_dequantize(basic_op_extra_inputs[-1][0])
        add_op.check_extra_input(out_shape, input_.dtype, input_.device, extra)
        residual = extra if tuple(extra.shape) == out_shape else extra.expand(out_shape)
        y = linear.forward_gemm(
            basic_op_ctxs[0], input_, bias=bias, residual=residual, into_residual=add_op.in_place
        )
        return y, [() for _ in self.basic_ops]


def fuse_forward_linear_bias_add(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[BasicLinear, (Bias,) AddExtraInput]`` windows with ``ForwardLinearBiasAdd``."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        linear = window[0]
        if not isinstance(linear, BasicLinear):
            return None
        bias = window[1] if len(window) > 1 and isinstance(window[1], Bias) else None
        k = 2 if bias is not None else 1  # index of the would-be AddExtraInput
        add = window[k] if len(window) > k else None
        head = "BasicLinear, Bias" if bias is not None else "BasicLinear"
        if not isinstance(add, AddExtraInput):
            return Reject(
                f"{head} is followed by {describe_next(window, k)}, not AddExtraInput: no residual to add in the GEMM",
                min(k + 1, len(window)),
            )
        if bias is not None:
            mismatch = linear_bias_mismatch(linear, bias)
            if mismatch is not None:
                return Reject(mismatch, k + 1)
        fused = ForwardLinearBiasAdd(linear=linear, bias=bias, add=add, fp8=recipe is not None)
        return Fuse(fused, k + 1, fused.fusion_summary())

    return fuse_by_window(ops, matcher, fusion_log)
