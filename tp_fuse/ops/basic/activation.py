"""Plain (element-wise, not gated) activations: ``GELU`` (tanh approximation), ``ReLU``,
and Transformer Engine's ``SiLU``, ``QGELU``, ``SReLU`` in torch math. The gated units
(SwiGLU and the GLU family) are in ``gated_activation``; both build on
``_ActivationOperation`` here.

Equations of the torch-math ones (``s`` = sigmoid). Math runs in float32 (float64 for
float64 inputs) and is rounded once to the input dtype; their backward differentiates
the same function with autograd on the saved input (one recomputation of the forward).

============== =====================================================================
QGELU          y = x s(1.702 x)                               ("quick GELU")
SReLU          y = relu(x)^2
SiLU           y = x s(x)
============== =====================================================================
"""

from __future__ import annotations

import abc
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ... import kernels
from ...kernels._common import as_shape
from ...quantization import Float8CurrentScalingQuantizer
from ..op import BasicOperation, OperationContext, require
from ._checks import check_tensor, compute_dtype, maybe_dequantize
from ._glu import check_interleave, deinterleave, interleave
from ..compiled.activations import GeluFunction
from ..compiled.basic import in_compute_dtype


class _ActivationOperation(BasicOperation):
    """Shared plumbing of parameter-free activations.

    Subclasses implement :meth:`_activation_forward` (returns the output and
    the tensors the backward needs) and :meth:`_activation_backward`.
    :meth:`activation_backward` is the entry point fused backward ops use, so
    their input gradient is the one this op would produce.

    ``cache_quantized_input`` (Transformer Engine's option): the floating-point
    tensors saved for the backward are kept in FP8 (E4M3, current scaling) and
    dequantized there: less activation memory, FP8 rounding in the input gradient.
    """

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        self.cache_quantized_input = bool(cache_quantized_input)

    def check_input(self, x: torch.Tensor) -> None:
        check_tensor(type(self).__name__, x)

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype (the fuser casts the input to it), else no cast."""
        return autocast_dtype

    @abc.abstractmethod
    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(y, tensors to save for backward)``."""

    @abc.abstractmethod
    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        """``dx`` from the saved tensors and ``dy``."""

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        self.check_input(x)
        y, saved = self._activation_forward(x)
        if ctx.requires_grad:
            if self.cache_quantized_input:
                saved = tuple(_cache_fp8(t) for t in saved)
            ctx.save_for_backward(*saved)
        return y

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls in ``direction`` (for ``explain``)."""
        return ()

    def activation_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> torch.Tensor:
        """Input gradient from this op's ctx (filled by its forward or a fused forward)."""
        saved = tuple(maybe_dequantize(t) if t is not None else t for t in ctx.saved_tensors)
        return self._activation_backward(saved, maybe_dequantize(grad_output))

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        return self.activation_backward(ctx, grad_output), ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_unsupported(self, fp8: Any) -> Optional[str]:
        if self.cache_quantized_input:
            return f"{type(self).__name__}(cache_quantized_input=True) saves FP8 tensors for its backward"
        return None


def _cache_fp8(t: torch.Tensor) -> torch.Tensor:
    """A saved floating-point tensor in FP8 (E4M3, its own current scale)."""
    if not t.is_floating_point():
        return t  # e.g. ReLU's bool mask: already 1 byte per element
    return Float8CurrentScalingQuantizer(torch.float8_e4m3fn, columnwise=False)(t.detach())


class GELU(_ActivationOperation):
    r"""GELU, tanh approximation (as Transformer Engine and GPT-2 use).

    Shapes: ``x [...] -> y [...]``.

    Equations, with ``k = sqrt(2/pi)``, ``u = k (x + 0.044715 x^3)``, ``t = tanh(u)``:
        forward:  y  = 0.5 x (1 + t)
        backward: dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2))

    Saved for backward: the input. Math in float32 (float64 for float64 inputs),
    rounded once to the input dtype.

    Kernels: ``tp_fuse.kernels.gelu_fwd`` forward and ``dgelu_dbias`` backward (its
    bias gradient is what ``BackwardActivationBias`` uses; alone, this op drops it).
    Both evaluate ``0.5 x (1 + t)`` as ``x * sigmoid(2u)``, which is the same function
    without the cancellation of ``1 + t`` for negative x.
    """

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        return ("gelu_fwd",) if direction == "forward" else ("dgelu_dbias",)

    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        # The kernels work on rows: a 0-d input is viewed as one element.
        y, _ = kernels.gelu_fwd(x if x.dim() else x.reshape(1), with_amax=False)
        return as_shape(y, x.shape), (x,)

    def activation_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> torch.Tensor:
        # dx may go into grad_output's buffer when the fuser says this backward owns it.
        (x,) = (maybe_dequantize(t) for t in ctx.saved_tensors)
        return self._dgelu(x, maybe_dequantize(grad_output), ctx.grad_output_owned)

    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        (x,) = saved
        return self._dgelu(x, dy, False)

    @staticmethod
    def _dgelu(x: torch.Tensor, dy: torch.Tensor, overwrite_dy: bool) -> torch.Tensor:
        shape = x.shape
        if not x.dim():
            x, dy = x.reshape(1), dy.reshape(1)
        dx, _, _ = kernels.dgelu_dbias(dy, x, with_amax=False, with_dbias=False, overwrite_grad=overwrite_dy)
        return as_shape(dx, shape)

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: the eager kernels' formulas, forward and backward (``GeluFunction``:
        accurate gradients in the negative tail)."""
        self.check_input(x)
        return GeluFunction.apply(x), []


class ReLU(_ActivationOperation):
    """ReLU: ``y = max(x, 0)``.

    Shapes: ``x [...] -> y [...]``.
    Equations: forward ``y = x * (x > 0)``; backward ``dx = dy * (x > 0)``.
    Saved for backward: only the bool mask ``x > 0`` (1 byte per element).
    """

    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return torch.relu(x), (x > 0,)

    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        (positive,) = saved
        # masked_fill, not dy * mask: a NaN/inf in dy where x <= 0 must not leak through.
        return dy.masked_fill(~positive, 0)

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``torch.relu`` (its gradient masks dy where x <= 0, as eager)."""
        self.check_input(x)
        return torch.relu(x), []


class _TorchActivation(_ActivationOperation):
    """An activation given by :meth:`_math`; backward by autograd through it.

    Shapes: ``x [..., m] -> y [..., m]`` (``[..., m/2]`` for gated units).
    Saved for backward: the input.
    """

    gated: bool = False

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        if glu_interleave_size is not None and not self.gated:
            raise ValueError(f"{type(self).__name__}: glu_interleave_size applies to gated units only")
        self.glu_interleave_size = check_interleave(type(self).__name__, glu_interleave_size)

    @abc.abstractmethod
    def _math(self, x: torch.Tensor) -> torch.Tensor:
        """y from x (gated: x = [a | b] along the last dim), in x's dtype."""

    def check_input(self, x: torch.Tensor) -> None:
        super().check_input(x)
        if self.gated:
            k = 2 * (self.glu_interleave_size or 1)
            require(
                x.dim() >= 1 and x.shape[-1] % k == 0,
                f"{type(self).__name__}: expected a last dimension divisible by {k} (gate and value "
                f"parts), got input of shape {tuple(x.shape)}",
            )

    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        xc = deinterleave(x, self.glu_interleave_size).to(compute_dtype(x.dtype))
        with torch.no_grad():
            y = self._math(xc)
        return y.to(x.dtype), (x,)

    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        (x,) = saved
        cdtype = compute_dtype(x.dtype)
        with torch.enable_grad():
            xc = deinterleave(x.detach(), self.glu_interleave_size).to(cdtype).requires_grad_()
            (dx,) = torch.autograd.grad(self._math(xc), xc, dy.to(cdtype))
        return interleave(dx, self.glu_interleave_size).to(x.dtype)

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: :meth:`_math` in float32 (float64 for float64 x), rounded once to x's
        dtype; autograd differentiates it, as the eager backward does. Each subclass binds
        it as its own ``compiled_forward`` (a subclass of those, which may change the
        math, runs eagerly unless it does too)."""
        self.check_input(x)
        return in_compute_dtype(lambda t: self._math(deinterleave(t, self.glu_interleave_size)), x), []


class SiLU(_TorchActivation):
    """SiLU (swish): ``y = x sigmoid(x)``."""

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    compiled_forward = _TorchActivation.compiled_forward


class QGELU(_TorchActivation):
    """Quick GELU: ``y = x sigmoid(1.702 x)``."""

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)

    compiled_forward = _TorchActivation.compiled_forward


class SReLU(_TorchActivation):
    """Squared ReLU: ``y = relu(x)^2``."""

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()

    compiled_forward = _TorchActivation.compiled_forward
