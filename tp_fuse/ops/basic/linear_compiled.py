"""``BasicLinear`` under torch.compile (``tp_fuse/ops/compiled/basic.py`` calls these): the
traced forward, whether a following ``Bias`` folds into it, and what keeps a layer eager.

Methods of ``BasicLinear`` written as functions of ``self``: the class binds them in its own
body, because the compiled path traces only an op whose own class defines
``compiled_forward`` (a subclass with another forward must not inherit the trace)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...kernels import fp8_gemm_reads_views
from ...quantization import Float8Tensor
from ...quantization.compile_ref import HAVE_COMPILE_REFS
from ...quantization.custom_ops import NO_OBSERVER
from ...quantization.gemm_choice import traced_gemms_auto
from ..compiled.comm import AllReduceBackward, tp_group
from ..compiled.fp8_linear import BlockLinearFunction, Fp8LinearFunction
from ..compiled.fp8_linear_cuda import Fp8LinearCudaFunction

__all__ = ["compiled_folds_bias", "compiled_forward", "compiled_unsupported"]


def compiled_forward(
    self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any, bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Traced ``y = x W^T (+ b)``: ``F.linear`` in high precision; in per-tensor FP8,
    ``Fp8LinearFunction`` on CPU (the exact emulation) and ``Fp8LinearCudaFunction`` on
    the CUDA path (``torch._scaled_mm`` with its bias; ATen casts under current
    scaling); ``BlockLinearFunction`` under the block-scaled recipes (NVFP4 included).
    ``bias``: the next op's (a ``Bias``) when :meth:`compiled_folds_bias`. Column
    parallel without sequence parallelism: dx is all-reduced over TP (as eager)."""
    self.check_input(x)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, self.in_features)
    if self.reduces_dgrad:
        x2d = AllReduceBackward.apply(x2d, tp_group(self.tensor_parallel_group))
    weight = self.weight
    if fp8 is None:
        # W in x's dtype (torch.autocast): the cast is differentiated back to W's dtype.
        y = torch.nn.functional.linear(x2d, weight if weight.dtype == x.dtype else weight.to(x.dtype))
    else:
        need_grad = torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad)
        observer = NO_OBSERVER if self.debug_hooks is None else self.debug_hooks.compile_ref
        if fp8.block_scaled:
            y = BlockLinearFunction.apply(x2d, weight, self._quantizers.compile_ref, fp8, need_grad, observer)
        elif not fp8_gemm_reads_views(x.device):
            y = Fp8LinearCudaFunction.apply(x2d, weight, bias, self._quantizers, fp8, need_grad, observer)
            bias = None
        else:
            y = Fp8LinearFunction.apply(x2d, weight, self._quantizers.compile_ref, fp8.recipe, fp8.fwd_dtype,
                                        fp8.bwd_dtype, need_grad, observer)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, self.out_features), []


def compiled_folds_bias(self, x: torch.Tensor, fp8: Any) -> bool:
    """Whether a ``Bias`` right after this op is traced as its FP8 GEMM's bias epilogue
    (per-tensor FP8 on the CUDA path: ``torch._scaled_mm(..., bias=)``, as eager)."""
    return fp8 is not None and fp8.per_tensor and not fp8_gemm_reads_views(x.device)


def compiled_unsupported(self, fp8: Any) -> Optional[str]:
    """Why the layer stays eager under ``fp8`` (None: it is traced)."""
    if self.debug_hooks is not None and self.debug_hooks.features_enabled:
        return "tp_fuse.debug features run its GEMMs (FP8 statistics alone are traced)"
    if self.accumulate_into_main_grad:
        return "accumulate_into_main_grad adds dW into weight.main_grad outside autograd"
    if self.delay_wgrad_compute:
        return "delay_wgrad_compute computes dW in backward_dw(), outside autograd"
    if isinstance(self.weight, Float8Tensor) or type(self.weight) not in (torch.Tensor, torch.nn.Parameter):
        return f"the weight is a {type(self.weight).__name__} (quantized_model_init or a subclass)"
    if fp8 is not None and not fp8.traced:
        return f"recipe {fp8.recipe} (only the per-tensor FP8 and the block-scaled recipes are traced)"
    if fp8 is not None and traced_gemms_auto():
        # A traced graph fixes FP8 or not per Linear; the choice is made per shape at run time.
        return "autocast(gemms='auto') chooses FP8 or high precision per GEMM shape at run time (eager)"
    if fp8 is not None and not HAVE_COMPILE_REFS:
        return "this torch has no opaque objects for custom ops (tp_fuse::fp8_cast needs them)"
    return None
