"""Transformer Engine's other activations, in torch math: GLU, GEGLU, QGELU, QGEGLU,
ReGLU, SReLU, SReGLU, SiLU, ClampedSwiGLU, SiTUGLU.

Gated units split the last dimension into a gate half ``a`` (first) and a value half
``b`` (second) -- Transformer Engine's convention, the opposite of ``torch.nn.GLU``.
Math runs in float32 (float64 for float64 inputs) and is rounded once to the input
dtype. The backward differentiates the same function with autograd on the saved input
(one recomputation of the forward), so forward and gradient cannot disagree.

Equations (``s`` = sigmoid; ``gelu`` = tanh approximation as in ``GELU``):

============== =====================================================================
GLU            y = s(a) b
GEGLU          y = gelu(a) b
QGELU          y = x s(1.702 x)                               ("quick GELU")
QGEGLU         y = a s(1.702 a) b
ReGLU          y = relu(a) b
SReLU          y = relu(x)^2
SReGLU         y = relu(a)^2 b
SiLU           y = x s(x)
ClampedSwiGLU  a' = min(a, limit), b' = clamp(b, -limit, limit);
               y = a' s(alpha a') (b' + glu_linear_offset)      (GPT-OSS)
SiTUGLU        y = beta1 tanh(a / beta1) s(a) * beta2 tanh(b / beta2)
============== =====================================================================

Where a clamp is active its gradient is zero (torch's ``clamp`` convention).
"""

from __future__ import annotations

import abc
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..op import require
from ._checks import compute_dtype
from ._glu import check_interleave, deinterleave, interleave
from .activation import _ActivationOperation

__all__ = ["GLU", "GEGLU", "QGELU", "QGEGLU", "ReGLU", "SReLU", "SReGLU", "SiLU", "ClampedSwiGLU", "SiTUGLU"]


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


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=-1)


class SiLU(_TorchActivation):
    """SiLU (swish): ``y = x sigmoid(x)``."""

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class QGELU(_TorchActivation):
    """Quick GELU: ``y = x sigmoid(1.702 x)``."""

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class SReLU(_TorchActivation):
    """Squared ReLU: ``y = relu(x)^2``."""

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


class GLU(_TorchActivation):
    """Gated linear unit: ``y = sigmoid(a) b`` (gate = first half)."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return torch.sigmoid(a) * b


class GEGLU(_TorchActivation):
    """GELU-gated linear unit: ``y = gelu_tanh(a) b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return F.gelu(a, approximate="tanh") * b


class QGEGLU(_TorchActivation):
    """Quick-GELU-gated linear unit: ``y = a sigmoid(1.702 a) b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return a * torch.sigmoid(1.702 * a) * b


class ReGLU(_TorchActivation):
    """ReLU-gated linear unit: ``y = relu(a) b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return torch.relu(a) * b


class SReGLU(_TorchActivation):
    """Squared-ReLU-gated linear unit: ``y = relu(a)^2 b``."""

    gated = True

    def _math(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _halves(x)
        return torch.relu(a).square() * b


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
