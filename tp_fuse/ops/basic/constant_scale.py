"""``ConstantScale``: multiply by a fixed scalar."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..op import BasicOperation, OperationContext
from ._checks import check_tensor, maybe_dequantize


class ConstantScale(BasicOperation):
    """Multiply by a constant: ``y = scale * x``.

    Shapes: ``x [...] -> y [...]``.
    Equations: forward ``y = scale * x``; backward ``dx = scale * dy``.
    Nothing is saved for backward. ``scale`` is a plain Python float (not a
    parameter); fused ops such as ``ForwardAxpy`` read ``op.scale``.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"ConstantScale: scale must be a finite number, got {scale!r}")
        self.scale = float(scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        check_tensor("ConstantScale", x)
        return x * self.scale

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        return grad_output * self.scale, ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``y = scale * x``."""
        check_tensor("ConstantScale", x)
        return x * self.scale, []
