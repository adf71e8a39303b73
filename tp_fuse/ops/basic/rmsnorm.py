"""``RMSNorm``: root-mean-square normalization over the trailing dimensions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from ... import kernels
from ..op import OperationContext
from ._norm import NormBase
import torch.nn.functional as F
from ._checks import compute_dtype


class RMSNorm(NormBase):
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

    op_name = "RMSNorm"
    forward_kernel = "rmsnorm_fwd"

    def __init__(
        self,
        normalized_shape: int | Iterable[int],
        eps: float = 1e-5,
        *,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__(normalized_shape, eps, device=device, dtype=dtype, zero_centered_gamma=zero_centered_gamma)
        self.reset_parameters()

    def _run_kernel(
        self, x2d: torch.Tensor, gamma: torch.Tensor, **fp8: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
        y, rstd, amax = kernels.rmsnorm_fwd(x2d, gamma, self.eps, **fp8)
        return y, (rstd,), amax

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor]]]:
        return self.norm_backward(ctx, grad_output)

    def norm_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor, grad_add: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor]]]:
        """The backward; ``grad_add`` (shaped like the input) is added to dx in the compute
        dtype before the one rounding to the input dtype (``BackwardAddRMSNorm``: the
        residual gradient of a preceding ``MakeExtraOutput``)."""
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
        if grad_add is not None:
            dx.add_(grad_add.reshape(x2d.shape))
        return (
            dx.to(x2d.dtype).reshape(grad_output.shape),
            (None if dweight is None else dweight.to(self.weight.dtype).reshape(self.normalized_shape),),
        )

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``F.rms_norm`` over the trailing ``H`` elements, statistics in float32
        (float64 for float64 input), parameters read in that dtype, output in x's dtype."""
        self.check_input(x)
        cdtype = compute_dtype(x.dtype)
        x2d = x.reshape(-1, self.hidden).to(cdtype)
        gamma = self._gamma(cdtype).to(cdtype)
        y = F.rms_norm(x2d, [self.hidden], gamma, self.eps)
        return y.to(x.dtype).reshape(x.shape), []
