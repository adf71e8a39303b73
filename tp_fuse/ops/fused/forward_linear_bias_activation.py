"""Forward fusion ``[BasicLinear, Bias(, GELU|ReLU)]``: bias in the GEMM epilogue."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..basic.activation import GELU, ReLU, _ActivationOperation
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..fusion import Fuse, FusionLog, MatchResult, Reject, describe_next, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext

#: Activations this fusion applies on the GEMM output (elementwise, no extra state).
FUSABLE_ACTIVATIONS = (GELU, ReLU)


class ForwardLinearBiasActivation(FusedOperation):
    """Forward pass of ``BasicLinear, Bias`` and optionally ``GELU``/``ReLU``, as one op.

    Shapes: ``x [..., in]``, ``W [out, in]``, ``b [out]``, ``y [..., out]``.

    Equations:
        forward: z = x W^T + b   (one GEMM with the bias in its epilogue: ``addmm``,
                                  or ``torch._scaled_mm(bias=...)`` under FP8)
                 y = act(z)      (when an activation is part of the window)

    Forward only; the backward pass runs the basic ops' backward (or another
    backward fusion) from the contexts filled here exactly as the basic ops
    fill them: ``BasicLinear.forward_gemm`` saves the GEMM operands, ``Bias``
    needs nothing, and the activation's own ``op_forward`` saves its state.
    """

    def __init__(
        self,
        *,
        linear: BasicLinear,
        bias: Bias,
        activation: Optional[_ActivationOperation] = None,
    ) -> None:
        ops: list[FusibleOperation] = [linear, bias]
        if activation is not None:
            ops.append(activation)
        super().__init__(ops)

    def fusion_summary(self) -> str:
        act = self.basic_ops[2] if len(self.basic_ops) == 3 else None
        tail = f", then {type(act).__name__}" if act is not None else ""
        return "bias in GEMM epilogue" + tail

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        linear, bias_op = self.basic_ops[0], self.basic_ops[1]
        assert isinstance(linear, BasicLinear) and isinstance(bias_op, Bias)
        # Validate in the unfused order so a bad input raises what the basic ops would.
        linear.check_input(input_)
        out_shape = (*input_.shape[:-1], linear.out_features)
        bias_op.check_input_spec(out_shape, input_.dtype, input_.device)
        y = linear.forward_gemm(basic_op_ctxs[0], input_, bias=bias_op.bias)
        if len(self.basic_ops) == 3:
            activation = self.basic_ops[2]
            assert isinstance(activation, _ActivationOperation)
            y = activation.op_forward(basic_op_ctxs[2], y, **basic_op_kwargs[2])
        return y, [() for _ in self.basic_ops]


def linear_bias_mismatch(linear: BasicLinear, bias: Bias) -> Optional[str]:
    """Why ``bias`` cannot go into ``linear``'s GEMM epilogue, or None if it can.

    A mismatch is a user error the basic ops report at run time; the fusion
    steps aside so that the error comes from the op that owns the check.
    """
    if bias.size != linear.out_features:
        return (
            f"BasicLinear out_features={linear.out_features} does not match Bias size {bias.size}"
        )
    if bias.bias.dtype != linear.weight.dtype:
        return f"Bias dtype {bias.bias.dtype} differs from BasicLinear weight dtype {linear.weight.dtype}"
    if bias.bias.device != linear.weight.device:
        return f"Bias on {bias.bias.device}, BasicLinear weight on {linear.weight.device}"
    return None


def fuse_forward_linear_bias_activation(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[BasicLinear, Bias(, GELU|ReLU)]`` windows with ``ForwardLinearBiasActivation``.

    FP8 recipes fuse too: ``BasicLinear.forward_gemm`` passes the bias to the
    scaled GEMM's epilogue.
    """

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        linear = window[0]
        if not isinstance(linear, BasicLinear):
            return None
        if len(window) < 2 or not isinstance(window[1], Bias):
            return Reject(
                f"BasicLinear has no Bias after it (followed by {describe_next(window, 1)}): "
                "nothing to put in the GEMM epilogue",
                min(2, len(window)),
            )
        bias = window[1]
        mismatch = linear_bias_mismatch(linear, bias)
        if mismatch is not None:
            return Reject(mismatch, 2)
        act = window[2] if len(window) > 2 else None
        if isinstance(act, FUSABLE_ACTIVATIONS):
            return Fuse(
                ForwardLinearBiasActivation(linear=linear, bias=bias, activation=act),
                3,
                f"bias in GEMM epilogue, then {type(act).__name__}",
            )
        if isinstance(act, _ActivationOperation) and fusion_log is not None:
            # The 3-op window is rejected; the 2-op window below still fuses.
            fusion_log.rejected(
                window[:3],
                f"Bias followed by {type(act).__name__}: only GELU/ReLU fuse; "
                "fusing BasicLinear+Bias alone",
            )
        return Fuse(ForwardLinearBiasActivation(linear=linear, bias=bias), 2, "bias in GEMM epilogue")

    return fuse_by_window(ops, matcher, fusion_log)
