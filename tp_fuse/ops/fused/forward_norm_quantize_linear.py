"""Forward fusion ``[LayerNorm|RMSNorm, BasicLinear(+Bias...)]`` under FP8: the norm writes FP8.

Without it, an FP8 linear after a norm costs two passes over the activations: the norm
writes ``y`` in high precision, then the linear's input quantizer reads ``y`` again to
cast it (and, for current scaling, a third read for the amax). The norm kernels
(``tp_fuse.kernels.layernorm_fwd`` / ``rmsnorm_fwd``) can write the FP8 bytes directly
with the quantizer's scale and return the amax of the unrounded output in the same
pass; that is what the next GEMM reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from ...recipe import DelayedScaling, Float8CurrentScaling
from ..basic._checks import maybe_dequantize
from ..basic.basic_linear import BasicLinear
from ..basic.layer_norm import LayerNorm
from ..basic.rmsnorm import RMSNorm
from ..fusion import Fuse, FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext
from .forward_linear_bias_activation import ForwardLinearBiasActivation
from .forward_linear_bias_add import ForwardLinearBiasAdd
from .forward_linear_scale_add import ForwardLinearScaleAdd
from ...quantization import active_autocast
from ...quantization.gemm_choice import decision_of

Norm = Union[LayerNorm, RMSNorm]

#: Ops that may read the norm's FP8 output: a BasicLinear, alone or already fused with its
#: bias (and activation / residual). Each passes a Float8Tensor input straight to
#: ``BasicLinear.forward_gemm``, whose ``quantize_operands`` uses it as is.
LINEAR_CONSUMERS = (BasicLinear, ForwardLinearBiasActivation, ForwardLinearBiasAdd, ForwardLinearScaleAdd)


class ForwardNormQuantizeLinear(FusedOperation):
    """Forward pass of a norm and the FP8 linear after it, the norm writing FP8.

    Shapes: ``x [..., H]`` (norm input), ``y8 [..., H]`` FP8 (the linear's GEMM input),
    then whatever the linear op returns (``[..., out]``).

    Equations (``q`` = the BasicLinear's input quantizer, ``norm`` = LayerNorm/RMSNorm):
        delayed scaling:  y8, amax = norm_kernel(x, scale=q.scale)   one pass
                          q.amax_history[0] = max(q.amax_history[0], amax)
        current scaling:  y, amax = norm_kernel(x)                    amax in the same pass
                          y8 = cast(y, scale(allreduce_max(amax)))
        then the linear op (GEMM, bias epilogue, activation / residual) on y8.

    Interchangeable with the unfused ops: the norm's ctx is filled by
    ``Norm.normalize`` exactly as its ``op_forward`` fills it, the quantizer records
    and tracks the amax as ``BasicLinear.quantize_operands`` would, and the linear op
    runs its own ``fuser_forward``. With fp32 inputs the FP8 bytes are identical to
    the unfused path; with bf16/fp16 the fused cast rounds the fp32 norm output once
    instead of twice (via bf16), so bytes may differ by one FP8 step, and the amax is
    of the unrounded output. Forward only: the backward runs the basic ops' backward.
    """

    def __init__(self, *, norm: Norm, linear_op: FusibleOperation, current_scaling: bool = False) -> None:
        super().__init__([norm, linear_op])
        # The consumer as the fuser built it (possibly itself a fused op): run as is.
        self.__dict__["_linear_op"] = linear_op
        # Only for describing the fusion: the quantizer decides the path at run time.
        self.current_scaling = current_scaling

    @property
    def linear_op(self) -> FusibleOperation:
        return self.__dict__["_linear_op"]

    @property
    def linear(self) -> BasicLinear:
        linear = self.basic_ops[1]
        assert isinstance(linear, BasicLinear)
        return linear

    def fusion_summary(self) -> str:
        norm = type(self.basic_ops[0]).__name__
        decision = decision_of(self.linear)
        if decision is not None and not decision.fp8:
            return f"{norm} writes high precision: autocast(gemms='auto') keeps BasicLinear in high precision"
        how = "with the input quantizer's scale, amax in the same pass"
        if self.current_scaling:
            how = "from the amax it computes in its pass (current scaling: cast after)"
        tail = ""
        if self.linear_op is not self.linear:
            tail = f"; then {type(self.linear_op).__name__}"
        return f"{norm} writes BasicLinear's FP8 input {how}{tail}"

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions called (for ``explain``): the norm kernel, then
        the linear op's (weight cast, FP8 GEMM, activation ...)."""
        norm = self.basic_ops[0]
        assert isinstance(norm, (LayerNorm, RMSNorm))
        inner = getattr(self.linear_op, "kernels_used", None)
        rest: tuple[str, ...] = ()
        if inner is not None:
            rest = inner(direction)
        else:
            for op in self.linear_op.basic_op_list:
                rest += op.kernels_used(direction) if hasattr(op, "kernels_used") else ()
        return tuple(dict.fromkeys(norm.kernels_used(direction) + rest))

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:

        norm = self.basic_ops[0]
        assert isinstance(norm, (LayerNorm, RMSNorm))
        linear = self.linear
        state = active_autocast()
        if state is None:
            # Fusions are re-decided when the recipe changes; reaching here means the
            # fuser ran outside the autocast it fused under.
            raise RuntimeError(
                "ForwardNormQuantizeLinear ran without an FP8 autocast; it was fused under one"
            )
        x = maybe_dequantize(input_)
        qs = linear.fp8_quantizers(x)
        if qs is None:
            # autocast(gemms="auto") keeps this Linear's GEMMs in high precision at this
            # shape: the norm writes high precision, exactly as the unfused ops do.
            y, _ = norm.normalize(basic_op_ctxs[0], x)
            out, extra = self.linear_op.fuser_forward(
                basic_op_ctxs[1:], y, basic_op_extra_inputs=basic_op_extra_inputs[1:],
                basic_op_kwargs=basic_op_kwargs[1:],
            )
            return out, [()] + [tuple(e) for e in extra]
        q = qs["input"]
        ctx = basic_op_ctxs[0]
        outputs = q.producer_outputs(x.device)
        # An FP8-stats tap (tp_fuse.debug) observing this step needs the high-precision
        # norm output beside its FP8 cast; only then is it materialized. Layers with
        # debug *features* never get here: fuse_by_window rejects them.
        hooks = linear.debug_hooks
        observed = hooks is not None and hooks.fp8_tap is not None and hooks.fp8_tap.active
        if outputs is not None and not observed:
            # One launch: the norm writes FP8, maxes its amax into the quantizer's slot and
            # writes the tensor's scale_inv.
            scale, amax_out, scale_inv = outputs
            y8, _ = norm.normalize(ctx, x, scale=scale, fp8_dtype=q.fp8_dtype, amax_out=amax_out,
                                   scale_inv_out=scale_inv)
            x_fp8 = q.wrap_produced(y8, scale_inv, x.dtype)  # type: ignore[attr-defined]
        else:
            y, amax = norm.normalize(ctx, x, with_amax=True)
            x_fp8 = q.quantize_with_amax(y, amax)
            if hooks is not None:
                hooks.on_quantized("input", y, x_fp8, q)
        # As BasicLinear.quantize_operands does for an input it quantizes itself.
        state.track_forward(q)
        out, extra = self.linear_op.fuser_forward(
            basic_op_ctxs[1:],
            x_fp8,
            basic_op_extra_inputs=basic_op_extra_inputs[1:],
            basic_op_kwargs=basic_op_kwargs[1:],
        )
        return out, [()] + [tuple(e) for e in extra]


def norm_linear_mismatch(norm: Norm, linear: BasicLinear) -> Optional[str]:
    """Why ``linear`` cannot read ``norm``'s output as its GEMM input, or None.

    Each mismatch is a user error the basic ops report at run time; the fusion steps
    aside so that the error comes from the op that owns the check.
    """
    name = type(norm).__name__
    if norm.normalized_shape[-1] != linear.in_features:
        return (
            f"{name} output last dimension {norm.normalized_shape[-1]} does not match "
            f"BasicLinear in_features={linear.in_features}"
        )
    if norm.weight.dtype != linear.weight.dtype:
        return f"{name} dtype {norm.weight.dtype} differs from BasicLinear weight dtype {linear.weight.dtype}"
    if norm.weight.device != linear.weight.device:
        return f"{name} on {norm.weight.device}, BasicLinear weight on {linear.weight.device}"
    return None


def fuse_forward_norm_quantize_linear(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[LayerNorm|RMSNorm, BasicLinear(+...)]`` windows with ``ForwardNormQuantizeLinear``.

    Runs after the linear epilogue fusions, so the consumer may already be a
    ``ForwardLinearBiasActivation`` / ``ForwardLinearBiasAdd``; the fused op keeps it.
    """

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        norm = window[0]
        if not isinstance(norm, (LayerNorm, RMSNorm)):
            return None
        name = type(norm).__name__
        if len(window) < 2:
            return Reject(f"{name} is the last op of the fused group: no GEMM reads its output", 1)
        consumer = window[1]
        linear = consumer.basic_op_list[0]
        if not isinstance(consumer, LINEAR_CONSUMERS) or not isinstance(linear, BasicLinear):
            return Reject(
                f"{name} is followed by {type(consumer).__name__}, not a BasicLinear: "
                "no GEMM to write FP8 for",
                2,
            )
        if recipe is None:
            return Reject("no FP8 recipe: nothing to quantize", 2)
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
            return Reject(f"FP8 recipe {type(recipe).__name__}: only per-tensor scaling recipes fuse", 2)
        mismatch = norm_linear_mismatch(norm, linear)
        if mismatch is not None:
            return Reject(mismatch, 2)
        fused = ForwardNormQuantizeLinear(
            norm=norm, linear_op=consumer, current_scaling=isinstance(recipe, Float8CurrentScaling)
        )
        return Fuse(fused, 2, fused.fusion_summary())

    return fuse_by_window(ops, matcher, fusion_log)
