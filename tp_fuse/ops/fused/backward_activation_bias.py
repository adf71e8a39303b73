"""Backward fusion ``[Bias, GELU|ReLU]``: activation gradient and bias gradient together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ... import kernels
from ..basic.activation import GELU, _ActivationOperation
from ..basic._checks import maybe_dequantize
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.grouped_linear import GroupedLinear
from ..basic.quantize import Quantize
from ..fusion import Fuse, FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext
from .forward_linear_bias_activation import FUSABLE_ACTIVATIONS


class BackwardActivationBias(FusedOperation):
    """Backward pass of ``Bias, GELU|ReLU`` as one op (FP8 only; see the fusion function).

    Shapes: ``dy [..., n]`` (gradient of the activation output),
    ``dx [..., n]``, ``db [n]``.

    Equations (forward was ``y = act(x + b)``):
        dz = act'(x + b) * dy      (the activation's own backward)
        db = sum of dz over every dimension but the last
        dx = dz

    Fused under Transformer Engine's conditions only (see
    :func:`fuse_backward_activation_bias`). Backward only. GELU: one
    ``tp_fuse.kernels.dgelu_dbias`` call (on CUDA a
    Triton kernel that reduces dz as it produces it). Its torch path computes
    ``dz`` with the function ``GELU``'s backward uses and ``db`` exactly as
    ``Bias.bias_grad`` does, so the result is bit-identical to the basic ops'
    (the Triton path sums the fp32 dz: equal within rounding). ReLU: the
    activation's ``activation_backward`` then ``Bias.bias_grad``.
    """

    def __init__(self, *, bias: Bias, activation: _ActivationOperation) -> None:
        super().__init__([bias, activation])

    def fusion_summary(self) -> str:
        return f"d{type(self.basic_ops[1]).__name__} and dbias together"

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls (for ``explain``)."""
        if direction == "backward" and isinstance(self.basic_ops[1], GELU):
            return ("dgelu_dbias",)
        return ()

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[Optional[torch.Tensor], ...]], list[tuple[()]]]:
        bias_op, activation = self.basic_ops
        assert isinstance(bias_op, Bias) and isinstance(activation, _ActivationOperation)
        if isinstance(activation, GELU):
            (x,) = basic_op_ctxs[1].saved_tensors
            # cache_quantized_input keeps x in FP8: the kernel reads high precision.
            dz, db, _ = kernels.dgelu_dbias(maybe_dequantize(grad_output), maybe_dequantize(x), with_amax=False,
                                            overwrite_grad=basic_op_ctxs[1].grad_output_owned)
            db = db.to(bias_op.bias.dtype) if bias_op.bias.requires_grad else None
        else:
            dz = activation.activation_backward(basic_op_ctxs[1], grad_output)
            db = bias_op.bias_grad(dz)
        return dz, [(db,), ()], [(), ()]


def fuse_backward_activation_bias(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[Bias, GELU|ReLU]`` windows with ``BackwardActivationBias`` under
    Transformer Engine's conditions: an FP8 recipe is in force and the op before ``Bias``
    takes an FP8 gradient (it has a grad-output quantizer: ``BasicLinear``,
    ``GroupedLinear``, ``Quantize(backward=True)``), the consumer of the fused kernel's
    output. The result is the same either way: that op quantizes dx with its own quantizer.
    """
    previous = {id(ops[i]): ops[i - 1] for i in range(1, len(ops))}

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        bias = window[0]
        if not isinstance(bias, Bias):
            return None
        act = window[1] if len(window) > 1 else None
        if act is None:
            return Reject("Bias is the last op of the fused group: no activation after it", 1)
        if not isinstance(act, _ActivationOperation):
            return Reject(f"Bias followed by {type(act).__name__}, not an activation (GELU/ReLU)", 2)
        if not isinstance(act, FUSABLE_ACTIVATIONS):
            return Reject(f"Bias followed by {type(act).__name__}: only GELU/ReLU fuse", 2)
        if recipe is None:
            return Reject(
                "no FP8 recipe: the fusion writes dx for an FP8 consumer (Transformer Engine's condition)", 2
            )
        prev = previous.get(id(bias))
        if prev is None or not takes_fp8_grad(prev):
            what = "nothing (start of the fused group)" if prev is None else type(prev).__name__
            return Reject(
                f"Bias is preceded by {what}, which has no grad-output quantizer to consume the fused "
                "dact+dbias output (Transformer Engine's condition)",
                2,
            )
        return Fuse(
            BackwardActivationBias(bias=bias, activation=act),
            2,
            f"d{type(act).__name__} and dbias together",
        )

    return fuse_by_window(ops, matcher, fusion_log)


def takes_fp8_grad(op: FusibleOperation) -> bool:
    """Whether ``op``'s backward quantizes its incoming gradient (Transformer Engine:
    ``op.get_grad_output_quantizer() is not None`` under an FP8 recipe)."""
    last = op.basic_op_list[-1]
    if isinstance(last, Quantize):
        return last._quantize_backward
    return isinstance(last, (BasicLinear, GroupedLinear))
