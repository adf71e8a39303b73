"""Activation functions: ``GELU`` (tanh approximation), ``ReLU``, ``SwiGLU``."""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.nn.functional as F

from ..op import BasicOperation, OperationContext, require
from ._checks import check_tensor, compute_dtype, maybe_dequantize


class _ActivationOperation(BasicOperation):
    """Shared plumbing of parameter-free activations.

    Subclasses implement :meth:`_activation_forward` (returns the output and
    the tensors the backward needs) and :meth:`_activation_backward`.
    :meth:`activation_backward` is the entry point fused backward ops use, so
    their input gradient is the one this op would produce.
    """

    def check_input(self, x: torch.Tensor) -> None:
        check_tensor(type(self).__name__, x)

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
            ctx.save_for_backward(*saved)
        return y

    def activation_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> torch.Tensor:
        """Input gradient from this op's ctx (filled by its forward or a fused forward)."""
        return self._activation_backward(ctx.saved_tensors, grad_output)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        return self.activation_backward(ctx, grad_output), ()


class GELU(_ActivationOperation):
    r"""GELU, tanh approximation (as Transformer Engine and GPT-2 use).

    Shapes: ``x [...] -> y [...]``.

    Equations, with ``k = sqrt(2/pi)``, ``u = k (x + 0.044715 x^3)``, ``t = tanh(u)``:
        forward:  y  = 0.5 x (1 + t)
        backward: dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2))

    Saved for backward: the input. Low-precision inputs are computed in float32
    inside torch's kernels and rounded once.
    """

    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return F.gelu(x, approximate="tanh"), (x,)

    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        (x,) = saved
        return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")


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


class SwiGLU(_ActivationOperation):
    r"""SwiGLU gated activation: the FIRST half of the last dim is the gate.

    Shapes: ``x [..., 2n] -> y [..., n]`` with ``a = x[..., :n]``, ``b = x[..., n:]``.

    Equations (math in float32, or float64 for float64 inputs), ``s = sigmoid(a)``:
        forward:  y  = silu(a) * b = a s b
        backward: da = dy * b * s (1 + a (1 - s)),   db = dy * a s,   dx = [da, db]

    Saved for backward: the input.
    """

    def check_input(self, x: torch.Tensor) -> None:
        super().check_input(x)
        require(
            x.dim() >= 1 and x.shape[-1] % 2 == 0,
            f"SwiGLU: expected an even last dimension (gate and value halves), "
            f"got input of shape {tuple(x.shape)}",
        )

    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        cdtype = compute_dtype(x.dtype)
        a, b = x.to(cdtype).chunk(2, dim=-1)
        return (F.silu(a) * b).to(x.dtype), (x,)

    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        (x,) = saved
        cdtype = compute_dtype(x.dtype)
        a, b = x.to(cdtype).chunk(2, dim=-1)
        dy = dy.to(cdtype)
        s = torch.sigmoid(a)
        da = dy * b * s * (1 + a * (1 - s))
        db = dy * a * s
        return torch.cat((da, db), dim=-1).to(x.dtype)
