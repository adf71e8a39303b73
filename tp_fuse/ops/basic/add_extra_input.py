"""``AddExtraInput``: add a tensor passed in by the caller (e.g. a residual)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..op import BasicOperation, OperationContext, require
from ._checks import check_tensor, maybe_dequantize


class AddExtraInput(BasicOperation):
    """Add an extra input tensor: ``y = x + extra``.

    The caller passes ``extra`` after the main input: ``y = seq(x, residual)``.

    Shapes: ``x [...]``, ``extra`` broadcastable to ``x``'s shape, ``y`` like ``x``.

    Equations:
        forward:  y = x + extra
        backward: dx = dy,  dextra = dy summed over the broadcast dimensions

    With ``in_place=True`` the sum is written into ``extra``'s storage (saves one
    activation-sized buffer) and the fuser returns ``extra`` itself, as Transformer
    Engine does, marked dirty so that autograd records the write (a leaf that requires
    grad, or a view, comes back as an alias of it instead; see
    ``tp_fuse/ops/output_aliasing.py``). ``extra`` must then already have the output
    shape. This is an expert option: writing into a tensor autograd saved elsewhere
    makes that backward raise.
    Nothing is saved for backward. See ``MakeExtraOutput`` for the
    mirror image (an add in the backward pass).
    """

    num_extra_inputs: int = 1

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = bool(in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"

    @property
    def aliases_caller_tensors(self) -> bool:
        return self.in_place

    # ---- validation and math shared with fused ops ----------------------

    def check_extra_input(
        self, out_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, extra: torch.Tensor
    ) -> None:
        """``extra`` must broadcast to the main tensor (shape ``out_shape``) and match its dtype/device."""
        check_tensor("AddExtraInput", extra, "extra input")
        try:
            broadcast = tuple(torch.broadcast_shapes(tuple(out_shape), tuple(extra.shape)))
        except RuntimeError:
            broadcast = None
        require(
            broadcast == tuple(out_shape),
            f"AddExtraInput: extra input of shape {tuple(extra.shape)} does not broadcast to "
            f"the main input's shape {tuple(out_shape)}",
        )
        require(
            not self.in_place or tuple(extra.shape) == tuple(out_shape),
            f"AddExtraInput(in_place=True): extra input must have the main input's shape "
            f"{tuple(out_shape)}, got {tuple(extra.shape)}",
        )
        require(
            extra.dtype == dtype,
            f"AddExtraInput: extra input dtype {extra.dtype} does not match main input dtype {dtype}",
        )
        require(
            extra.device == device,
            f"AddExtraInput: extra input on {extra.device}, main input on {device}",
        )

    # ---- fuser interface (extra inputs need the list-based entry points) --

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        x = maybe_dequantize(input_)
        check_tensor("AddExtraInput", x)
        extra = maybe_dequantize(basic_op_extra_inputs[0][0])
        self.check_extra_input(tuple(x.shape), x.dtype, x.device, extra)
        if self.in_place:
            out = extra.detach()
            out += x
        else:
            out = x + extra
        return out, [()]

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]], list[tuple[Optional[torch.Tensor]]]]:
        # dextra = dy. For a broadcast extra input the autograd engine sums dy
        # down to its shape (it reduces any gradient expandable to the input's
        # shape), so no state is needed here: fused forwards such as the seed's
        # ForwardAxpy may leave this op's ctx empty, as in Transformer Engine.
        return grad_output, [()], [(grad_output,)]

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``y = x + extra``."""
        check_tensor("AddExtraInput", x)
        (extra,) = extra_inputs
        self.check_extra_input(tuple(x.shape), x.dtype, x.device, extra)
        return x + extra, []

    def compiled_unsupported(self, fp8: Any) -> Optional[str]:
        return "AddExtraInput(in_place=True) writes into the caller's tensor" if self.in_place else None
