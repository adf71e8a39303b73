"""``LayerNorm``: layer normalization over the trailing dimensions."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch

from ... import kernels
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

    Kernels: the forward is ``tp_fuse.kernels.layernorm_fwd`` (Triton on CUDA, aten's
    ``native_layer_norm`` otherwise), which can also write FP8 for a following GEMM
    (``ForwardNormQuantizeLinear``); the backward is aten's ``native_layer_norm_backward``.
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
        self.hidden = math.prod(self.normalized_shape)
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
        """g as a flat ``[H]`` vector; in ``dtype`` when zero-centered (``1 + w`` must
        not round in bf16), else the parameter itself (the kernels upcast it)."""
        if self.zero_centered_gamma:
            return self.weight.reshape(-1).to(dtype) + 1
        return self.weight.reshape(-1)

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls in ``direction`` (for ``explain``)."""
        return ("layernorm_fwd",) if direction == "forward" else ()

    def normalize(
        self,
        ctx: OperationContext,
        x: torch.Tensor,
        *,
        scale: Optional[torch.Tensor] = None,
        fp8_dtype: Optional[torch.dtype] = None,
        with_amax: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The forward pass: ``(y, amax)``; saves what :meth:`op_backward` needs.

        With ``scale``/``fp8_dtype`` the kernel writes ``y`` in FP8 (for the next GEMM).
        ``amax`` (max |y| before any rounding) only with ``with_amax``, else None: it
        costs a read of y on the torch path. Fused forward ops call this, so the ctx
        is filled exactly as :meth:`op_forward` fills it.
        """
        self.check_input(x)
        x2d = x.reshape(-1, self.hidden)  # [rows, H]
        y, mean, rstd, amax = kernels.layernorm_fwd(
            x2d,
            self._gamma(compute_dtype(x.dtype)),
            self.bias.reshape(-1),
            self.eps,
            scale=scale,
            fp8_dtype=fp8_dtype,
            with_amax=with_amax,
        )
        if ctx.requires_grad:
            # The input in its own dtype (not xhat in float32): half the memory for bf16.
            ctx.save_for_backward(x2d, mean, rstd)
        return y.reshape(x.shape), amax

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        return self.normalize(ctx, maybe_dequantize(input_))[0]

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        x2d, mean, rstd = ctx.saved_tensors
        cdtype = mean.dtype
        dy = grad_output.reshape(x2d.shape)  # [rows, H]
        if dy.dtype != x2d.dtype:
            dy = dy.to(x2d.dtype)
        # Parameters in the compute dtype: aten's mixed-precision path (bf16 input, fp32
        # statistics) wants fp32 parameters and then returns fp32 dweight/dbias.
        gamma = self._gamma(cdtype).to(cdtype)
        mask = [True, self.weight.requires_grad, self.bias.requires_grad]
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            dy, x2d, [self.hidden], mean, rstd, gamma, self.bias.reshape(-1).to(cdtype), mask
        )
        return (
            dx.reshape(grad_output.shape),
            (
                None if dweight is None else dweight.to(self.weight.dtype).reshape(self.normalized_shape),
                None if dbias is None else dbias.to(self.bias.dtype).reshape(self.normalized_shape),
            ),
        )
