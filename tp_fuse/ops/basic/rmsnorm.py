"""``RMSNorm``: root-mean-square normalization over the trailing dimensions."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch

from ..op import BasicOperation, OperationContext
from ._checks import (
    check_eps,
    check_matches_param,
    check_tensor,
    check_trailing_shape,
    compute_dtype,
    maybe_dequantize,
    normalized_shape_tuple,
    param_dtype,
)


class RMSNorm(BasicOperation):
    r"""RMS normalization with Transformer Engine's semantics (no mean subtraction, no bias).

    Shapes: ``x [..., *normalized_shape]``; ``weight [*normalized_shape]``;
    ``y`` like ``x``. Each row is normalized over ``H = prod(normalized_shape)``.

    Equations (per row, math in float32, or float64 for float64 inputs):
        forward:  rstd = 1 / sqrt(mean(x^2) + eps),  xhat = x * rstd,  y = xhat * g
                  with g = weight, or g = 1 + weight if ``zero_centered_gamma``
        backward: dweight = sum_rows(dy * xhat)
                  gd = dy * g,  dx = rstd * (gd - xhat * mean(gd * xhat))

    Saved for backward: the input and per-row ``rstd`` (float32).
    """

    def __init__(
        self,
        normalized_shape: int | Iterable[int],
        eps: float = 1e-5,
        *,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape_tuple("RMSNorm", normalized_shape)
        self.eps = check_eps("RMSNorm", eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        dtype = param_dtype("RMSNorm", dtype)
        self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """g = 1 (weight stored as 0 with ``zero_centered_gamma``)."""
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return (
            f"normalized_shape={self.normalized_shape}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )

    def check_input(self, x: torch.Tensor) -> None:
        check_tensor("RMSNorm", x)
        check_trailing_shape("RMSNorm", x, self.normalized_shape)
        check_matches_param("RMSNorm", x, self.weight, "weight")

    def _gamma(self, dtype: torch.dtype) -> torch.Tensor:
        g = self.weight.reshape(-1).to(dtype)
        return g + 1 if self.zero_centered_gamma else g

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        self.check_input(x)
        hidden = math.prod(self.normalized_shape)
        cdtype = compute_dtype(x.dtype)
        x2d = x.reshape(-1, hidden)  # [rows, H]
        xc = x2d.to(cdtype)
        rstd = torch.rsqrt(xc.square().mean(dim=-1) + self.eps)  # [rows]
        y = xc * rstd[:, None] * self._gamma(cdtype)
        if ctx.requires_grad:
            ctx.save_for_backward(x2d, rstd)
        return y.to(x.dtype).reshape(x.shape)

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        x2d, rstd = ctx.saved_tensors
        cdtype = rstd.dtype
        dy = grad_output.reshape(x2d.shape).to(cdtype)  # [rows, H]
        xhat = x2d.to(cdtype) * rstd[:, None]
        dweight = (dy * xhat).sum(dim=0)
        gd = dy * self._gamma(cdtype)
        dx = rstd[:, None] * (gd - xhat * (gd * xhat).mean(dim=-1, keepdim=True))
        return (
            dx.to(x2d.dtype).reshape(grad_output.shape),
            (dweight.to(self.weight.dtype).reshape(self.normalized_shape),),
        )
