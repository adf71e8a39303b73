"""``Dropout``: zero random elements in training, rescale the rest."""

from __future__ import annotations

from typing import Any

import torch

from ..op import BasicOperation, OperationContext
from ._checks import check_tensor, maybe_dequantize


class Dropout(BasicOperation):
    """Dropout with probability ``p`` (inverted scaling, as ``torch.nn.Dropout``).

    Shapes: ``x [...] -> y [...]``.

    Equations, with ``m`` a Bernoulli(1 - p) keep mask drawn per element and
    ``s = 1 / (1 - p)``:
        training: y = x * m * s,  dx = dy * m * s
        eval, or p == 0: y = x,  dx = dy

    Only the bool mask ``m`` is saved (1 byte per element, not the scaled
    float mask), and only when a gradient is needed. The mask comes from
    torch's global RNG, so ``torch.manual_seed`` makes it reproducible.
    With ``p == 1`` everything is dropped (y = 0, dx = 0).
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be a probability in [0, 1], got {p!r}")
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def _scaled(self, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # Shared by forward and backward so both apply the identical map.
        if self.p == 1.0:
            return torch.zeros_like(t)
        return torch.where(keep, t * (1.0 / (1.0 - self.p)), torch.zeros((), dtype=t.dtype, device=t.device))

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        check_tensor("Dropout", x)
        ctx.dropped = self.training and self.p > 0.0
        if not ctx.dropped:
            return x
        # Drawn straight into a bool tensor: no float temporary of the input's size.
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - self.p)
        if ctx.requires_grad:
            ctx.save_for_backward(keep)
        return self._scaled(x, keep)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        if not ctx.dropped:
            return grad_output, ()
        (keep,) = ctx.saved_tensors
        return self._scaled(grad_output, keep), ()

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced inverted dropout; the mask comes from the compiled graph's RNG (not eager's stream)."""
        check_tensor("Dropout", x)
        if not self.training or self.p == 0.0:
            return x, []
        if self.p == 1.0:
            return torch.zeros_like(x), []
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - self.p)
        return torch.where(keep, x * (1.0 / (1.0 - self.p)), torch.zeros((), dtype=x.dtype, device=x.device)), []
