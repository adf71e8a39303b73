"""``MakeExtraOutput``: return the intermediate tensor to the caller (e.g. a residual)."""

from __future__ import annotations

from typing import Any

import torch

from ..op import BasicOperation, OperationContext
from ._checks import check_tensor, maybe_dequantize


class MakeExtraOutput(BasicOperation):
    """Return the tensor passing through as an extra output: ``y, extra = seq(x)``.

    Shapes: ``x [...] -> y [...]``, ``extra [...]`` (both are ``x``).

    Equations:
        forward:  y = x,  extra = x
        backward: dx = dy + dextra

    With ``in_place=True`` the backward sum is accumulated into ``dextra``'s
    buffer (as in Transformer Engine) when that buffer is dense; autograd may
    hand the same gradient tensor to other branches, so this is an expert
    option; in the forward the fuser then returns the tensor itself for both outputs
    (Transformer Engine's aliasing) instead of a copy. Nothing is saved for backward. ``BackwardLinearAdd`` fuses this
    op's backward add into the preceding ``BasicLinear``'s dgrad GEMM.
    """

    num_extra_outputs: int = 1

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = bool(in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"

    @property
    def aliases_caller_tensors(self) -> bool:
        return self.in_place

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor]]]:
        x = maybe_dequantize(input_)
        check_tensor("MakeExtraOutput", x)
        # The fuser returns a view for the second appearance, so both outputs get gradients.
        return x, [(x,)]

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]], list[tuple[()]]]:
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        if grad_extra is None:
            # Nobody used the extra output: a hidden channel output without consumers,
            # or consumers that returned no gradient. Its gradient is zero.
            return grad_output, [()], [()]
        # A broadcast gradient (e.g. from .sum().backward(), stride 0) cannot be written in place.
        if self.in_place and grad_extra.is_contiguous():
            grad_extra += grad_output
            return grad_extra, [()], [()]
        return grad_extra + grad_output, [()], [()]

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: the same tensor twice; the fuser path copies what the caller must not share."""
        check_tensor("MakeExtraOutput", x)
        return x, [x]
