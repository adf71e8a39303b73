"""GELU for compiled graphs: the eager kernels' formulas, forward and backward, traceable.

Autograd through ``F.gelu(approximate="tanh")`` would differentiate ``0.5 x (1 + tanh(u))``,
whose ``1 + tanh(u)`` cancels for negative x (wrong sign on tiny gradients below x ~ -5);
the eager kernels (``tp_fuse/kernels/activations.py``) avoid that, and so does this
function, with the same formulas written without the eager path's data-dependent branch
(a ``torch.where`` instead), so dynamo traces it and inductor fuses it.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels._common import DGELU_ATEN_MIN_X, dgelu_torch, gelu_torch
from ..basic._checks import compute_dtype

__all__ = ["GeluFunction"]


class GeluFunction(torch.autograd.Function):
    """Tanh-approximate GELU, as ``tp_fuse.ops.GELU`` computes it.

    Shapes: ``x [...] -> y [...]`` (x's dtype; math in float32, float64 for float64 x).
    With ``k = sqrt(2/pi)``, ``c = 0.044715``, ``u = k (x + c x^3)``, ``s = sigmoid(2u)``::

        forward:  y  = x s                                  (= 0.5 x (1 + tanh u))
        backward: dx = dy * gelu'(x),  gelu'(x) = s (1 + 2 k x (1 + 3 c x^2) (1 - s))
                  -- aten's ``gelu_backward`` for x >= -3 (accurate there), the sigmoid
                  form with ``1 - s = sigmoid(-2u)`` below (no cancellation)

    Saved for backward: the input.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return gelu_torch(x.to(compute_dtype(x.dtype))).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        cdtype = torch.promote_types(compute_dtype(dy.dtype), compute_dtype(x.dtype))
        g, xc = dy.to(cdtype), x.to(cdtype)
        fast = torch.ops.aten.gelu_backward(g, xc, approximate="tanh")
        dx = torch.where(xc < DGELU_ATEN_MIN_X, dgelu_torch(xc) * g, fast)
        return dx.to(dy.dtype)
