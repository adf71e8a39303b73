"""What ``LayerNorm`` and ``RMSNorm`` share: parameters, checks, gamma and the forward.

The two differ only in the kernel (and so the per-row statistics it saves), LayerNorm's
bias, and the backward math; those stay in their own files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch

from ...kernels._common import as_rows, as_shape
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


class NormBase(BasicOperation):
    """A normalization over the trailing ``normalized_shape`` with weight g.

    Subclasses set ``op_name`` (used in error messages) and ``forward_kernel`` (the
    ``tp_fuse.kernels`` function name, for ``explain``), and implement
    :meth:`_run_kernel` and ``op_backward``.
    """

    op_name: str
    forward_kernel: str

    def __init__(
        self,
        normalized_shape: int | Iterable[int],
        eps: float,
        *,
        device: Optional[torch.device | str],
        dtype: Optional[torch.dtype],
        zero_centered_gamma: bool,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape_tuple(self.op_name, normalized_shape)
        self.eps = check_eps(self.op_name, eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.hidden = math.prod(self.normalized_shape)
        dtype = param_dtype(self.op_name, dtype)
        self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        # Subclasses add their other parameters, then call reset_parameters().

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

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype, else the weight's: the fuser casts the input to it."""
        return autocast_dtype or self.weight.dtype

    def check_input(self, x: torch.Tensor) -> None:
        check_tensor(self.op_name, x)
        check_trailing_shape(self.op_name, x, self.normalized_shape)
        check_matches_param(self.op_name, x, self.weight, "weight")

    def _gamma(self, dtype: torch.dtype) -> torch.Tensor:
        """g as a flat ``[H]`` vector; in ``dtype`` when zero-centered (``1 + w`` must
        not round in bf16), else the parameter itself (the kernels upcast it)."""
        if self.zero_centered_gamma:
            return as_shape(self.weight, (self.hidden,)).to(dtype) + 1
        return as_shape(self.weight, (self.hidden,))

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls in ``direction`` (for ``explain``)."""
        return (self.forward_kernel,) if direction == "forward" else ()

    def _run_kernel(
        self, x2d: torch.Tensor, gamma: torch.Tensor, **fp8: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
        """``(y, per-row statistics to save, amax)`` for ``x2d [rows, H]``."""
        raise NotImplementedError

    def normalize(
        self,
        ctx: OperationContext,
        x: torch.Tensor,
        *,
        scale: Optional[torch.Tensor] = None,
        fp8_dtype: Optional[torch.dtype] = None,
        with_amax: bool = False,
        amax_out: Optional[torch.Tensor] = None,
        scale_inv_out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The forward pass: ``(y, amax)``; saves what ``op_backward`` needs.

        With ``scale``/``fp8_dtype`` the kernel writes ``y`` in FP8 (for the next GEMM).
        ``amax`` (max |y| before any rounding) only with ``with_amax``, else None: it
        costs a read of y on the torch path. ``amax_out``/``scale_inv_out``: the kernel
        folds the amax into a quantizer's slot and writes ``1 / scale`` (``kernels.quantize``). Fused forward ops call this, so the ctx
        is filled exactly as :meth:`op_forward` fills it.
        """
        self.check_input(x)
        x2d = as_rows(x, self.hidden)  # [rows, H]
        y, stats, amax = self._run_kernel(
            x2d, self._gamma(compute_dtype(x.dtype)), scale=scale, fp8_dtype=fp8_dtype, with_amax=with_amax,
            amax_out=amax_out, scale_inv_out=scale_inv_out,
        )
        if ctx.requires_grad:
            # The input in its own dtype (not xhat in float32): half the memory for bf16.
            ctx.save_for_backward(x2d, *stats)
        return as_shape(y, x.shape), amax

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        return self.normalize(ctx, maybe_dequantize(input_))[0]
