"""``LayerNorm``: layer normalization over the trailing dimensions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import contextlib

import torch

from ... import kernels
from ...kernels._common import as_dtype, as_shape
from ...kernels.dispatch import takes_cuda_path
from ...kernels.launch_count import cpu_only
from ..op import OperationContext
from ._norm import NormBase
import torch.nn.functional as F
from ._checks import compute_dtype


_NO_REGION = contextlib.nullcontext()


class LayerNorm(NormBase):
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
    (``ForwardNormQuantizeLinear``). In the backward, dx is aten's
    ``native_layer_norm_backward``; dweight and dbias are summed over rows in float32
    (float64 for float64 inputs) whatever the input dtype.
    """

    op_name = "LayerNorm"
    forward_kernel = "layernorm_fwd"

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
        self.bias = torch.nn.Parameter(torch.empty_like(self.weight))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """g = 1, bias = 0 (weight stored as 0 with ``zero_centered_gamma``)."""
        super().reset_parameters()
        with torch.no_grad():
            self.bias.zero_()

    def _run_kernel(
        self, x2d: torch.Tensor, gamma: torch.Tensor, **fp8: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
        y, mean, rstd, amax = kernels.layernorm_fwd(x2d, gamma, as_shape(self.bias, (self.hidden,)), self.eps, **fp8)
        return y, (mean, rstd), amax

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        x2d, mean, rstd = ctx.saved_tensors
        cdtype = mean.dtype
        dy = as_shape(grad_output, x2d.shape)  # [rows, H]
        if dy.dtype != x2d.dtype:
            dy = dy.to(x2d.dtype)
        # aten's parameter dtype for a bf16/fp16 input with fp32 statistics differs by
        # device: the CPU kernel takes that mix only with fp32 parameters (its
        # "mixed type" path), CUDA's only with parameters in the input dtype ("expected
        # scalar type BFloat16 but found Float" otherwise; seen on an H200, torch 2.11).
        on_cpu = x2d.device.type == "cpu"
        # The parameter gradients are sums over all rows. aten's CUDA kernel accumulates
        # them in fp32 (one kernel for dx, one for both sums): take them from the same
        # call. Its CPU kernel accumulates fp16/bf16 inputs in the input dtype (errors of
        # the order of the sum itself), so on CPU they are summed here in the compute
        # dtype (fp32); fp32/fp64 inputs are summed in that dtype either way. With a
        # zero-centered gamma g = 1 + w, dL/dw = dL/dg: the same sums.
        exact_params = x2d.dtype == cdtype or takes_cuda_path(x2d.device)
        with cpu_only() if on_cpu and x2d.dtype != cdtype else _NO_REGION:
            param_dtype = cdtype if on_cpu else x2d.dtype
            gamma = as_dtype(self._gamma(cdtype), param_dtype)
            beta = as_dtype(as_shape(self.bias, (self.hidden,)), param_dtype)
        dx, dgamma, dbeta = torch.ops.aten.native_layer_norm_backward(
            dy, x2d, [self.hidden], mean, rstd, gamma, beta,
            [True, exact_params and self.weight.requires_grad, exact_params and self.bias.requires_grad],
        )
        if exact_params:
            # (on CPU with a bf16 input the fp32 parameters' gradients come back in fp32)
            with cpu_only() if on_cpu and x2d.dtype != cdtype else _NO_REGION:
                return as_shape(dx, grad_output.shape), (
                    None if dgamma is None else as_shape(as_dtype(dgamma, self.weight.dtype), self.normalized_shape),
                    None if dbeta is None else as_shape(as_dtype(dbeta, self.bias.dtype), self.normalized_shape),
                )
        dy_c = dy.to(cdtype)  # no copy when the input is fp32/fp64
        dweight = dbias = None
        if self.weight.requires_grad:
            xhat = (x2d.to(cdtype) - mean.reshape(-1, 1)) * rstd.reshape(-1, 1)
            dweight = (dy_c * xhat).sum(dim=0)
        if self.bias.requires_grad:
            dbias = dy_c.sum(dim=0)
        return (
            dx.reshape(grad_output.shape),
            (
                None if dweight is None else dweight.to(self.weight.dtype).reshape(self.normalized_shape),
                None if dbias is None else dbias.to(self.bias.dtype).reshape(self.normalized_shape),
            ),
        )

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``F.layer_norm`` over the trailing ``H`` elements, statistics in float32
        (float64 for float64 input), parameters read in that dtype, output in x's dtype."""
        self.check_input(x)
        cdtype = compute_dtype(x.dtype)
        x2d = x.reshape(-1, self.hidden).to(cdtype)
        gamma = self._gamma(cdtype).to(cdtype)
        y = F.layer_norm(x2d, [self.hidden], gamma, self.bias.reshape(-1).to(cdtype), self.eps)
        return y.to(x.dtype).reshape(x.shape), []
