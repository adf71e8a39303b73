"""Gated activations: ``SwiGLU`` (tp_fuse kernels) and Transformer Engine's other gated
units in torch math: GLU, GEGLU, QGEGLU, ReGLU, SReGLU, ClampedSwiGLU, SiTUGLU.

Gated units split the last dimension into a gate half ``a`` (first) and a value half
``b`` (second) -- Transformer Engine's convention, the opposite of ``torch.nn.GLU``.
The torch-math ones compute in float32 (float64 for float64 inputs) and round once to
the input dtype. Their backward differentiates the same function with autograd on the
saved input (one recomputation of the forward), so forward and gradient cannot disagree.

Equations (``s`` = sigmoid; ``gelu`` = tanh approximation as in ``GELU``):

============== =====================================================================
SwiGLU         y = a s(a) b
GLU            y = s(a) b
GEGLU          y = gelu(a) b
QGEGLU         y = a s(1.702 a) b
ReGLU          y = relu(a) b
SReGLU         y = relu(a)^2 b
ClampedSwiGLU  a' = min(a, limit), b' = clamp(b, -limit, limit);
               y = a' s(alpha a') (b' + glu_linear_offset)      (GPT-OSS)
SiTUGLU        y = beta1 tanh(a / beta1) s(a) * beta2 tanh(b / beta2)
============== =====================================================================

Where a clamp is active its gradient is zero (torch's ``clamp`` convention).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ... import kernels
from ..op import OperationContext, require
from ._checks import maybe_dequantize
from ._glu import check_interleave, deinterleave, interleave
from .activation import _ActivationOperation, _TorchActivation
from ..compiled.basic import in_compute_dtype

__all__ = ["SwiGLU", "GLU", "GEGLU", "QGEGLU", "ReGLU", "SReGLU", "ClampedSwiGLU", "SiTUGLU"]


class SwiGLU(_ActivationOperation):
    r"""SwiGLU gated activation: the FIRST half of the last dim is the gate.

    Shapes: ``x [..., 2n] -> y [..., n]`` with ``a = x[..., :n]``, ``b = x[..., n:]``.

    Equations (math in float32, or float64 for float64 inputs), ``s = sigmoid(a)``:
        forward:  y  = silu(a) * b = a s b
        backward: da = dy * b * s (1 + a (1 - s)),   db = dy * a s,   dx = [da, db]

    Saved for backward: the input.

    ``glu_interleave_size=k`` (Transformer Engine's option): the last dim holds
    alternating blocks of k gate and k value columns ``[a1..ak, b1..bk, ...]``
    instead of the two halves; the output is the same ``[..., n]``.

    Kernels: ``tp_fuse.kernels.swiglu_fwd`` forward, ``dswiglu`` backward.
    """

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.glu_interleave_size = check_interleave(type(self).__name__, glu_interleave_size)

    def check_input(self, x: torch.Tensor) -> None:
        super().check_input(x)
        k = self.glu_interleave_size
        require(
            x.dim() >= 1 and x.shape[-1] % (2 * (k or 1)) == 0,
            f"{type(self).__name__}: expected a last dimension divisible by {2 * (k or 1)} "
            f"(gate and value {'blocks of ' + str(k) if k else 'halves'}), got input of shape {tuple(x.shape)}",
        )

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        self.check_input(x)
        return super().op_forward(ctx, deinterleave(x, self.glu_interleave_size))

    def activation_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> torch.Tensor:
        return interleave(super().activation_backward(ctx, grad_output), self.glu_interleave_size)

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        return ("swiglu_fwd",) if direction == "forward" else ("dswiglu",)

    def _activation_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        y, _ = kernels.swiglu_fwd(x, with_amax=False)
        return y, (x,)

    def _activation_backward(self, saved: tuple[torch.Tensor, ...], dy: torch.Tensor) -> torch.Tensor:
        (x,) = saved
        dx, _ = kernels.dswiglu(dy, x, with_amax=False)
        return dx

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``y = silu(a) * b`` with ``[a | b]`` the (de-interleaved) halves of the
        last dim, in float32 (float64 for float64 x), rounded once to x's dtype."""
        self.check_input(x)

        def math(t: torch.Tensor) -> torch.Tensor:
            a, b = deinterleave(t, self.glu_interleave_size).chunk(2, dim=-1)
            return F.silu(a) * b

        return in_compute_dtype(math, x), []


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=-1)


class GLU(_TorchActivation):
    """Gated linear unit: ``y = sigmoid(a) b`` (gate = first half)."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return torch.sigmoid(a) * b

    compiled_forward = _TorchActivation.compiled_forward


class GEGLU(_TorchActivation):
    """GELU-gated linear unit: ``y = gelu_tanh(a) b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return F.gelu(a, approximate="tanh") * b

    compiled_forward = _TorchActivation.compiled_forward


class QGEGLU(_TorchActivation):
    """Quick-GELU-gated linear unit: ``y = a sigmoid(1.702 a) b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return a * torch.sigmoid(1.702 * a) * b

    compiled_forward = _TorchActivation.compiled_forward


class ReGLU(_TorchActivation):
    """ReLU-gated linear unit: ``y = relu(a) b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return torch.relu(a) * b

    compiled_forward = _TorchActivation.compiled_forward


class SReGLU(_TorchActivation):
    """Squared-ReLU-gated linear unit: ``y = relu(a)^2 b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return torch.relu(a).square() * b

    compiled_forward = _TorchActivation.compiled_forward


class ClampedSwiGLU(_TorchActivation):
    """GPT-OSS's clamped SwiGLU (see the module table).

    Args:
        limit: gate clamped above at ``limit``, value clamped to ``[-limit, limit]``.
        alpha: sigmoid slope (1.702).
        glu_linear_offset: added to the clamped value (1.0).
    """

    gated = True

    def __init__(
        self,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: Optional[int] = None,
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size)
        for name, v in (("limit", limit), ("alpha", alpha), ("glu_linear_offset", glu_linear_offset)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"ClampedSwiGLU: {name} must be a finite float, got {v!r}")
        self.limit, self.alpha, self.glu_linear_offset = float(limit), float(alpha), float(glu_linear_offset)

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        a = a.clamp(max=self.limit)
        b = b.clamp(min=-self.limit, max=self.limit)
        return a * torch.sigmoid(self.alpha * a) * (b + self.glu_linear_offset)

    compiled_forward = _TorchActivation.compiled_forward


class SiTUGLU(_TorchActivation):
    """Soft-capped SiLU-gated unit (Kimi K3): ``beta1 tanh(a/beta1) s(a) beta2 tanh(b/beta2)``.

    Args:
        beta1, beta2: positive finite soft caps of the gate and value (4.0, 25.0).
    """

    gated = True

    def __init__(
        self,
        *,
        beta1: float = 4.0,
        beta2: float = 25.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: Optional[int] = None,
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size)
        for name, v in (("beta1", beta1), ("beta2", beta2)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SiTUGLU: {name} must be finite and positive, got {v!r}")
        self.beta1, self.beta2 = float(beta1), float(beta2)

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        gate = self.beta1 * torch.tanh(a / self.beta1) * torch.sigmoid(a)
        return gate * (self.beta2 * torch.tanh(b / self.beta2))

    compiled_forward = _TorchActivation.compiled_forward
