"""``BasicLinear``: y = x W^T, in high precision or FP8."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..op import BasicOperation, OperationContext, require


class BasicLinear(BasicOperation):
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

    ``debug_hooks`` (None unless ``tp_fuse.debug`` attached a ``LinearDebugHooks``):
    its ``on_quantized`` observes every FP8 cast; when the layer has debug features
    (``features_enabled``) its GEMMs run through the hooks and fusions skip it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        userbuffers_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BasicLinear: {name} must be a positive int, got {value!r}")
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
        from ...quantization import OpQuantizers, make_fp8_parameter, model_init_recipe

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

    # ---- validation ------------------------------------------------------

    def check_input(self, x: torch.Tensor) -> None:
        """Shape and dtype checks, raised before any compute or communication.

        Runs on every call (twice in fused forwards): the messages are built only on
        failure.
        """
        weight = self.weight
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"BasicLinear: expected input with last dimension in_features={self.in_features}, "
                f"got shape {tuple(x.shape)}"
            )
        if x.dtype != weight.dtype:
            raise ValueError(f"BasicLinear: input dtype {x.dtype} does not match weight dtype {weight.dtype}")
        if x.device != weight.device:
            raise ValueError(f"BasicLinear: input on {x.device}, weight on {weight.device}")

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls in ``direction`` (for ``explain``):
        the FP8 casts and GEMMs under an FP8 recipe, none in high precision."""
        from ...quantization import active_autocast

        return ("quantize", "fp8_gemm") if active_autocast() is not None else ()

    # ---- quantization helpers (shared with fused ops) --------------------

    def fp8_quantizers(self) -> Optional[dict[str, Any]]:
        """This op's quantizers for the recipe in force, or None when FP8 is off."""
        from ...quantization import active_autocast

        state = active_autocast()
        if state is None:
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
        from ...quantization import active_autocast, is_quantized_tensor

        state = active_autocast()
        assert state is not None
        qs = self._quantizers.get(state.recipe, state.amax_reduction_group)
        if is_quantized_tensor(x2d):
            x_fp8 = x2d
        else:
            x_fp8 = qs["input"].quantize(x2d, transpose=ctx.requires_grad and self.weight.requires_grad)
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
            w_fp8 = qs["weight"].quantize(weight.detach(), transpose=ctx.requires_grad)
            state.track_forward(qs["weight"])
            if self.debug_hooks is not None:
                self.debug_hooks.on_quantized("weight", weight, w_fp8, qs["weight"])
        ctx.grad_quantizer = qs["grad_output"]
        ctx.grad_tracker = state.backward_tracker
        return x_fp8, w_fp8

    # ---- GEMMs (used by op_forward/op_backward and by fused ops) ---------

    def forward_gemm(
        self,
        ctx: OperationContext,
        x: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``y = x W^T (+ bias) (+ residual)``; saves what ``backward_gemm`` needs."""
        self.check_input(x)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if residual is not None:
            require(
                residual.shape == (*lead, self.out_features),
                f"BasicLinear: residual must have shape {(*lead, self.out_features)}, "
                f"got {tuple(residual.shape)}",
            )
        hooks = self.debug_hooks
        ctx.debug = hooks is not None and hooks.features_enabled
        if ctx.debug:
            # Debug features (tp_fuse.debug) make the feature API's calls around each GEMM.
            return hooks.forward_gemm(self, ctx, x, bias=bias, residual=residual)
        ctx.fp8 = self.fp8_quantizers() is not None
        if ctx.fp8:
            from ...quantization import fp8_gemm

            x_fp8, w_fp8 = self.quantize_operands(x2d, ctx)
            out_dtype = x.dtype
            y = fp8_gemm(x_fp8, w_fp8, out_dtype=out_dtype, bias=bias)
            if residual is not None:
                y = y + residual.reshape(-1, self.out_features)
            saved = (x_fp8, w_fp8)
        else:
            w = self.weight
            if residual is not None:
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
        return y.reshape(*lead, self.out_features)

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
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``dx = dy W (+ grad_input_accumulate)``, ``dW = dy^T x``."""
        if getattr(ctx, "debug", False):
            return self.debug_hooks.backward_gemm(self, ctx, dy, grad_input_accumulate=grad_input_accumulate)
        x_saved, w_saved = ctx.saved_tensors
        dy2d = dy.reshape(-1, self.out_features)
        acc = None
        if grad_input_accumulate is not None:
            acc = grad_input_accumulate.reshape(-1, self.in_features)
        if ctx.fp8:
            from ...quantization import fp8_gemm

            dy_fp8 = ctx.grad_quantizer.quantize(dy2d, transpose=self.weight.requires_grad)
            ctx.grad_tracker.track(ctx.grad_quantizer)
            if self.debug_hooks is not None:
                self.debug_hooks.on_quantized("grad_output", dy2d, dy_fp8, ctx.grad_quantizer)
            # dx[M, in] = dy[M, out] @ W[out, in]: _scaled_mm wants b as [in, out].
            dx = fp8_gemm(dy_fp8, w_saved.transpose_fp8(), out_dtype=dy.dtype)
            if acc is not None:
                dx = dx + acc
            dw = None
            if self.weight.requires_grad:
                x_saved = self.input_for_wgrad(ctx, x_saved)
                # dW[out, in] = dy^T[out, M] @ x[M, in]
                dw = fp8_gemm(dy_fp8.transpose_fp8(), x_saved.transpose_fp8(), out_dtype=dy.dtype)
        else:
            if acc is not None:
                dx = torch.addmm(acc, dy2d, w_saved)
            else:
                dx = dy2d @ w_saved
            dw = None
            if self.weight.requires_grad:
                dw = dy2d.t() @ self.input_for_wgrad(ctx, x_saved)
        return dx.reshape(ctx.input_shape), dw

    # ---- basic-op interface ------------------------------------------------

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        return self.forward_gemm(ctx, input_)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        dx, dw = self.backward_gemm(ctx, grad_output)
        return dx, (dw,)
