"""``GroupedLinear``: one linear per group of rows, split sizes given at forward time (MoE)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any, Optional

import torch

from ...quantization import (
    OpQuantizers,
    QuantizerRole,
    active_autocast,
    fp8_gemm,
    is_quantized_tensor,
    make_fp8_parameter,
    model_init_recipe,
)
from ..extra_state import QuantizerStateMixin
from ..op import BasicOperation, OperationContext, require
from ._checks import compute_dtype, maybe_dequantize, param_dtype
from .basic_linear import weight_in_dtype
from .linear_wgrad import DeferredWgradMixin, DeferredWgrads, WgradSink, wgrad_gemm

__all__ = ["GroupedLinear", "GRAD_INPUT_BUFFER_KEY", "OUTPUT_BUFFER_KEY", "is_op_fuser_grouped_tensor_path_supported"]

_ROLES = ("input", "weight", "grad_output")


def is_op_fuser_grouped_tensor_path_supported(recipe: Any, dtype: torch.dtype) -> bool:
    """Transformer Engine's predicate for its graph-safe grouped-tensor GEMM path
    (cuBLASLt grouped GEMM on Hopper/Blackwell). tp_fuse has no such path: every
    configuration runs the split path (one GEMM per group), so this is always False."""
    return False


class GroupQuantizers:
    """One ``OpQuantizers(("input", "weight", "grad_output"))`` per group, seen as one.

    Role names are ``"input:i"``, ``"weight:i"``, ``"grad_output:i"``, ordered as
    Transformer Engine numbers a grouped linear's quantizers: forward ``2i`` input and
    ``2i + 1`` weight of group i, backward ``i`` grad_output of group i. Each group's
    quantizers are built for the plain roles, so recipes treat them as a linear's.
    """

    def __init__(self, num_groups: int) -> None:
        self.groups = [OpQuantizers(_ROLES) for _ in range(num_groups)]
        fwd = [f"{r}:{i}" for i in range(num_groups) for r in _ROLES[:2]]
        self.roles = tuple(fwd + [f"grad_output:{i}" for i in range(num_groups)])

    def get(self, recipe: Any, amax_reduction_group: Any = None) -> dict[str, Any]:
        out = {}
        for i, g in enumerate(self.groups):
            out.update({f"{r}:{i}": q for r, q in g.get(recipe, amax_reduction_group).items()})
        return out

    @property
    def quantizers(self) -> dict[str, Any]:
        return {f"{r}:{i}": q for i, g in enumerate(self.groups) for r, q in g.quantizers.items()}


#: ``Sequential(..., op_kwargs={grouped_linear: {OUTPUT_BUFFER_KEY: buf}})``: the forward
#: writes its output into ``buf`` (the caller's, same shape/dtype/device) and returns it.
OUTPUT_BUFFER_KEY = "output_buffer"
#: ``{GRAD_INPUT_BUFFER_KEY: buf}``: the backward writes the input gradient into ``buf``.
GRAD_INPUT_BUFFER_KEY = "grad_input_buffer"
_BUFFER_KEYS = (OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY)


def _caller_buffer(kwargs: dict[str, Any], key: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> Optional[torch.Tensor]:
    """The caller's buffer under ``key``, checked against the tensor it will hold."""
    buf = kwargs.get(key)
    if buf is None:
        return None
    ok = (isinstance(buf, torch.Tensor) and tuple(buf.shape) == tuple(shape) and buf.dtype == dtype
          and buf.device == device and buf.is_contiguous() and not buf.requires_grad)
    require(ok, f"GroupedLinear {key}: expected a contiguous tensor of shape {tuple(shape)}, dtype {dtype}, "
                f"on {device}, not requiring grad; got "
                + (f"shape {tuple(buf.shape)}, dtype {buf.dtype}, on {buf.device}, contiguous "
                   f"{buf.is_contiguous()}, requires_grad {buf.requires_grad}"
                   if isinstance(buf, torch.Tensor) else type(buf).__name__))
    return buf


class GroupedLinear(DeferredWgradMixin, QuantizerStateMixin, BasicOperation):
    r"""``num_groups`` linears over consecutive row groups: ``y_i = x_i W_i^T (+ b_i)``.

    Transformer Engine's op (experimental there too). Call ``y = op(x, split_sizes)``:
    the rows of ``x`` (leading dims flattened) are split into ``num_groups`` consecutive
    groups of ``split_sizes[i]`` rows (an int tensor or sequence, given at every call,
    e.g. tokens routed to each expert); each group gets its own weight ``weight{i}``
    ``[out, in]`` and bias ``bias{i}`` ``[out]`` (Transformer Engine's names).

    Shapes: ``x [..., in]`` with ``M = prod(leading dims) = sum(split_sizes)`` rows,
    ``y [..., out]``; ``scales [M]`` with ``scale_bias``.

    Equations, per group i (rows ``x_i [m_i, in]``, ``dy_i [m_i, out]``):
        forward: y_i  = x_i W_i^T + b_i               (``scale_bias``: + s_i[:, None] b_i)
        dgrad:   dx_i = dy_i W_i
        wgrad:   dW_i = dy_i^T x_i
                 db_i = sum_rows(dy_i)               (``scale_bias``: sum_rows(dy_i s_i[:, None]))
                 ds_i = dy_i b_i                      (``scale_bias`` only)

    Under ``tp_fuse.autocast`` every group's GEMMs run in FP8 with the group's own
    quantizers (any recipe a ``BasicLinear`` supports); an empty group runs no GEMM
    and gets zero weight and bias gradients. ``quantized_model_init`` stores each
    weight in FP8 with its master copy. ``accumulate_into_main_grad`` adds each dW into
    ``weight{i}.main_grad`` as ``BasicLinear`` does, and ``delay_wgrad_compute=True`` defers
    every group's dW to :meth:`backward_dw` as ``BasicLinear`` does (the bias gradients stay
    in the backward pass, as in Transformer Engine). Not supported (ValueError):
    ``single_grouped_weight``/``single_grouped_bias`` (Transformer Engine's experimental
    packed parameters).
    """

    num_extra_inputs: int = 1

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        rng_state_tracker_function: Optional[Callable[[], Any]] = None,
        accumulate_into_main_grad: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        delay_wgrad_compute: bool = False,
        scale_bias: bool = False,
    ) -> None:
        for name, v in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GroupedLinear: {name} must be a positive int, got {v!r}")
        for name, v in (
            ("single_grouped_weight", single_grouped_weight),
            ("single_grouped_bias", single_grouped_bias),
        ):
            if v:
                raise ValueError(f"GroupedLinear: {name}=True is not supported by tp_fuse (leave it False)")
        # Decided before BasicOperation.__init__: the fuser counts extra inputs per op.
        self._scale_bias = bool(scale_bias and bias)
        super().__init__()
        if self._scale_bias:
            self.num_extra_inputs = 2
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bool(bias)
        self.single_grouped_weight = self.single_grouped_bias = False
        self._wgrad_sinks = [WgradSink("GroupedLinear", f"weight{i}", accumulate_into_main_grad)
                             for i in range(num_groups)]
        self._deferred_wgrads = DeferredWgrads()
        self._deferred_wgrads.set_enabled("GroupedLinear", delay_wgrad_compute)
        self._rng_state_tracker_function = rng_state_tracker_function
        dtype = param_dtype("GroupedLinear", dtype)
        self._quantizers = GroupQuantizers(num_groups)
        recipe = model_init_recipe()
        # Packed as Transformer Engine allocates them; each group initialized like a
        # torch.nn.Linear (kaiming uniform), under the RNG tracker's fork when given.
        packed = torch.empty(num_groups, out_features, in_features, device=device, dtype=dtype)
        for i in range(num_groups):
            fork = rng_state_tracker_function().fork() if rng_state_tracker_function else contextlib.nullcontext()
            with fork:
                torch.nn.init.kaiming_uniform_(packed[i], a=math.sqrt(5))
            if recipe is not None:
                q = self._quantizers.groups[i].get(recipe, None)["weight"]
                weight = make_fp8_parameter(packed[i].clone(), q)
            else:
                weight = torch.nn.Parameter(packed[i])
            self.register_parameter(f"weight{i}", weight)
        for i in range(num_groups):
            b = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
            self.register_parameter(f"bias{i}", b)

    @property
    def has_bias(self) -> bool:
        return self.use_bias

    def backward_dw(self) -> None:
        """Transformer Engine's ``backward_dw``: every group's weight gradient of the oldest
        deferred backward pass, added into ``weight{i}.grad`` / ``.main_grad``. Does nothing
        without ``delay_wgrad_compute`` or when no backward pass is waiting (TE's
        ``GroupedLinear`` returns then, where its ``Linear`` raises)."""
        if self._deferred_wgrads.enabled and len(self._deferred_wgrads):
            self._deferred_wgrads.run_next("GroupedLinear.backward_dw()")

    def num_quantizers(self, mode: str) -> int:
        """Transformer Engine's count: 2 per group forward (input, weight), 1 backward."""
        return {"forward": 2 * self.num_groups, "backward": self.num_groups}.get(mode, 0)

    def get_quantizer_roles(self, mode: str) -> Optional[list[QuantizerRole]]:
        """Transformer Engine's roles: the linear pattern repeated per group, in
        ``get_quantizer`` order (forward: input, weight per group; backward: grad_output
        per group). Our per-group role names (``"input:0"``) carry the group index; the
        public role does not."""
        roles = super().get_quantizer_roles(mode)
        if roles is None:
            return None
        return [dataclasses.replace(r, module_type="linear", tensor_type=r.tensor_type.split(":")[0]) for r in roles]

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, scale_bias={self._scale_bias}"
        )

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_groups)]

    def biases(self) -> list[Optional[torch.Tensor]]:
        return [getattr(self, f"bias{i}") for i in range(self.num_groups)]

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype, else the weights': the fuser casts the input to it."""
        return autocast_dtype or self.weight0.dtype

    def kernels_used(self, direction: str) -> tuple[str, ...]:
        """``tp_fuse.kernels`` functions this op calls (for ``explain``)."""
        return ("quantize", "fp8_gemm") if active_autocast() is not None else ()

    def pre_first_fuser_forward(self) -> None:
        w0 = self.weight0
        for i, (w, b) in enumerate(zip(self.weights(), self.biases())):
            for name, p in ((f"weight{i}", w), (f"bias{i}", b)):
                if p is None:
                    require(
                        not self.use_bias or not name.startswith("bias"),
                        f"GroupedLinear: {name} is None but bias=True",
                    )
                    continue
                require(
                    p.dtype == w0.dtype and p.device == w0.device and p.requires_grad == w0.requires_grad,
                    f"GroupedLinear: {name} must match weight0 (dtype {w0.dtype}, device {w0.device}, "
                    f"requires_grad {w0.requires_grad}), got ({p.dtype}, {p.device}, {p.requires_grad})",
                )

    # ---- forward / backward ------------------------------------------------

    def _splits(self, split_sizes: Any, rows: int) -> list[int]:
        sizes = split_sizes.tolist() if isinstance(split_sizes, torch.Tensor) else list(split_sizes)
        require(
            len(sizes) == self.num_groups and all(isinstance(s, int) and s >= 0 for s in sizes),
            f"GroupedLinear: expected {self.num_groups} non-negative integer split sizes, got {sizes!r}",
        )
        require(
            sum(sizes) == rows,
            f"GroupedLinear: split sizes {sizes} sum to {sum(sizes)}, but the input has {rows} rows",
        )
        return sizes

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        ctx = basic_op_ctxs[0]
        require(
            input_.dim() >= 1 and input_.shape[-1] == self.in_features,
            f"GroupedLinear: expected input with last dimension in_features={self.in_features}, "
            f"got shape {tuple(input_.shape)}",
        )
        require(
            input_.device == self.weight0.device,
            f"GroupedLinear: input on {input_.device}, weights on {self.weight0.device}",
        )
        x2d = input_.reshape(-1, self.in_features)
        sizes = self._splits(basic_op_extra_inputs[0][0], x2d.shape[0])
        scales = None
        if self._scale_bias:
            scales = maybe_dequantize(basic_op_extra_inputs[0][1])
            require(
                scales.numel() == x2d.shape[0],
                f"GroupedLinear(scale_bias=True): scales must have one entry per row ({x2d.shape[0]}), "
                f"got shape {tuple(scales.shape)}",
            )
            scales = scales.reshape(-1)
        state = active_autocast()
        dtype = input_.dtype
        wgrad = ctx.requires_grad and self.weight0.requires_grad
        kwargs = basic_op_kwargs[0]
        unknown = sorted(set(kwargs) - set(_BUFFER_KEYS))
        require(not unknown, f"GroupedLinear: unknown op_kwargs {unknown}; expected {list(_BUFFER_KEYS)}")
        out_shape = (*input_.shape[:-1], self.out_features)
        out_buf = _caller_buffer(kwargs, OUTPUT_BUFFER_KEY, out_shape, dtype, x2d.device)
        grad_buf = _caller_buffer(kwargs, GRAD_INPUT_BUFFER_KEY, tuple(input_.shape), dtype, x2d.device)
        if out_buf is not None:
            y = out_buf.view(-1, self.out_features)  # groups write their rows straight into it
        else:
            y = torch.empty(x2d.shape[0], self.out_features, dtype=dtype, device=x2d.device)
        xs: list[Optional[torch.Tensor]] = []
        ws: list[Optional[torch.Tensor]] = []
        start = 0
        for i, (m, w, b) in enumerate(zip(sizes, self.weights(), self.biases())):
            xi, yi = x2d[start : start + m], y[start : start + m]
            bias = None
            if b is not None and not self._scale_bias:
                bias = b if b.dtype == dtype else b.to(dtype)
            if m == 0:
                xs.append(None)
                ws.append(None)
            elif state is not None:
                qs = self._quantizers.groups[i].get(state.recipe, state.amax_reduction_group)
                x8 = xi if is_quantized_tensor(xi) else qs["input"].quantize(xi, transpose=wgrad)
                if x8 is not xi:
                    state.track_forward(qs["input"])
                if is_quantized_tensor(w):
                    w8 = w  # FP8 parameter (quantized_model_init): its quantizer joins the reduction
                    if w.quantizer is not None:
                        state.track_forward(w.quantizer)
                else:
                    w8 = qs["weight"].quantize(w.detach(), transpose=ctx.requires_grad)
                    state.track_forward(qs["weight"])
                yi.copy_(fp8_gemm(x8, w8, out_dtype=dtype, bias=bias))
                xs.append(x8)
                ws.append(w8)
                ctx.grad_tracker = state.backward_tracker
            else:
                xi = maybe_dequantize(xi)
                wi = weight_in_dtype(w, dtype)
                if bias is not None:
                    torch.addmm(bias, xi, wi.t(), out=yi)
                else:
                    torch.mm(xi, wi.t(), out=yi)
                xs.append(xi)
                ws.append(wi)
            if self._scale_bias and m:
                yi.add_(scales[start : start + m, None].to(dtype) * b.to(dtype))
            start += m
        if ctx.requires_grad:
            ctx.save_for_backward(*xs, *ws, scales)
            ctx.sizes = sizes
            ctx.fp8 = state is not None
            ctx.input_shape = input_.shape
            ctx.scales_requires_grad = self._scale_bias and basic_op_extra_inputs[0][1].requires_grad
            ctx.grad_input_buffer = grad_buf
        if out_buf is not None:
            return out_buf, [()]
        return y.reshape(out_shape), [()]

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[list[Optional[torch.Tensor]]], list[tuple[Optional[torch.Tensor], ...]]]:
        ctx = basic_op_ctxs[0]
        g = self.num_groups
        saved = ctx.saved_tensors
        xs, ws, scales = saved[:g], saved[g : 2 * g], saved[2 * g]
        dy2d = grad_output.reshape(-1, self.out_features)
        dtype = grad_output.dtype
        wgrad = self.weight0.requires_grad
        grad_buf = getattr(ctx, "grad_input_buffer", None)
        if grad_buf is not None:
            require(grad_buf.dtype == dtype, f"GroupedLinear {GRAD_INPUT_BUFFER_KEY}: dtype {grad_buf.dtype}, but "
                                             f"the input gradient is {dtype}")
            dx = grad_buf.view(-1, self.in_features)  # groups write their rows straight into it
        else:
            dx = torch.empty(dy2d.shape[0], self.in_features, dtype=dtype, device=dy2d.device)
        dws: list[Optional[torch.Tensor]] = []
        # (weight, dy_i, x_i, fp8) of each group's wgrad GEMM: run now or by backward_dw.
        wgrad_work: list[tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], bool]] = []
        dbs: list[Optional[torch.Tensor]] = []
        dscales = None
        if ctx.scales_requires_grad:
            dscales = torch.empty(dy2d.shape[0], dtype=compute_dtype(dtype), device=dy2d.device)
        start = 0
        for i, (m, w, b) in enumerate(zip(ctx.sizes, self.weights(), self.biases())):
            dyi, dxi = dy2d[start : start + m], dx[start : start + m]
            if m == 0:
                wgrad_work.append((w, None, None, False))
            elif ctx.fp8:
                q = self._quantizers.groups[i].quantizers["grad_output"]
                dy8, fresh = q.quantize_or_pass(dyi, transpose=wgrad)
                if fresh:
                    ctx.grad_tracker.track(q)
                dxi.copy_(fp8_gemm(dy8, ws[i].transpose_fp8(), out_dtype=dtype))
                wgrad_work.append((w, dy8, xs[i], True))
            else:
                dyi = maybe_dequantize(dyi)
                torch.mm(dyi, ws[i], out=dxi)
                wgrad_work.append((w, dyi, xs[i], False))
            if b is not None:
                # Bias and scale gradients in float32 (float64 for float64): sums over rows.
                cdtype = compute_dtype(dtype)
                dyc = maybe_dequantize(dyi).to(cdtype)
                if self._scale_bias:
                    si = scales[start : start + m].to(cdtype)
                    db = (dyc * si[:, None]).sum(dim=0) if b.requires_grad else None
                    if dscales is not None:
                        dscales[start : start + m] = dyc @ b.to(cdtype)
                else:
                    db = dyc.sum(dim=0) if b.requires_grad else None
                dbs.append(None if db is None else db.to(b.dtype))
            start += m
        if wgrad:
            dws = self._weight_grads(wgrad_work, dtype)
        else:
            dws = [None] * g
        grad_params = dws + dbs
        grad_extra: tuple[Optional[torch.Tensor], ...] = (None,)
        if self._scale_bias:
            grad_extra = (None, None if dscales is None else dscales.to(scales.dtype))
        if grad_buf is not None:
            return grad_buf, [grad_params], [grad_extra]
        return dx.reshape(ctx.input_shape), [grad_params], [grad_extra]

    def _weight_grads(self, work: list[tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], bool]],
                      dtype: torch.dtype) -> list[Optional[torch.Tensor]]:
        """Each group's weight gradient for autograd: computed now (an empty group's is zero),
        or -- with ``delay_wgrad_compute`` -- queued for :meth:`backward_dw` and the sinks'
        placeholders (``BasicLinear``'s path, ``linear_wgrad``)."""

        def gemm(w: torch.Tensor, dy: Optional[torch.Tensor], x: Optional[torch.Tensor], fp8: bool) -> torch.Tensor:
            if dy is None:
                return torch.zeros(w.shape, dtype=w.dtype, device=w.device)
            return wgrad_gemm(dy, x, dtype, fp8=fp8)

        sinks = self._wgrad_sinks
        if not self._deferred_wgrads.enabled:
            return [sink.finish(item[0], gemm(*item)) for sink, item in zip(sinks, work)]

        def deferred() -> None:
            for sink, item in zip(sinks, work):
                sink.deliver(item[0], gemm(*item))

        self._deferred_wgrads.put(deferred)
        return [sink.placeholder(item[0]) for sink, item in zip(sinks, work)]

