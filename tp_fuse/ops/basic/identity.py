"""``Identity``: pass the tensor through."""

from __future__ import annotations

from typing import Any

import torch

from ..op import BasicOperation, OperationContext, require


class Identity(BasicOperation):
    """Identity: ``y = x``, ``dx = dy``.

    Shapes: ``x [...] -> y [...]``. Nothing is computed or saved. A
    ``Float8Tensor`` passes through as is (unlike compute ops, which
    dequantize): there is no math here that would need high precision, and a
    ``Quantize`` output should reach the next GEMM still quantized.
    Useful as a placeholder that keeps layer indices stable.
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        require(
            isinstance(input_, torch.Tensor),
            f"Identity: expected a torch.Tensor input, got {type(input_).__name__}",
        )
        return input_

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        return grad_output, ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``y = x`` (the fuser path copies it when the caller must not share it)."""
        return x, []
