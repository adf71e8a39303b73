"""``RMSNorm``: root-mean-square normalization over the trailing dimensions."""

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

    Kernels: the forward is ``tp_fuse.kernels.rmsnorm_fwd`` (Triton on CUDA, aten's
    ``_fused_rms_norm`` otherwise), which can also write FP8 for a following GEMM
    (``ForwardNormQuantizeLinear``). The backward is torch math (aten has no CPU
    kernel for ``_fused_rms_norm_backward``), arranged to make few passes.
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
        self.hidden = math.prod(self.normalized_shape)
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
        """g as a flat ``[H]`` vector; in ``dtype`` when zero-centered (``1 + w`` must
        not round in bf16), else the parameter itself (the kernels upcast it)."""
        if self.zero_centered_gamma:
            return self.weight.reshape(-1).to(dtype) + 1
        return self.weight.reshape(-1)

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls in ``direction`` (for ``explain``)."""
        return ("rmsnorm_fwd",) if direction == "forward" else ()

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
        y, rstd, amax = kernels.rmsnorm_fwd(
            x2d, self._gamma(compute_dtype(x.dtype)), self.eps, scale=scale, fp8_dtype=fp8_dtype, with_amax=with_amax
        )
        if ctx.requires_grad:
            ctx.save_for_backward(x2d, rstd)
        return y.reshape(x.shape), amax

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        return self.normalize(ctx, maybe_dequantize(input_))[0]

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor]]]:
        x2d, rstd = ctx.saved_tensors
        cdtype = rstd.dtype
        dy = grad_output.reshape(x2d.shape).to(cdtype)  # [rows, H]; no copy when fp32
        r = rstd[:, None]
        xhat = x2d.to(cdtype) * r  # a new tensor: updated in place below
        gamma = self._gamma(cdtype).to(cdtype)
        dy_xhat = dy * xhat
        dweight = dy_xhat.sum(dim=0) if self.weight.requires_grad else None
        # mean(gd * xhat) over a row with gd = dy * g is (dy * xhat) @ g / H: a
        # matrix-vector product instead of another full-size product and reduction.
        c = torch.mv(dy_xhat, gamma).div_(self.hidden)  # [rows]
        dx = (dy * gamma).sub_(xhat.mul_(c[:, None])).mul_(r)  # rstd (gd - xhat c)
        return (
            dx.to(x2d.dtype).reshape(grad_output.shape),
            (None if dweight is None else dweight.to(self.weight.dtype).reshape(self.normalized_shape),),
        )
