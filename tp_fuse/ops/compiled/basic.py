"""Traced forwards of the basic ops: what a fusion group computes under ``torch.compile``.

Each entry is the op's forward written with differentiable torch ops (and, for FP8 GEMMs,
:class:`~tp_fuse.ops.compiled.fp8_linear.Fp8LinearFunction`), so that dynamo traces it and
AOTAutograd derives the backward; inductor then fuses the elementwise work around the GEMMs
itself (the eager fuser's hand-written fusions are not used under compile). GELU keeps its
eager formulas (``activations.GeluFunction``: accurate gradients in the negative tail). The math is
the op's documented equations, computed in the same dtypes as its eager kernels (float32
for narrower inputs, rounded once to the input dtype), so compiled and eager results agree
to rounding.

Entries are keyed by the exact op class: a subclass (which may override the math) runs
through the eager fuser, as do ops or configurations without an entry here
(:func:`unsupported_reason` says which and why).

Entry signature: ``forward(op, x, extra_inputs, fp8) -> (y, extra_outputs)`` with ``fp8``
the :class:`~tp_fuse.quantization.compile_state.CompileKey` in force (None: high precision).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ...quantization.compile_state import HAVE_COMPILE_REFS, CompileKey
from ...quantization.custom_ops import NO_OBSERVER
from ...quantization.float8.tensor import Float8Tensor
from ...quantization.gemm_choice import traced_gemms_auto
from ...kernels import fp8_gemm_reads_views
from ..basic import (
    GEGLU,
    AllGather,
    AllReduce,
    ReduceScatter,
    GELU,
    GLU,
    QGEGLU,
    QGELU,
    SReGLU,
    SReLU,
    AddExtraInput,
    BasicLinear,
    Bias,
    ClampedSwiGLU,
    ConstantScale,
    Dropout,
    Identity,
    LayerNorm,
    MakeExtraOutput,
    ReGLU,
    ReLU,
    RMSNorm,
    SiLU,
    SiTUGLU,
    SwiGLU,
)
from ..basic._checks import check_tensor, compute_dtype
from ..basic._glu import deinterleave
from ..basic._tp import check_first_dim_divisible
from ..op import BasicOperation, require
from .activations import GeluFunction
from .comm import AllGatherSeq, AllReduceBackward, AllReduceForward, ReduceScatterSeq
from .fp8_linear import BlockLinearFunction, Fp8LinearFunction
from .fp8_linear_cuda import Fp8LinearCudaFunction

__all__ = ["TRACED_FORWARDS", "register_traced_forward", "tp_group", "unsupported_reason"]

Extras = list[torch.Tensor]
Forward = Callable[[Any, torch.Tensor, Extras, Optional[CompileKey]], tuple[torch.Tensor, Extras]]


def tp_group(group: Optional[torch.distributed.ProcessGroup]) -> torch.distributed.ProcessGroup:
    """An op's TP group for the functional collectives (None: the default group)."""
    return group if group is not None else torch.distributed.group.WORLD


def _linear(op: BasicLinear, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey],
            bias: Optional[torch.Tensor] = None):
    """``y = x W^T (+ b)``: ``F.linear`` in high precision, :class:`Fp8LinearFunction` in
    per-tensor FP8 on CPU (exact emulation), :class:`Fp8LinearCudaFunction` on the CUDA
    path (``torch._scaled_mm`` with its bias; ATen casts under current scaling),
    :class:`BlockLinearFunction` under the block-scaled recipes (NVFP4 included).
    ``bias``: the next op's (``Bias``) when the fuser path folds it into the GEMM
    (:func:`folds_bias`). Column parallel without sequence parallelism: dx is all-reduced
    over TP (as eager)."""
    op.check_input(x)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, op.in_features)
    if op.reduces_dgrad:
        x2d = AllReduceBackward.apply(x2d, tp_group(op.tensor_parallel_group))
    weight = op.weight
    if fp8 is None:
        # W in x's dtype (torch.autocast): the cast is differentiated back to W's dtype.
        y = F.linear(x2d, weight if weight.dtype == x.dtype else weight.to(x.dtype))
    else:
        need_grad = torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad)
        observer = NO_OBSERVER if op.debug_hooks is None else op.debug_hooks.compile_ref
        if fp8.block_scaled:
            y = BlockLinearFunction.apply(x2d, weight, op._quantizers.compile_ref, fp8, need_grad, observer)
        elif not fp8_gemm_reads_views(x.device):
            y = Fp8LinearCudaFunction.apply(x2d, weight, bias, op._quantizers, fp8, need_grad, observer)
            bias = None
        else:
            y = Fp8LinearFunction.apply(
                x2d, weight, op._quantizers.compile_ref, fp8.recipe, fp8.fwd_dtype, fp8.bwd_dtype, need_grad, observer
            )
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, op.out_features), []


def folds_bias(op: BasicLinear, x: torch.Tensor, fp8: Optional[CompileKey]) -> bool:
    """Whether a ``Bias`` right after ``op`` is traced as the FP8 GEMM's bias epilogue
    (per-tensor FP8 on the CUDA path: ``torch._scaled_mm(..., bias=)``, as eager)."""
    return fp8 is not None and fp8.per_tensor and not fp8_gemm_reads_views(x.device)


def _norm(op: Any, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    """LayerNorm / RMSNorm over the trailing ``H`` elements, statistics in float32
    (float64 for float64 input), parameters read in that dtype, output in x's dtype."""
    op.check_input(x)
    cdtype = compute_dtype(x.dtype)
    x2d = x.reshape(-1, op.hidden).to(cdtype)
    gamma = op._gamma(cdtype).to(cdtype)
    if isinstance(op, LayerNorm):
        y = F.layer_norm(x2d, [op.hidden], gamma, op.bias.reshape(-1).to(cdtype), op.eps)
    else:
        y = F.rms_norm(x2d, [op.hidden], gamma, op.eps)
    return y.to(x.dtype).reshape(x.shape), []


def _bias(op: Bias, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    op.check_input(x)
    return x + op.bias.to(x.dtype), []


def _in_compute_dtype(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` evaluated in float32 (float64 for float64 x), rounded once to x's dtype."""
    return fn(x.to(compute_dtype(x.dtype))).to(x.dtype)


def _gelu(op: GELU, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    op.check_input(x)
    return GeluFunction.apply(x), []


def _relu(op: ReLU, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    op.check_input(x)
    return torch.relu(x), []


def _swiglu(op: SwiGLU, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    """``y = silu(a) * b`` with ``[a | b]`` the (de-interleaved) halves of the last dim."""
    op.check_input(x)

    def math(t: torch.Tensor) -> torch.Tensor:
        a, b = deinterleave(t, op.glu_interleave_size).chunk(2, dim=-1)
        return F.silu(a) * b

    return _in_compute_dtype(math, x), []


def _torch_activation(op: Any, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    """The torch-math activations (SiLU, QGELU, the GLU family...): their own ``_math``."""
    op.check_input(x)
    return _in_compute_dtype(lambda t: op._math(deinterleave(t, op.glu_interleave_size)), x), []


def _make_extra_output(op: MakeExtraOutput, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    check_tensor("MakeExtraOutput", x)
    # The same tensor twice; the fuser path copies what the caller must not share.
    return x, [x]


def _add_extra_input(op: AddExtraInput, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    check_tensor("AddExtraInput", x)
    (extra,) = extras
    op.check_extra_input(tuple(x.shape), x.dtype, x.device, extra)
    return x + extra, []


def _dropout(op: Dropout, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    """Inverted dropout; the mask comes from the compiled graph's RNG (not eager's stream)."""
    check_tensor("Dropout", x)
    if not op.training or op.p == 0.0:
        return x, []
    if op.p == 1.0:
        return torch.zeros_like(x), []
    keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - op.p)
    return torch.where(keep, x * (1.0 / (1.0 - op.p)), torch.zeros((), dtype=x.dtype, device=x.device)), []


def _all_gather(op: AllGather, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    require(x.dim() >= 1, "AllGather: expected a tensor with a sequence dimension, got a scalar")
    return (x if op.tp_size == 1 else AllGatherSeq.apply(x, tp_group(op.process_group))), []


def _reduce_scatter(op: ReduceScatter, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    check_first_dim_divisible("ReduceScatter", x, op.tp_size)
    return (x if op.tp_size == 1 else ReduceScatterSeq.apply(x, tp_group(op.process_group))), []


def _all_reduce(op: AllReduce, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    return (x if op.tp_size == 1 else AllReduceForward.apply(x, tp_group(op.process_group))), []


def _identity(op: Identity, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    return x, []


def _constant_scale(op: ConstantScale, x: torch.Tensor, extras: Extras, fp8: Optional[CompileKey]):
    check_tensor("ConstantScale", x)
    return x * op.scale, []


TRACED_FORWARDS: dict[type, Forward] = {
    BasicLinear: _linear,
    LayerNorm: _norm,
    RMSNorm: _norm,
    Bias: _bias,
    GELU: _gelu,
    ReLU: _relu,
    SwiGLU: _swiglu,
    **{cls: _torch_activation for cls in (SiLU, QGELU, SReLU, GLU, GEGLU, QGEGLU, ReGLU, SReGLU, ClampedSwiGLU, SiTUGLU)},
    MakeExtraOutput: _make_extra_output,
    AddExtraInput: _add_extra_input,
    Dropout: _dropout,
    Identity: _identity,
    ConstantScale: _constant_scale,
    AllGather: _all_gather,
    ReduceScatter: _reduce_scatter,
    AllReduce: _all_reduce,
}


def register_traced_forward(cls: type, forward: Forward) -> None:
    """Trace ops of exactly ``cls`` with ``forward`` (for ops defined outside ``tp_fuse.ops``,
    e.g. ``tp_fuse.layers``' TP-region ops). ``forward`` must compute what the op's eager
    forward computes, with differentiable torch ops whose gradients are the op's backward."""
    if not (isinstance(cls, type) and issubclass(cls, BasicOperation)):
        raise ValueError(f"register_traced_forward: expected a BasicOperation subclass, got {cls!r}")
    TRACED_FORWARDS[cls] = forward


def _linear_reason(op: BasicLinear, fp8: Optional[CompileKey]) -> Optional[str]:
    if op.debug_hooks is not None and op.debug_hooks.features_enabled:
        return "tp_fuse.debug features run its GEMMs (FP8 statistics alone are traced)"
    if op.accumulate_into_main_grad:
        return "accumulate_into_main_grad adds dW into weight.main_grad outside autograd"
    if isinstance(op.weight, Float8Tensor) or type(op.weight) not in (torch.Tensor, torch.nn.Parameter):
        return f"the weight is a {type(op.weight).__name__} (quantized_model_init or a subclass)"
    if fp8 is not None and not fp8.traced:
        return f"recipe {fp8.recipe} (only the per-tensor FP8 and the block-scaled recipes are traced)"
    if fp8 is not None and traced_gemms_auto():
        # A traced graph fixes FP8 or not per Linear; the choice is made per shape at run time.
        return "autocast(gemms='auto') chooses FP8 or high precision per GEMM shape at run time (eager)"
    if fp8 is not None and not HAVE_COMPILE_REFS:
        return "this torch has no opaque objects for custom ops (tp_fuse::fp8_cast needs them)"
    return None


def unsupported_reason(op: BasicOperation, fp8: Optional[CompileKey]) -> Optional[str]:
    """Why ``op`` cannot run in a traced fusion group under ``fp8``, or None when it can."""
    if type(op) not in TRACED_FORWARDS:
        return f"{type(op).__name__} has no traced forward"
    if isinstance(op, BasicLinear):
        return _linear_reason(op, fp8)
    if getattr(op, "cache_quantized_input", False):
        return f"{type(op).__name__}(cache_quantized_input=True) saves FP8 tensors for its backward"
    if isinstance(op, AddExtraInput) and op.in_place:
        return "AddExtraInput(in_place=True) writes into the caller's tensor"
    return None
