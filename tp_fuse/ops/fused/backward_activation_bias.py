"""Backward fusion ``[Bias, GELU|ReLU]``: activation gradient and bias gradient together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ... import kernels
from ..basic.activation import GELU, _ActivationOperation
from ..basic._checks import maybe_dequantize
from ..basic.bias import Bias
from ..fusion import Fuse, FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext
from .forward_linear_bias_activation import FUSABLE_ACTIVATIONS


class BackwardActivationBias(FusedOperation):
    """Backward pass of ``Bias, GELU|ReLU`` as one op.

    Shapes: ``dy [..., n]`` (gradient of the activation output),
    ``dx [..., n]``, ``db [n]``.

    Equations (forward was ``y = act(x + b)``):
        dz = act'(x + b) * dy      (the activation's own backward)
        db = sum of dz over every dimension but the last
        dx = dz

    Fused under Transformer Engine's conditions only (see
    :func:`fuse_backward_activation_bias`). Backward only. GELU: one
    ``tp_fuse.kernels.dgelu_dbias`` call (on CUDA a
    Triton kernel that reduces dz as it produces it). Its torch path computes
    ``dz`` with the function ``GELU``'s backward uses and ``db`` exactly as
    ``Bias.bias_grad`` does, so the result is bit-identical to the basic ops'
    (the Triton path sums the fp32 dz: equal within rounding). ReLU: the
    activation's ``activation_backward`` then ``Bias.bias_grad``.
    """

    def __init__(self, *, bias: Bias, activation: _ActivationOperation) -> None:
        super().__init__([bias, activation])

    def fusion_summary(self) -> str:
        return f"d{type(self.basic_ops[1]).__name__} and dbias together"

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls (for ``explain``)."""
        if direction == "backward" and isinstance(self.basic_ops[1], GELU):
            return ("dgelu_dbias",)
        return ()

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[Optional[torch.Tensor], ...]], list[tuple[()]]]:
        bias_op, activation = self.basic_ops
        assert isinstance(bias_op, Bias) and isinstance(activation, _ActivationOperation)
        if isinstance(activation, GELU):
            (x,) = basic_op_ctxs[1].saved_tensors
            # cache_quantized_input keeps x in FP8: the kernel reads high precision.
            dz, db, _ = kernels.dgelu_dbias(maybe_dequantize(grad_output), maybe_dequantize(x), with_amax=False)
            db = db.to(bias_op.bias.dtype) if bias_op.bias.requires_grad else None
        else:
            dz = activation.activation_backward(basic_op_ctxs[1], grad_output)
            db = bias_op.bias_grad(dz)
        return dz, [(db,), ()], [(), ()]


def fuse_backward_activation_bias(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[Bias, GELU|ReLU]`` windows with ``BackwardActivationBias`` under
    Transformer Engine's conditions: an FP8 recipe is in force and the op before the
    Bias quantizes its grad_output (a ``BasicLinear``, ``Quantize(backward=True)``),
    i.e. the fused gradient feeds an FP8 backward GEMM or cast. In high precision the
    basic ops' backward runs unfused, as in TE."""
    # Bias ops preceded by an op that quantizes its incoming gradient.
    feeds_fp8 = {
        id(op)
        for prev, op in zip(ops, ops[1:])
        if isinstance(op, Bias) and prev.basic_op_list[-1].num_quantizers("backward") > 0
    }

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        bias = window[0]
        if not isinstance(bias, Bias):
            return None
        act = window[1] if len(window) > 1 else None
        if isinstance(act, FUSABLE_ACTIVATIONS) and recipe is None:
            return Reject("high precision: dact+dbias fuse only under an FP8 recipe (as in Transformer Engine)", 2)
        if isinstance(act, FUSABLE_ACTIVATIONS) and id(bias) not in feeds_fp8:
            return Reject(
                "the op before Bias does not quantize its grad_output (needs BasicLinear or "
                "Quantize(backward=True) before it, as in Transformer Engine)",
                2,
            )
        if isinstance(act, FUSABLE_ACTIVATIONS):
            return Fuse(
                BackwardActivationBias(bias=bias, activation=act),
                2,
                f"d{type(act).__name__} and dbias together",
            )
        if isinstance(act, _ActivationOperation):
            return Reject(f"Bias followed by {type(act).__name__}: only GELU/ReLU fuse", 2)
        if act is None:
            return Reject("Bias is the last op of the fused group: no activation after it", 1)
        return Reject(f"Bias followed by {type(act).__name__}, not an activation (GELU/ReLU)", 2)

    return fuse_by_window(ops, matcher, fusion_log)
