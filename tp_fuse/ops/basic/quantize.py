"""``Quantize``: cast to FP8 at a chosen point of the graph."""

from __future__ import annotations

from typing import Any

import torch

from ..extra_state import QuantizerStateMixin
from ..op import BasicOperation, OperationContext
from ...quantization import OpQuantizers
from ...quantization import BlockScalingQuantizer, active_autocast, is_quantized_tensor


class Quantize(QuantizerStateMixin, BasicOperation):
    """Quantize the tensor passing through (forward) and/or its gradient.

    Under ``tp_fuse.autocast`` the forward output is a ``Float8Tensor`` that a
    following op (e.g. ``BasicLinear`` in another ``Sequential``) uses without
    quantizing again. With ``backward=True`` the gradient is quantized and
    dequantized (its FP8 rounding is applied) on the way back. Outside
    autocast it is the identity.

    Shapes: ``x [...] -> y [...]`` (same shape; nominal dtype kept).
    Forward: y = Q_fwd(x); backward: dx = dy, or Q_bwd(dy) with ``backward``.
    """

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__()

        self._quantize_forward = bool(forward)
        self._quantize_backward = bool(backward)
        self._quantizers = OpQuantizers(("input", "grad_output"))

    def _quantizer_role_names(self, mode: str) -> list[str]:
        # Transformer Engine counts a quantizer only for the directions that quantize.
        names = super()._quantizer_role_names(mode)
        enabled = self._quantize_backward if mode == "backward" else self._quantize_forward
        return names if enabled else []

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:

        state = active_autocast()
        ctx.quantize_grad = False
        if state is None:
            return input_
        qs = self._quantizers.get(state.recipe, state.amax_reduction_group)
        if self._quantize_backward:
            ctx.quantize_grad = True
            ctx.grad_quantizer = qs["grad_output"]
            ctx.grad_tracker = state.backward_tracker
        if not self._quantize_forward or is_quantized_tensor(input_):
            return input_
        # A block-scaled consumer's wgrad reads the column-wise copy, which must be
        # quantized from high precision now (it cannot be derived from the row-wise bytes).
        both = isinstance(qs["input"], BlockScalingQuantizer) and torch.is_grad_enabled()
        out = qs["input"].quantize(input_, transpose=both)
        state.track_forward(qs["input"])
        return out

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if not ctx.quantize_grad:
            return grad_output, ()
        dy, fresh = ctx.grad_quantizer.quantize_or_pass(grad_output)
        if fresh:
            ctx.grad_tracker.track(ctx.grad_quantizer)
        return dy, ()
