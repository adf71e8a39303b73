"""``LayerNorm``: layer normalization over the trailing dimensions."""

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


class LayerNorm(BasicOperation):
    r"""Layer normalization with Transformer Engine's semantics.

    Shapes: ``x [..., *normalized_shape]``; ``weight``, ``bias`` ``[*normalized_shape]``;
    ``y`` like ``x``. Rows are the leading dims, each normalized over the
    ``H = prod(normalized_shape)`` trailing elements.

    Equations (per row, math in float32, or float64 for float64 inputs):
        forward:  mu = mean(x),  rstd = 1 / sqrt(var(x) + eps)   (biased var)
                  xhat = (x - mu) * rstd,  y = xhat * g + bias
                  with g = weight, or g = 1 + weight if ``zero_centered_gamma``
        backward: dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)
                  gd = dy * g
                  dx = rstd * (gd - mean(gd) - xhat * mean(gd * xhat))

    ``zero_centered_gamma`` initializes ``weight`` to zeros (so g starts at 1):
    weight decay then pulls g towards 1 rather than 0.
    Saved for backward: the input and per-row ``mu``, ``rstd`` (float32).
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
        self.normalized_shape = normalized_shape_tuple("LayerNorm", normalized_shape)
        self.eps = check_eps("LayerNorm", eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        dtype = param_dtype("LayerNorm", dtype)
        self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """g = 1, bias = 0 (weight stored as 0 with ``zero_centered_gamma``)."""
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            self.bias.zero_()

    def extra_repr(self) -> str:
        return (
            f"normalized_shape={self.normalized_shape}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )

    def check_input(self, x: torch.Tensor) -> None:
        check_tensor("LayerNorm", x)
        check_trailing_shape("LayerNorm", x, self.normalized_shape)
        check_matches_param("LayerNorm", x, self.weight, "weight")

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
        var, mean = torch.var_mean(xc, dim=-1, correction=0)  # [rows] each
        rstd = torch.rsqrt(var + self.eps)
        xhat = (xc - mean[:, None]) * rstd[:, None]
        y = xhat * self._gamma(cdtype) + self.bias.reshape(-1).to(cdtype)
        if ctx.requires_grad:
            # The input in its own dtype (not xhat in float32): half the memory for bf16.
            ctx.save_for_backward(x2d, mean, rstd)
        return y.to(x.dtype).reshape(x.shape)

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x2d, mean, rstd = ctx.saved_tensors
        cdtype = mean.dtype
        dy = grad_output.reshape(x2d.shape).to(cdtype)  # [rows, H]
        xhat = (x2d.to(cdtype) - mean[:, None]) * rstd[:, None]
        dweight = (dy * xhat).sum(dim=0)
        dbias = dy.sum(dim=0)
        gd = dy * self._gamma(cdtype)
        dx = rstd[:, None] * (
            gd - gd.mean(dim=-1, keepdim=True) - xhat * (gd * xhat).mean(dim=-1, keepdim=True)
        )
        return (
            dx.to(x2d.dtype).reshape(grad_output.shape),
            (
                dweight.to(self.weight.dtype).reshape(self.normalized_shape),
                dbias.to(self.bias.dtype).reshape(self.normalized_shape),
            ),
        )
