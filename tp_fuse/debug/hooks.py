"""Per-layer debug hooks that ``BasicLinear`` calls at its quantization points.

``BasicLinear.debug_hooks`` is None unless a :class:`~tp_fuse.debug.DebugSession` or
an :class:`~tp_fuse.debug.Fp8StatsCollector` was attached. It is a
:class:`LinearDebugHooks` with two independent parts:

* ``session`` -- the debug features configured for this layer (a ``DebugSession``),
  or ``uses_debug_api`` -- the layer's calls go to nvdlfw-inspect's
  ``debug_api.transformer_engine`` (:mod:`tp_fuse.debug.inspect_api`). When any is
  configured (``features_enabled``) the layer's fusions are rejected and its three
  GEMMs run here: :meth:`forward_gemm` / :meth:`backward_gemm` make the routing and
  GEMM calls of the feature API for every GEMM tensor.
* ``fp8_tap`` -- a passive observer of the FP8 casts the layer does anyway
  (``on_quantized``); it never changes numerics (see ``fp8_stats`` for the one
  fusion it turns off).

GEMM tensors (TE names): fprop ``y = x W^T`` takes ``activation`` and ``weight`` and
produces ``output``; dgrad ``dx = dy W`` takes ``gradient`` and ``weight`` and produces
``dgrad``; wgrad ``dW = dy^T x`` takes ``gradient`` and ``activation`` and produces
``wgrad``. A GEMM runs in FP8 when a recipe is in force, every feature's
``fp8_gemm_enabled`` allows it and no input was replaced by ``modify_tensor``;
the high-precision GEMMs are the exact expressions of the non-FP8 path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..quantization import BlockScalingQuantizer, active_autocast, fp8_gemm, is_quantized_tensor
from ..quantization.compile_ref import CompileRef
from .api_state import debug_api_initialized, layer_has_config
from .config import FeatureSpec

if TYPE_CHECKING:
    from .features.api import DebugFeature
    from .fp8_stats import Fp8StatsCollector
    from .session import DebugSession

__all__ = ["LinearDebugHooks"]

#: GEMM -> (first operand, second operand, output) tensor names.
GEMM_TENSORS = {
    "fprop": ("activation", "weight", "output"),
    "dgrad": ("gradient", "weight", "dgrad"),
    "wgrad": ("gradient", "activation", "wgrad"),
}


def _routing(result: Any, what: str) -> bool:
    """A routing call's answer as a bool (TE allows ``bool`` or ``(bool, next_iter)``)."""
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[0], bool):
            raise ValueError(f"{what}: expected bool or (bool, next_iteration), got {result!r}")
        return result[0]
    if isinstance(result, bool):
        return result
    raise ValueError(f"{what}: expected bool or (bool, next_iteration), got {result!r}")


class LinearDebugHooks:
    """Debug state of one ``BasicLinear``.

    Attributes:
        layer: the model layer the GEMM belongs to (``"layers.3"``).
        gemm_name: the GEMM within it (``"fc1"``; the op's ``comm_name`` when set).
        layer_name: ``f"{layer}.{gemm_name}"``, the name debug configs match.
        tp_group: the op's tensor-parallel group (passed to ``inspect_tensor``).
        session: debug session with features for this layer, or None.
        features: ``[(feature, spec)]`` configured for this layer.
        fp8_tap: FP8 statistics collector observing this layer's casts, or None.
    """

    def __init__(self, layer: str, gemm_name: str, tp_group: Optional[dist.ProcessGroup] = None) -> None:
        self.layer = layer
        self.gemm_name = gemm_name
        self.layer_name = f"{layer}.{gemm_name}" if layer else gemm_name
        self.tp_group = tp_group
        self.session: Optional["DebugSession"] = None
        self.features: list[tuple["DebugFeature", FeatureSpec]] = []
        self.fp8_tap: Optional["Fp8StatsCollector"] = None
        # Routed through nvdlfw-inspect's process-wide debug API (TE's entry point).
        self.uses_debug_api = False
        # How torch.compile'd graphs name these hooks (tp_fuse::fp8_cast's observer).
        self.compile_ref = CompileRef(self)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "compile_ref"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.compile_ref = CompileRef(self)  # a copy is observed as itself

    @property
    def features_enabled(self) -> bool:
        """Whether this layer has debug features (then it runs unfused, through here).

        Under nvdlfw-inspect: while the debug API is initialized and a config section
        selects this layer (read per call: ``end_debug`` or a new ``initialize`` apply to
        the next fusion decision and GEMM).
        """
        if self.uses_debug_api:
            return debug_api_initialized() and layer_has_config(self.layer_name)
        return bool(self.features)

    def use_debug_api(self) -> None:
        """Route this layer's feature calls through ``nvdlfw_inspect.api`` (ValueError if a
        ``DebugSession`` already gave it features: one configuration per layer)."""
        if self.session is not None:
            raise ValueError(f"{self.layer_name}: has DebugSession features; a layer takes either a "
                             "DebugSession or nvdlfw_inspect's debug API, not both")
        self.uses_debug_api = True

    # ---- passive FP8 observation (any path) --------------------------------

    def on_quantized(self, role: str, hp: torch.Tensor, q: torch.Tensor, quantizer: Any) -> None:
        """Called by ``BasicLinear`` after casting ``hp`` to ``q`` for role input/weight/grad_output."""
        tap = self.fp8_tap
        if tap is not None and tap.active:
            tap.record(self, role, hp, q, quantizer)

    # ---- feature routing ---------------------------------------------------

    def _iteration(self) -> int:
        if self.uses_debug_api:
            import nvdlfw_inspect.api as debug_api

            return debug_api.DEBUG_MANAGER._trainer_iteration_count
        assert self.session is not None
        return self.session.iteration

    def _api(self) -> Any:
        import nvdlfw_inspect.api as debug_api

        return getattr(debug_api, "transformer_engine")

    def _paused(self) -> bool:
        return self.session is not None and self.session.is_paused

    def _modify(self, gemm: str, tensor_name: str, tensor: torch.Tensor, quantizer: Any) -> Optional[torch.Tensor]:
        if self._paused():
            return None
        it = self._iteration()
        if self.uses_debug_api:
            api = self._api()
            on = _routing(api.modify_tensor_enabled(layer_name=self.layer_name, gemm=gemm, tensor_name=tensor_name,
                                                    iteration=it), f"modify_tensor_enabled({self.layer_name})")
            if not on:
                return None
            out = api.modify_tensor(layer_name=self.layer_name, gemm=gemm, tensor_name=tensor_name, tensor=tensor,
                                    default_quantizer=quantizer, iteration=it, out=None)
            return self._check_modified(out, tensor, "modify_tensor", gemm, tensor_name)
        chosen = None
        for feature, spec in self.features:
            cfg = spec.config_for(gemm, tensor_name)
            if cfg is None:
                continue
            what = f"{spec.name}.modify_tensor_enabled({self.layer_name}, {gemm}, {tensor_name})"
            if _routing(feature.modify_tensor_enabled(cfg, self.layer_name, gemm, tensor_name, it), what):
                if chosen is not None:
                    raise ValueError(
                        f"{self.layer_name}: features {chosen[1].name} and {spec.name} both modify "
                        f"{gemm}/{tensor_name}; at most one feature may modify a tensor"
                    )
                chosen = (feature, spec, cfg)
        if chosen is None:
            return None
        feature, spec, cfg = chosen
        out = feature.modify_tensor(cfg, self.layer_name, gemm, tensor_name, tensor, quantizer, it, None)
        return self._check_modified(out, tensor, f"{spec.name}.modify_tensor", gemm, tensor_name)

    def _check_modified(self, out: Any, tensor: torch.Tensor, what: str, gemm: str, tensor_name: str) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                f"{what}({self.layer_name}, {gemm}, {tensor_name}) returned "
                f"{type(out).__name__}, expected a tensor"
            )
        if out.shape != tensor.shape:
            raise ValueError(
                f"{what}({self.layer_name}, {gemm}, {tensor_name}) changed the shape "
                f"from {tuple(tensor.shape)} to {tuple(out.shape)}"
            )
        return out

    def _fp8_allowed(self, gemm: str) -> bool:
        if self._paused():
            return True
        it = self._iteration()
        if self.uses_debug_api:
            return _routing(self._api().fp8_gemm_enabled(layer_name=self.layer_name, gemm=gemm, iteration=it),
                            f"fp8_gemm_enabled({self.layer_name}, {gemm})")
        allowed = True
        for feature, spec in self.features:
            cfg = spec.config_for(gemm, None)
            if cfg is None:
                continue
            what = f"{spec.name}.fp8_gemm_enabled({self.layer_name}, {gemm})"
            allowed &= _routing(feature.fp8_gemm_enabled(cfg, self.layer_name, gemm, it), what)
        return allowed

    def _inspect(self, tensor_name: str, tensor: torch.Tensor, q: Optional[torch.Tensor], quantizer: Any) -> None:
        if self._paused():
            return
        it = self._iteration()
        if self.uses_debug_api:
            api = self._api()
            if _routing(api.inspect_tensor_enabled(layer_name=self.layer_name, tensor_name=tensor_name, iteration=it),
                        f"inspect_tensor_enabled({self.layer_name}, {tensor_name})"):
                api.inspect_tensor(layer_name=self.layer_name, tensor_name=tensor_name, tensor=tensor.detach(),
                                   rowwise_quantized_tensor=q, columnwise_quantized_tensor=None, quantizer=quantizer,
                                   iteration=it, tp_group=self.tp_group)
            return
        for feature, spec in self.features:
            cfg = spec.config_for(None, tensor_name)
            if cfg is None:
                continue
            what = f"{spec.name}.inspect_tensor_enabled({self.layer_name}, {tensor_name})"
            if _routing(feature.inspect_tensor_enabled(cfg, self.layer_name, tensor_name, it), what):
                feature.inspect_tensor(
                    cfg, self.layer_name, tensor_name, tensor.detach(), q, None, quantizer, it, self.tp_group
                )

    # ---- the debug GEMM path ------------------------------------------------

    def forward_gemm(
        self,
        op: Any,
        ctx: Any,
        x: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``BasicLinear.forward_gemm`` with feature calls (input already checked by the op)."""
        lead = x.shape[:-1]
        x2d = x.reshape(-1, op.in_features)
        autocast_state = active_autocast()
        qs = op.fp8_quantizers(x2d)  # None: FP8 off (or gemms="auto" keeps this shape in high precision)
        weight = op.weight
        w_hp = weight.dequantize() if is_quantized_tensor(weight) else weight.detach()
        fp8 = {g: qs is not None and self._fp8_allowed(g) for g in GEMM_TENSORS}

        # A Float8Tensor input (from a Quantize op) is used as is by FP8 GEMMs.
        x_hp = x2d.dequantize() if is_quantized_tensor(x2d) else x2d

        # modify_tensor for every (GEMM, tensor) whose tensor exists in forward.
        x_f = self._modify("fprop", "activation", x_hp, qs and qs["input"])
        w_f = self._modify("fprop", "weight", w_hp, qs and qs["weight"])
        w_d = self._modify("dgrad", "weight", w_hp, qs and qs["weight"])
        x_w = self._modify("wgrad", "activation", x_hp, qs and qs["input"])

        # Default FP8 casts, done in forward like the normal path (backward GEMMs use
        # the forward scales, and the amaxes join this step's forward reduction).
        x_fp8 = w_fp8 = None
        if (fp8["fprop"] and x_f is None) or (fp8["wgrad"] and x_w is None):
            if is_quantized_tensor(x2d):
                x_fp8 = x2d
            else:
                # Block-scaled: the column-wise copy (wgrad) is quantized from high precision too.
                x_fp8 = qs["input"].quantize(x2d.detach(), transpose=isinstance(qs["input"], BlockScalingQuantizer))
                autocast_state.track_forward(qs["input"])
                self.on_quantized("input", x_hp, x_fp8, qs["input"])
        if is_quantized_tensor(weight):
            # FP8 parameter: its own quantizer joins the reduction, as in the normal path.
            w_fp8 = weight
            if qs is not None and weight.quantizer is not None:
                autocast_state.track_forward(weight.quantizer)
        elif (fp8["fprop"] and w_f is None) or (fp8["dgrad"] and w_d is None):
            w_fp8 = qs["weight"].quantize(w_hp, transpose=isinstance(qs["weight"], BlockScalingQuantizer))
            autocast_state.track_forward(qs["weight"])
            self.on_quantized("weight", w_hp, w_fp8, qs["weight"])

        self._inspect("activation", x_hp, x_fp8, qs and qs["input"])
        self._inspect("weight", w_hp, w_fp8, qs and qs["weight"])

        a = _operand(x_f, x_fp8 if fp8["fprop"] else None, x_hp)
        b = _operand(w_f, w_fp8 if fp8["fprop"] else None, w_hp)
        y = self._gemm("fprop", a, b, out_dtype=x.dtype, bias=bias, residual=residual, out_features=op.out_features)
        self._inspect("output", y, None, None)

        if ctx.requires_grad:
            ctx.save_for_backward(
                _operand(x_w, x_fp8 if fp8["wgrad"] else None, x_hp),
                _operand(w_d, w_fp8 if fp8["dgrad"] else None, w_hp),
            )
        ctx.debug_fp8 = fp8
        ctx.fp8 = qs is not None
        if qs is not None:
            ctx.grad_quantizer = qs["grad_output"]
            ctx.grad_tracker = autocast_state.backward_tracker
        ctx.input_shape = x.shape
        return y.reshape(*lead, op.out_features)

    def backward_gemm(
        self,
        op: Any,
        ctx: Any,
        dy: torch.Tensor,
        *,
        grad_input_accumulate: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``BasicLinear.backward_gemm`` with feature calls."""
        x_op, w_op = ctx.saved_tensors
        fp8 = ctx.debug_fp8
        dy2d = dy.reshape(-1, op.out_features)
        grad_q = getattr(ctx, "grad_quantizer", None) if ctx.fp8 else None
        dy_d = self._modify("dgrad", "gradient", dy2d, grad_q)
        need_wgrad = op.weight.requires_grad
        dy_w = self._modify("wgrad", "gradient", dy2d, grad_q) if need_wgrad else None
        dy_fp8 = None
        if (fp8["dgrad"] and dy_d is None) or (need_wgrad and fp8["wgrad"] and dy_w is None):
            dy_fp8 = grad_q.quantize(dy2d, transpose=isinstance(grad_q, BlockScalingQuantizer))
            ctx.grad_tracker.track(grad_q)
            self.on_quantized("grad_output", dy2d, dy_fp8, grad_q)
        self._inspect("gradient", dy2d, dy_fp8, grad_q)

        a = _operand(dy_d, dy_fp8 if fp8["dgrad"] else None, dy2d)
        acc = None if grad_input_accumulate is None else grad_input_accumulate.reshape(-1, op.in_features)
        dx = self._gemm("dgrad", a, w_op, out_dtype=dy.dtype, residual=acc, out_features=op.in_features)
        self._inspect("dgrad", dx, None, None)
        dw = None
        if need_wgrad:
            a = _operand(dy_w, dy_fp8 if fp8["wgrad"] else None, dy2d)
            x_op = op.input_for_wgrad(ctx, x_op)
            dw = self._gemm("wgrad", a, x_op, out_dtype=dy.dtype, out_features=op.out_features)
            self._inspect("wgrad", dw, None, None)
        return dx.reshape(ctx.input_shape), op.finish_wgrad(dw)

    def _gemm(
        self,
        gemm: str,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        out_dtype: torch.dtype,
        out_features: int,
        bias: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One GEMM in the layout of ``BasicLinear`` (same expressions, same rounding).

        fprop: ``a [M, in] @ b[out, in]^T``; dgrad: ``a [M, out] @ b [out, in]``;
        wgrad: ``a [M, out]^T @ b [M, in]``.
        """
        a_fp8, b_fp8 = is_quantized_tensor(a), is_quantized_tensor(b)
        if a_fp8 != b_fp8:
            raise ValueError(
                f"{self.layer_name}/{gemm}: one operand is FP8 and the other high precision; a feature's "
                "modify_tensor must return the same kind for both operands (or disable FP8 for the GEMM)"
            )
        if a_fp8:
            if gemm == "fprop":
                y = fp8_gemm(a, b, out_dtype=out_dtype, bias=bias)
            elif gemm == "dgrad":
                y = fp8_gemm(a, b.transpose_fp8(), out_dtype=out_dtype)
            else:
                y = fp8_gemm(a.transpose_fp8(), b.transpose_fp8(), out_dtype=out_dtype)
            if residual is not None:
                y = y + residual.reshape(-1, out_features)
            return y
        if gemm == "fprop":
            if residual is not None:
                base = residual.reshape(-1, out_features)
                if bias is not None:
                    base = base + bias
                return torch.addmm(base, a, b.t())
            if bias is not None:
                return torch.addmm(bias, a, b.t())
            return a @ b.t()
        if gemm == "dgrad":
            return torch.addmm(residual, a, b) if residual is not None else a @ b
        return a.t() @ b


def _operand(modified: Optional[torch.Tensor], fp8: Optional[torch.Tensor], hp: torch.Tensor) -> torch.Tensor:
    """A GEMM operand: the feature's replacement, else the FP8 cast, else high precision."""
    if modified is not None:
        return modified
    if fp8 is not None:
        return fp8
    return hp
