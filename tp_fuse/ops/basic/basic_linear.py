"""``BasicLinear``: y = x W^T, in high precision or FP8.

Its concerns beside the GEMMs live next to it: the tensor-parallel setup (``linear_tp``),
the weight gradient and its deferral (``linear_wgrad``), the torch.compile trace
(``linear_compiled``). What stays here -- the FP8 operand casts and the forward and dgrad
GEMMs -- is over 500 lines on purpose: it shares one saved-context contract (what the
forward and its casts save is what the backward reads), which split across files would
have to be changed in two places."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from ...kernels import fp8_gemm_reads_views
from ...kernels._common import as_rows, as_shape
from ...quantization import (
    Float8Tensor,
    OpQuantizers,
    active_autocast,
    fp8_gemm,
    is_block_recipe,
    is_quantized_tensor,
    make_fp8_parameter,
    model_init_recipe,
)
from ...recipe import DelayedScaling, NVFP4BlockScaling
from ..extra_state import QuantizerStateMixin
from ..hooks import run_first_forward_hooks
from ..op import BasicOperation, OperationContext, require
from ._checks import maybe_dequantize
from . import linear_compiled
from .linear_tp import LinearTensorParallelMixin
from .linear_wgrad import DeferredWgradMixin, DeferredWgrads, WgradSink, wgrad_gemm

class BasicLinear(LinearTensorParallelMixin, DeferredWgradMixin, QuantizerStateMixin, BasicOperation):
    """Matrix multiply with a weight: ``y = x W^T`` (no bias; see ``Bias``).

    Shapes: ``x [..., in_features]``, ``W [out_features, in_features]``,
    ``y [..., out_features]``. Leading dimensions are flattened to ``M`` rows.

    Equations:
        forward: y  = x W^T
        dgrad:   dx = dy W
        wgrad:   dW = dy^T x

    Under ``tp_fuse.autocast`` the three GEMMs run in FP8 through
    ``torch._scaled_mm``: x and W are quantized with the forward format
    (E4M3 in HYBRID), dy with the backward format (E5M2 in HYBRID). Inside
    ``tp_fuse.quantized_model_init`` the weight itself is stored in FP8 with a
    high-precision master copy that the optimizer updates.

    ``userbuffers_options={"comm_name": "fc1"}`` names the GEMM for the
    communication-overlap configuration (Transformer Engine's convention).

    Tensor parallelism (Transformer Engine's arguments): ``tensor_parallel_mode="column"``
    splits W's rows (this rank holds ``[out/tp, in]``), ``"row"`` its columns
    (``[out, in/tp]``) over ``tensor_parallel_group``. The op then stands for the
    collectives around its GEMM (``expanded_ops()``): column with ``sequence_parallel``
    ``[AllGather, BasicLinear]``; row ``[BasicLinear, ReduceScatter]`` (sequence
    parallel) or ``[BasicLinear, AllReduce]``; column without sequence parallelism
    all-reduces dx in its backward. Unlike TE, ``in_features``/``out_features`` are the
    LOCAL GEMM sizes after construction (``global_in_features``/``global_out_features``
    keep the arguments).

    ``accumulate_into_main_grad=True`` (Transformer Engine's option, for Megatron-LM's
    ``gradient_accumulation_fusion``): dW is added into ``weight.main_grad`` (a buffer the
    caller, e.g. Megatron's DDP, attaches; overwritten instead when
    ``weight.overwrite_main_grad`` is True) by every backward, fused or not. When the
    weight has Megatron's ``grad_added_to_main_grad`` flag, it is set and a zero dummy
    wgrad is returned so that Megatron DDP's grad hooks still fire (and skip their own
    add); otherwise no wgrad is returned (``weight.grad`` stays None).

    ``delay_wgrad_compute=True`` (Transformer Engine's option, for pipeline schedules that
    split the backward pass): the backward pass computes dx only and keeps dW's operands
    (the quantized ones under FP8); :meth:`backward_dw` computes dW later and puts it where
    the backward pass would have (``weight.grad``, or ``weight.main_grad``), bit for bit
    (``tp_fuse.ops.basic.linear_wgrad``). Not with ``tp_fuse.debug`` features or the
    userbuffers backward overlap (ValueError).

    ``state_dict()`` carries the delayed-scaling state (scales, amax histories) in
    ``_extra_state`` as JSON in a uint8 tensor, and an FP8 weight as its master copy;
    see ``tp_fuse.ops.extra_state``.

    ``debug_hooks`` (None unless ``tp_fuse.debug`` attached a ``LinearDebugHooks``):
    its ``on_quantized`` observes every FP8 cast; when the layer has debug features
    (``features_enabled``) its GEMMs run through the hooks and fusions skip it.
    """

    # QuantizerRole.module_type of this op's quantizers (get_quantizer_roles).
    quantizer_module_type = "linear"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        userbuffers_options: Optional[dict[str, Any]] = None,
        accumulate_into_main_grad: bool = False,
        tensor_parallel_mode: Optional[str] = None,
        tensor_parallel_group: Optional[Any] = None,
        sequence_parallel: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        super().__init__()
        self._wgrad_sink = WgradSink("BasicLinear", "weight", accumulate_into_main_grad)
        self._deferred_wgrads = DeferredWgrads()
        self._deferred_wgrads.set_enabled("BasicLinear", delay_wgrad_compute)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BasicLinear: {name} must be a positive int, got {value!r}")
        in_features, out_features = self._setup_tensor_parallel(
            in_features, out_features, tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        )
        if userbuffers_options is not None and not isinstance(userbuffers_options, dict):
            raise ValueError(
                f"BasicLinear: userbuffers_options must be a dict like {{'comm_name': 'fc1'}}, "
                f"got {type(userbuffers_options).__name__}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.userbuffers_options = dict(userbuffers_options or {})
        # tp_fuse.debug state (a LinearDebugHooks); None costs one attribute check per GEMM.
        self.debug_hooks: Optional[Any] = None
        dtype = dtype or torch.get_default_dtype()
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        if init_method is None:
            # Same default as torch.nn.Linear, so swapping modules keeps training behaviour.
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)

        self._quantizers = OpQuantizers(("input", "weight", "grad_output"))
        recipe = model_init_recipe()
        if recipe is not None:
            quantizer = self._quantizers.get(recipe, None)["weight"]
            self.weight = make_fp8_parameter(weight, quantizer)
        else:
            self.weight = torch.nn.Parameter(weight)

    @property
    def comm_name(self) -> Optional[str]:
        return self.userbuffers_options.get("comm_name")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def pre_first_fuser_forward(self) -> None:
        """Join nvdlfw-inspect's debug API (TE's ``debug_api.initialize``) under this op's
        ``name`` attribute, when both are set; before the fusion decisions, which a layer
        with debug features must stay out of (``tp_fuse.debug.inspect_api``). The debug
        package registers that join into the op layer's hooks (``tp_fuse.ops.hooks``)."""
        run_first_forward_hooks(self)

    # ---- validation ------------------------------------------------------

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype, else the weight's: the fuser casts the input to it."""
        return autocast_dtype or self.weight.dtype

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight for a high-precision GEMM in ``dtype`` (itself when it matches;
        an FP8 weight dequantized, not converted as a parameter with its master)."""
        return weight_in_dtype(self.weight, dtype)

    def check_input(self, x: torch.Tensor) -> None:
        """Shape and device checks, raised before any compute or communication.

        The dtype is not checked: the fuser casts the input to :meth:`input_dtype`
        and the weight is cast to the input's dtype (:meth:`weight_in`).

        Runs on every call (twice in fused forwards): the messages are built only on
        failure.
        """
        weight = self.weight
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"BasicLinear: expected input with last dimension in_features={self.in_features}, "
                f"got shape {tuple(x.shape)}"
            )
        if x.device != weight.device:
            raise ValueError(f"BasicLinear: input on {x.device}, weight on {weight.device}")

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls in ``direction`` (for ``explain``):
        the FP8 casts and GEMMs under an FP8 recipe, none in high precision. Block-scaled
        recipes cast with ``block_quantize``, NVFP4 with ``nvfp4_quantize``; their GEMM
        (``block_gemm``) is not a ``tp_fuse.kernels`` function. Delayed scaling updates
        this op's scales with every other op's in one ``delayed_scale_update`` per
        direction."""
        state = active_autocast()
        if state is None:
            return ()
        if isinstance(state.recipe, NVFP4BlockScaling):
            return ("nvfp4_quantize",)
        if is_block_recipe(state.recipe):
            return ("block_quantize",)
        if isinstance(state.recipe, DelayedScaling):
            return ("quantize", "fp8_gemm", "delayed_scale_update")
        return ("quantize", "fp8_gemm")

    # ---- quantization helpers (shared with fused ops) --------------------

    def fp8_quantizers(self, x: Optional[torch.Tensor] = None, rows: Optional[int] = None) -> Optional[dict[str, Any]]:
        """This op's quantizers for the recipe in force, or None when its GEMMs run in high
        precision: FP8 off, or ``autocast(gemms="auto")`` finds FP8 not faster for GEMM input
        ``x`` (``rows``: the GEMM's M when it is not ``x``'s; see ``quantization.gemm_choice``)."""
        state = active_autocast()
        if state is None:
            return None
        if state.gemm_choice is not None and not state.gemm_choice.runs_fp8(self, x, rows, state):
            return None
        return self._quantizers.get(state.recipe, state.amax_reduction_group)

    def quantize_operands(self, x2d: torch.Tensor, ctx: OperationContext):
        """Quantize input and weight for an FP8 GEMM; register their amaxes.

        Returns ``(x_fp8, w_fp8)``. A Float8Tensor input (from a ``Quantize``
        op, or written by a norm in ``ForwardNormQuantizeLinear``) or an FP8
        weight (from ``quantized_model_init``) is used as is. When a backward
        will run, the cast kernel also writes the transposes the backward GEMMs
        read (x for wgrad, W for dgrad) in the same pass; they are held until
        the backward, as Transformer Engine holds its column-wise copies.
        """
        state = active_autocast()
        assert state is not None
        qs = self._quantizers.get(state.recipe, state.amax_reduction_group)
        # The backward GEMMs read transposed views where the GEMM takes any layout (the CPU
        # emulation): then no transposed bytes are written here.
        ctx.fp8_views = views = qs["input"].transposes_by_view and fp8_gemm_reads_views(x2d.device)
        if is_quantized_tensor(x2d):
            x_fp8 = x2d
        else:
            x_fp8 = qs["input"].quantize(x2d, transpose=ctx.requires_grad and self.weight.requires_grad and not views)
            state.track_forward(qs["input"])
            if self.debug_hooks is not None:
                self.debug_hooks.on_quantized("input", x2d, x_fp8, qs["input"])
        weight = self.weight
        if is_quantized_tensor(weight):
            # FP8 parameter (quantized_model_init): its bytes are re-quantized by
            # the optimizer step with its own quantizer, whose amax must join the
            # reduction so that its scale follows the weights as they grow.
            w_fp8 = weight
            if weight.quantizer is not None:
                state.track_forward(weight.quantizer)
        else:
            # Inside the fuser's forward grad mode is off: no detach (an op) needed there.
            w = weight.detach() if torch.is_grad_enabled() else weight
            copies = (ctx.requires_grad and not views, ctx.requires_grad and views)  # (transpose, keep decode)
            # A cast with a collective (current scaling's amax over a group) runs on every
            # micro-batch: whether a cached cast is still valid is decided per rank, and a
            # rank that skipped the cast would leave the others waiting in its all-reduce.
            cache = state.weight_cache if not qs["weight"].reduces_at_cast() else None
            if cache is None:
                w_fp8, cast_now = self._cast_weight(w, qs["weight"], *copies), True
            else:
                # Cast once per optimizer step; later micro-batches reuse it (FP8WeightCache).
                w_fp8, cast_now = cache.weight(self, weight, qs["weight"], copies,
                                               lambda recast: self._cast_weight(w, qs["weight"], *copies, recast))
            # Registered on a reuse too: its slot then says "no data" for this micro-batch.
            state.track_forward(qs["weight"])
            if cast_now and self.debug_hooks is not None:
                self.debug_hooks.on_quantized("weight", weight, w_fp8, qs["weight"])
        ctx.grad_quantizer = qs["grad_output"]
        ctx.grad_tracker = state.backward_tracker
        return x_fp8, w_fp8

    @staticmethod
    def _cast_weight(
        w: torch.Tensor, quantizer: Any, transpose: bool, keep_decoded: bool, recast: Any = None
    ) -> Float8Tensor:
        """The weight's FP8 cast (with its transposed bytes for the dgrad GEMM, or -- where
        the GEMM reads views -- its decode kept for the fprop and dgrad GEMMs); ``recast``:
        an ``FP8WeightCache`` window's first-cast state, which a later cast repeats."""
        if recast is None:
            w_fp8 = quantizer.quantize(w, transpose=transpose)
        else:
            w_fp8 = quantizer.recast_in_window(w, recast, transpose=transpose)
        if keep_decoded:
            w_fp8.keep_decoded()  # decoded once for the fprop and dgrad GEMMs
        return w_fp8

    # ---- GEMMs (used by op_forward/op_backward and by fused ops) ---------

    def forward_gemm(
        self,
        ctx: OperationContext,
        x: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None,
        alpha: float = 1.0,
        into_residual: bool = False,
    ) -> torch.Tensor:
        """``y = alpha x W^T (+ bias) (+ residual)``; saves what ``backward_gemm`` needs.

        ``into_residual``: the GEMM accumulates into ``residual``'s buffer and the
        result aliases it (``AddExtraInput(in_place=True)`` fused into the GEMM).
        ``alpha`` (``ConstantScale`` fused into the GEMM) is never combined with ``bias``.
        """
        assert alpha == 1.0 or bias is None, "the fused ops never scale a GEMM that has a bias"
        assert residual is not None or not into_residual
        self.check_input(x)
        lead = x.shape[:-1]
        x2d = as_rows(x, self.in_features)
        if residual is not None:
            require(
                residual.shape == (*lead, self.out_features),
                f"BasicLinear: residual must have shape {(*lead, self.out_features)}, "
                f"got {tuple(residual.shape)}",
            )
        assert not into_residual or residual is not None, "into_residual needs a residual"
        if into_residual and not residual.is_contiguous():
            # A strided buffer cannot take the 2-D GEMM view: compute out of place, then copy.
            y = self.forward_gemm(ctx, x, bias=bias, residual=residual)
            return residual.detach().copy_(y)
        hooks = self.debug_hooks
        ctx.debug = hooks is not None and hooks.features_enabled
        if ctx.debug:
            require(not self.delay_wgrad_compute,
                    "BasicLinear: delay_wgrad_compute=True is not supported with tp_fuse.debug features "
                    "(their GEMM hooks compute dW in the backward pass)")
            # Debug features (tp_fuse.debug) make the feature API's calls around each GEMM
            # (fusions skip debug layers, so no scale arrives here).
            assert alpha == 1.0
            y = hooks.forward_gemm(self, ctx, x, bias=bias, residual=residual)
            return residual.detach().copy_(y) if into_residual else y
        ctx.fp8 = self.fp8_quantizers(x2d) is not None
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if ctx.fp8:

            x_fp8, w_fp8 = self.quantize_operands(x2d, ctx)
            out_dtype = x.dtype
            y = fp8_gemm(x_fp8, w_fp8, out_dtype=out_dtype, bias=bias)
            if into_residual:
                y = _accumulate_in_place(residual, y, alpha)
            elif residual is not None:
                y = torch.add(residual.reshape(-1, self.out_features), y, alpha=alpha)
            elif alpha != 1.0:
                y = y.mul_(alpha)
            saved = (x_fp8, w_fp8)
        else:
            x2d = maybe_dequantize(x2d)
            w = self.weight_in(x2d.dtype)
            if into_residual:
                y = _addmm_in_place(residual, bias, x2d, w, alpha)
            elif residual is not None and alpha != 1.0:
                y = torch.addmm(residual.reshape(-1, self.out_features), x2d, w.t(), alpha=alpha)
            elif alpha != 1.0:
                y = torch.mm(x2d, w.t()).mul_(alpha)
            elif residual is not None:
                base = residual.reshape(-1, self.out_features)
                if bias is not None:
                    base = base + bias
                y = torch.addmm(base, x2d, w.t())
            elif bias is not None:
                y = torch.addmm(bias, x2d, w.t())
            else:
                y = x2d @ w.t()
            saved = (x2d, w)
        if ctx.requires_grad:
            ctx.save_for_backward(*saved)
        ctx.input_shape = x.shape
        # Transformer Engine's names for what a custom fused op reads back from this
        # context: the GEMM's compute dtype and whether it ran quantized.
        ctx.dtype = y.dtype
        ctx.with_quantized_compute = ctx.fp8
        return as_shape(y, (*lead, self.out_features))

    @staticmethod
    def input_for_wgrad(ctx: OperationContext, x_saved: torch.Tensor) -> torch.Tensor:
        """The wgrad GEMM's input: the saved input, or its all-gather when a fused op
        saved only this rank's sequence shard (``ctx.regather_input``, set by the
        tensor-parallel overlap fusion ``UserbuffersForwardLinear`` to keep activation
        memory at 1/tp; the unfused backward then gathers without overlap)."""
        regather = getattr(ctx, "regather_input", None)
        return x_saved if regather is None else regather(x_saved)

    def backward_gemm(
        self,
        ctx: OperationContext,
        dy: torch.Tensor,
        *,
        grad_input_accumulate: Optional[torch.Tensor] = None,
        alpha: float = 1.0,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``dx = alpha dy W (+ grad_input_accumulate)``, ``dW = alpha dy^T x``.

        ``alpha``: a following ``ConstantScale`` fused into both GEMMs (``BackwardLinearScale``).
        """
        if getattr(ctx, "debug", False):
            assert alpha == 1.0, "fusions skip debug layers"
            dx, dw = self.debug_hooks.backward_gemm(self, ctx, dy, grad_input_accumulate=grad_input_accumulate)
            return self.reduce_dgrad(dx), dw
        x_saved, w_saved = ctx.saved_tensors
        dy2d = as_rows(dy, self.out_features)
        acc = None
        if grad_input_accumulate is not None:
            acc = grad_input_accumulate.reshape(-1, self.in_features)
        if self._context_fp8(ctx):

            views = getattr(ctx, "fp8_views", False)
            dy_fp8, fresh = ctx.grad_quantizer.quantize_or_pass(
                dy2d, transpose=self.weight.requires_grad and not views
            )
            if fresh and views and self.weight.requires_grad:
                dy_fp8.keep_decoded()  # ours, transient: decoded once for the dgrad and wgrad GEMMs
            if fresh:
                ctx.grad_tracker.track(ctx.grad_quantizer)
            if fresh and self.debug_hooks is not None:
                self.debug_hooks.on_quantized("grad_output", dy2d, dy_fp8, ctx.grad_quantizer)
            # dx[M, in] = dy[M, out] @ W[out, in]: _scaled_mm wants b as [in, out].
            dx = fp8_gemm(dy_fp8, w_saved, dy.dtype, transpose_b=True)
            if acc is not None:
                dx = torch.add(acc, dx, alpha=alpha)
            elif alpha != 1.0:
                dx = dx.mul_(alpha)
            dw = None
            if self.weight.requires_grad:
                dw = self._weight_grad(dy_fp8, self.input_for_wgrad(ctx, x_saved), dy.dtype, alpha, fp8=True)
        else:
            if acc is not None:
                dx = torch.addmm(acc, dy2d, w_saved, alpha=alpha)
            elif alpha != 1.0:
                dx = torch.mm(dy2d, w_saved).mul_(alpha)
            else:
                dx = dy2d @ w_saved
            dw = None
            if self.weight.requires_grad:
                x_w = as_rows(self.input_for_wgrad(ctx, x_saved), self.in_features)
                dw = self._weight_grad(dy2d, x_w, dy2d.dtype, alpha, fp8=False)
        # dx has x's shape: the leading dims are dy's (a context filled by a third-party
        # fused op may not record ``input_shape``).
        input_shape = getattr(ctx, "input_shape", None) or (*dy.shape[:-1], self.in_features)
        # dx is this GEMM's output (or its all-reduce), referenced nowhere else.
        ctx.grad_input_fresh = True
        return self.reduce_dgrad(as_shape(dx, input_shape)), dw

    def _weight_grad(self, dy2d: torch.Tensor, x2d: torch.Tensor, out_dtype: torch.dtype, alpha: float, *,
                     fp8: bool) -> Optional[torch.Tensor]:
        """The weight's gradient for autograd: dW computed now (:meth:`finish_wgrad`), or --
        with ``delay_wgrad_compute`` -- the same computation queued for :meth:`backward_dw`
        with the operands it reads, and the sink's placeholder."""
        if not self._deferred_wgrads.enabled:
            return self.finish_wgrad(wgrad_gemm(dy2d, x2d, out_dtype, fp8=fp8, alpha=alpha))
        w, sink = self.weight, self._wgrad_sink
        self._deferred_wgrads.put(lambda: sink.deliver(w, wgrad_gemm(dy2d, x2d, out_dtype, fp8=fp8, alpha=alpha)))
        return sink.placeholder(w)

    def backward_dw(self) -> None:
        """Transformer Engine's ``backward_dw``: compute the weight gradient the oldest
        backward pass deferred (``delay_wgrad_compute=True``) and add it into
        ``weight.grad`` / ``weight.main_grad``; ValueError when none waits. Does nothing
        without ``delay_wgrad_compute`` (TE's)."""
        if self._deferred_wgrads.enabled:
            self._deferred_wgrads.run_next("BasicLinear.backward_dw()")

    @staticmethod
    def _context_fp8(ctx: OperationContext) -> bool:
        """Whether ``forward_gemm`` ran in FP8. A custom fused op may instead fill the
        context with Transformer Engine's names (``save_for_backward(x, w)``,
        ``with_quantized_compute``, ...): high precision is supported that way; FP8
        needs this op's own quantizer state, which such a context lacks."""
        fp8 = getattr(ctx, "fp8", None)
        if fp8 is not None:
            return fp8
        if getattr(ctx, "with_quantized_compute", False):
            raise ValueError(
                "BasicLinear backward: the context has with_quantized_compute=True but no tp_fuse FP8 "
                "state (ctx.fp8, ctx.grad_quantizer); a custom fused forward must call "
                "BasicLinear.forward_gemm to run the GEMM in FP8"
            )
        return False

    @property
    def accumulate_into_main_grad(self) -> bool:
        """Whether dW goes into ``weight.main_grad`` (see the class docs)."""
        return self._wgrad_sink.accumulate_into_main_grad

    @accumulate_into_main_grad.setter
    def accumulate_into_main_grad(self, value: bool) -> None:
        self._wgrad_sink.accumulate_into_main_grad = bool(value)

    def finish_wgrad(self, dw: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The weight gradient to return to autograd for a dW computed in the backward pass:
        ``dw`` in the weight's dtype, or -- with ``accumulate_into_main_grad`` -- None / a zero
        dummy after adding it into ``weight.main_grad``. Every backward (fused or not) passes
        its dW through here."""
        return self._wgrad_sink.finish(self.weight, dw)

    # ---- basic-op interface ------------------------------------------------

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        return self.forward_gemm(ctx, input_)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        dx, dw = self.backward_gemm(ctx, grad_output)
        return dx, (dw,)

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py; bodies in linear_compiled.py) -------
    compiled_forward = linear_compiled.compiled_forward
    compiled_folds_bias = linear_compiled.compiled_folds_bias
    compiled_unsupported = linear_compiled.compiled_unsupported


def _accumulate_in_place(residual: torch.Tensor, y2d: torch.Tensor, alpha: float) -> torch.Tensor:
    """``residual += alpha * y`` in ``residual``'s buffer; the result aliases it (2-D)."""
    out = residual.detach()  # autograd's version counter still sees the write
    out.add_(y2d.reshape(out.shape), alpha=alpha)
    return out.reshape(y2d.shape)


def _addmm_in_place(
    residual: torch.Tensor, bias: Optional[torch.Tensor], x2d: torch.Tensor, w: torch.Tensor, alpha: float
) -> torch.Tensor:
    """``residual (+ bias) + alpha x W^T`` written by the GEMM into ``residual``'s buffer
    (beta = 1 accumulation, no output-sized temporary); the result aliases it (2-D)."""
    out = residual.detach()
    if not out.is_contiguous():
        # The GEMM cannot write a strided 2-D view of this buffer: compute, then copy in.
        base = out.reshape(-1, w.shape[0]) if bias is None else out.reshape(-1, w.shape[0]) + bias
        out.copy_(torch.addmm(base, x2d, w.t(), alpha=alpha).reshape(out.shape))
        return out.reshape(-1, w.shape[0])
    out2d = out.view(-1, w.shape[0])
    if bias is not None:
        out2d.add_(bias)
    return out2d.addmm_(x2d, w.t(), alpha=alpha)


def weight_in_dtype(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight for a high-precision GEMM in ``dtype``: itself when it matches; an FP8
    weight dequantized (not converted as a parameter with its master)."""
    if w.dtype == dtype:
        return w

    if isinstance(w, Float8Tensor):
        return w.dequantize(dtype)
    return w.detach().to(dtype)

