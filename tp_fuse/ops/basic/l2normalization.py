"""``L2Normalization``: scale each vector of the last dimension to unit L2 norm."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..op import BasicOperation, OperationContext
from ._checks import check_eps, check_tensor, compute_dtype, maybe_dequantize


class L2Normalization(BasicOperation):
    r"""Parameter-free L2 normalization over the last dimension (Transformer Engine's op,
    e.g. for query-key normalization).

    Shapes: ``x [..., H] -> y [..., H]``.

    Equations (per row, math in float32, float64 for float64 inputs):
        forward:  r = 1 / sqrt(sum_i x_i^2 + eps),   y = x r
        backward: dx = r dy - x r^3 (x . dy)

    Saved for backward: the input and ``r`` per row (float32).
    ``seq_length``/``micro_batch_size`` are accepted for TE compatibility (TE uses them
    to warm up JIT kernels; there is nothing to warm up here).
    """

    def __init__(
        self,
        *,
        eps: float = 1e-6,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.eps = check_eps("L2Normalization", eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype (the fuser casts the input to it), else no cast."""
        return autocast_dtype

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        check_tensor("L2Normalization", x)
        xc = x.to(compute_dtype(x.dtype))
        r = torch.rsqrt(xc.square().sum(dim=-1, keepdim=True) + self.eps)  # [..., 1]
        if ctx.requires_grad:
            ctx.save_for_backward(x, r)
        return (xc * r).to(x.dtype)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        x, r = ctx.saved_tensors
        xc = x.to(r.dtype)
        dy = maybe_dequantize(grad_output).to(r.dtype)
        dot = (xc * dy).sum(dim=-1, keepdim=True)  # x . dy per row
        dx = r * dy - xc * (r.pow(3) * dot)
        return dx.to(x.dtype), ()
