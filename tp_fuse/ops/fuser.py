"""The operation fuser: runs a group of ops as one autograd function.

Fusion decisions are made at the first call and cached; they are made again
when the FP8 recipe in force changes (fused kernels differ per recipe).
Forward and backward are fused independently, so a basic op may belong to one
fused op in the forward pass and another in the backward pass. The group and the
decisions are :mod:`tp_fuse.ops.op_group`'s (below the compiled path, which reads them);
this module runs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Optional

import torch

from .channels import ChannelRouting
from .compiled.fuser_path import compiled_call
from .explanation import FuserExplanation
from .op import BasicOperation, FusibleOperation, OperationContext, check_sequence_length, register_standalone_fuser
from .op_group import OpGroup, OpRun, current_recipe
from .output_aliasing import aliasing_outputs, input_versions, outputs_safe_for_inplace
from ..quantization import Float8Tensor

def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """``torch.autocast``'s dtype for ``device_type``, or None when it is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# Reusable: nullcontext holds no state between uses.
_NULL_CONTEXT = contextlib.nullcontext()


def _no_torch_autocast(device_type: str, autocast_dtype: Optional[torch.dtype]) -> Any:
    """``torch.autocast(device_type, enabled=False)``, or nothing when autocast is off
    already (``autocast_dtype`` None): creating, entering and leaving it costs ~5 us,
    per op call. One instance serves a whole pass: it is re-entered by each op."""
    if autocast_dtype is None:
        return _NULL_CONTEXT
    return torch.autocast(device_type, enabled=False)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``; a Float8Tensor keeps its bytes and only changes its nominal
    dtype (the dtype it dequantizes to and GEMMs write)."""

    if isinstance(x, Float8Tensor):
        return Float8Tensor.from_parts(x._fp8, x._sinv, dtype)
    return x.to(dtype)


class _OperationFuserAutogradFunction(torch.autograd.Function):
    """Forward and backward of a fused op group, as one autograd node.

    Inputs: ``input_`` (the main input), the fuser, per-op kwargs, whether
    gradients are needed (ops skip saving tensors otherwise), then every
    basic op's parameters (flattened, so autograd tracks them), then the
    extra inputs the caller passes (flattened in op order; inputs fed by a
    named channel are not among them, see :mod:`tp_fuse.ops.channels`).

    Outputs: the main output, then the extra outputs returned to the caller.

    Backward returns the main input's gradient, each parameter's gradient as
    produced by its op's (possibly fused) backward, and each caller-passed extra
    input's gradient. Gradients of channel-fed inputs go to their producers.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        func_ctx: Any,
        input_: torch.Tensor,
        fuser: "OperationFuser",
        basic_op_kwargs: list[dict[str, Any]],
        requires_grad: bool,
        *params_and_extra_inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        basic_ops = fuser.basic_ops
        num_params = fuser.num_params
        extra_inputs = params_and_extra_inputs[num_params:]
        routing = fuser.routing
        basic_op_extra_inputs = routing.place_external_inputs(extra_inputs)
        device_type = input_.device.type
        autocast_dtype = _autocast_dtype(device_type)
        basic_op_ctxs = [OperationContext() for _ in basic_ops]
        for ctx in basic_op_ctxs:
            ctx.requires_grad = requires_grad
            ctx.dtype = autocast_dtype

        # TE's in-place ops may write into the caller's tensors: note their versions.
        versions = input_versions((input_, *extra_inputs)) if fuser.returns_aliases else None
        x = input_
        extra_outputs: list[Optional[tuple[torch.Tensor, ...]]] = [None] * len(basic_ops)
        # Per basic op, the dtype its input had before the fuser cast it (None: not
        # cast); the backward casts the input gradient back to it.
        cast_from: list[Optional[torch.dtype]] = [None] * len(basic_ops)
        # Ops choose their dtypes themselves (below); torch.autocast inside them would
        # re-cast GEMM operands behind their backward's back.
        no_autocast = _no_torch_autocast(device_type, autocast_dtype)
        channels = fuser.has_extra_tensors
        for op, idxs in fuser.forward_ops:
            if channels:
                routing.fill_channel_inputs(idxs, basic_op_extra_inputs, extra_outputs, requires_grad)
            want = basic_ops[idxs[0]].input_dtype(autocast_dtype)
            if want is not None and x.dtype != want:
                cast_from[idxs[0]] = x.dtype
                x = _cast(x, want)
            with no_autocast:
                x, fused_extra_outputs = op.fuser_forward(
                    [basic_op_ctxs[i] for i in idxs],
                    x,
                    basic_op_extra_inputs=[tuple(basic_op_extra_inputs[i]) for i in idxs],
                    basic_op_kwargs=[basic_op_kwargs[i] for i in idxs],
                )
            fused_extra_outputs = [tuple(outs) for outs in fused_extra_outputs]
            if len(fused_extra_outputs) != len(idxs):
                check_sequence_length(op, "extra-output tuples", fused_extra_outputs, len(idxs))
            for i, outs in zip(idxs, fused_extra_outputs):
                if len(outs) != basic_ops[i].num_extra_outputs:
                    check_sequence_length(basic_ops[i], "extra outputs", outs, basic_ops[i].num_extra_outputs)
                extra_outputs[i] = outs
            if channels:
                routing.check_produced(type(op).__name__, idxs, fused_extra_outputs)

        # Route saved tensors through autograd's ctx (version-counter checks).
        to_save: list[Optional[torch.Tensor]] = []
        ranges: list[tuple[int, int]] = []
        for ctx in basic_op_ctxs:
            start = len(to_save)
            if requires_grad and ctx.to_save is not None:
                # Autograd refuses to save inference tensors (e.g. parameters built
                # under torch.inference_mode, then trained): save normal copies.
                to_save.extend(
                    t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t
                    for t in ctx.to_save
                )
            ranges.append((start, len(to_save)))
            ctx.to_save = None
        func_ctx.save_for_backward(*to_save)
        func_ctx.saved_ranges = ranges
        func_ctx.fuser = fuser
        func_ctx.basic_op_ctxs = basic_op_ctxs
        func_ctx.cast_from = cast_from

        outputs = [x] + routing.public_outputs(extra_outputs)
        if versions is not None:
            return tuple(aliasing_outputs(func_ctx, outputs, (input_, *extra_inputs), versions))
        return tuple(outputs_safe_for_inplace(outputs, (input_, *params_and_extra_inputs)))

    @staticmethod
    def backward(func_ctx: Any, grad_output: torch.Tensor, *grad_extra_outputs: torch.Tensor):
        fuser: OperationFuser = func_ctx.fuser
        basic_ops = fuser.basic_ops
        basic_op_ctxs: list[OperationContext] = func_ctx.basic_op_ctxs
        saved = func_ctx.saved_tensors
        for ctx, (start, end) in zip(basic_op_ctxs, func_ctx.saved_ranges):
            ctx.saved_tensors = tuple(saved[start:end])

        routing: ChannelRouting = fuser.routing
        grad_extra_per_op = routing.place_output_grads(grad_extra_outputs)
        # Per channel name, the sum of its consumers' input gradients so far.
        channel_grads: dict[str, torch.Tensor] = {}

        grad_params: list[Optional[list[Optional[torch.Tensor]]]] = [None] * len(basic_ops)
        grad_extra_inputs: list[Optional[tuple]] = [None] * len(basic_ops)
        dx: Optional[torch.Tensor] = grad_output
        cast_from: list[Optional[torch.dtype]] = func_ctx.cast_from
        device_type = grad_output.device.type
        no_autocast = _no_torch_autocast(device_type, _autocast_dtype(device_type))
        channels = fuser.has_extra_tensors
        params_per_op = fuser.params_per_op
        # Whether dx is a buffer this backward allocated and nobody else references: an
        # op may then write its own gradient into it (OperationContext.grad_output_owned).
        # Not the incoming grad_output (the caller's dy, or another node's), and only
        # after a basic op that vouches for its result; never under create_graph (the
        # buffer may be in the graph being recorded). Why: CPU speed. Plain torch's
        # autograd frees fc2's saved activation before GELU's backward, which reuses that
        # warm buffer; this group frees its saved tensors only at its end, so GELU's
        # fresh [512, 1024] gradient came from memory glibc had returned to the OS and
        # was page-faulted in: 1.03 ms in the step against plain torch's 0.62 ms
        # (examples/bench_fuser_overhead.py; with MALLOC_TRIM_THRESHOLD_ and
        # MALLOC_MMAP_THRESHOLD_ set high both took 0.55 ms), most of the gap there.
        owned = False
        for op, idxs in reversed(fuser.backward_ops):
            if channels:
                routing.add_channel_grads(idxs, grad_extra_per_op, channel_grads)
            first_ctx = basic_op_ctxs[idxs[0]]
            basic_op_ctxs[idxs[-1]].grad_output_owned = owned
            first_ctx.grad_input_fresh = False
            with no_autocast:
                dx, fused_grad_params, fused_grad_extra_inputs = op.fuser_backward(
                    [basic_op_ctxs[i] for i in idxs],
                    dx,
                    basic_op_grad_extra_outputs=[tuple(grad_extra_per_op[i]) for i in idxs],
                )
            # A fused op returns what its own code makes of its basic ops' results: only a
            # basic op's word counts.
            owned = len(idxs) == 1 and first_ctx.grad_input_fresh and not torch.is_grad_enabled()
            back = cast_from[idxs[0]]
            if back is not None and dx is not None and dx.dtype != back:
                dx = _cast(dx, back)
            fused_grad_params = list(fused_grad_params)
            fused_grad_extra_inputs = list(fused_grad_extra_inputs)
            if len(fused_grad_params) != len(idxs) or len(fused_grad_extra_inputs) != len(idxs):
                check_sequence_length(op, "param-grad lists", fused_grad_params, len(idxs))
                check_sequence_length(op, "extra-input-grad tuples", fused_grad_extra_inputs, len(idxs))
            for i, gp, ge in zip(idxs, fused_grad_params, fused_grad_extra_inputs):
                gp, ge = list(gp), tuple(ge)
                if len(gp) != params_per_op[i] or len(ge) != basic_ops[i].num_extra_inputs:
                    check_sequence_length(basic_ops[i], "param grads", gp, params_per_op[i])
                    check_sequence_length(basic_ops[i], "extra-input grads", ge, basic_ops[i].num_extra_inputs)
                grad_params[i] = gp
                grad_extra_inputs[i] = ge
            if channels:
                routing.collect_channel_grads(idxs, fused_grad_extra_inputs, channel_grads)

        for ctx in basic_op_ctxs:
            ctx.saved_tensors = ()
        flat_params = [g for gp in grad_params for g in (gp or ())]
        flat_extra = routing.external_input_grads(grad_extra_inputs)
        return (dx, None, None, None, *flat_params, *flat_extra)


class OperationFuser(OpGroup):
    """Runs a list of fusible ops as one autograd function, with fusions.

    ``ops`` may contain fused containers (e.g. ``Linear``); they are
    flattened into basic ops. Fusion functions registered with
    ``register_forward_fusion``/``register_backward_fusion`` are applied in
    registration order; the result must cover the basic ops exactly and in
    order. The group and its fusion decisions are :class:`~tp_fuse.ops.op_group.OpGroup`'s;
    this class runs them (eagerly, or traced under ``torch.compile``).
    """

    def __init__(self, ops: Sequence[FusibleOperation], *, expand: bool = True) -> None:
        super().__init__(ops, expand=expand)
        self._first_call_done = False
        # (key, recipe) of the last forward: explain() outside autocast reports what ran.
        self._last_run: Optional[tuple[Any, Any]] = None

    # ---- Transformer Engine's attribute names (the same lists, not copies) ------

    @property
    def _basic_ops(self) -> list[BasicOperation]:
        return self.basic_ops

    @property
    def _forward_ops(self) -> list[OpRun]:
        """``(op, basic op indices)`` per op run in the forward pass, after fusion."""
        return self.forward_ops

    @property
    def _backward_ops(self) -> list[OpRun]:
        """The same for the backward pass (run in reverse order)."""
        return self.backward_ops

    @property
    def _basic_op_extra_input_sources(self) -> list[list[Optional[tuple[int, int]]]]:
        return self.routing.input_sources

    @property
    def _external_extra_input_slots(self) -> list[tuple[int, int]]:
        return self.routing.external_input_slots

    @property
    def _public_extra_output_slots(self) -> list[tuple[int, int]]:
        return self.routing.public_output_slots

    # ---- running --------------------------------------------------------

    def __call__(
        self,
        input_: torch.Tensor,
        *extra_inputs: torch.Tensor,
        basic_op_kwargs: Optional[list[dict[str, Any]]] = None,
    ):
        if torch.compiler.is_compiling():
            # Dynamo is tracing: the group becomes part of the caller's graph when its ops
            # can be traced (tp_fuse/ops/compiled), else it runs eagerly behind a graph break.
            self._check_call(input_, extra_inputs, basic_op_kwargs)
            return compiled_call(self, input_, extra_inputs, basic_op_kwargs)
        return self._eager_call(input_, *extra_inputs, basic_op_kwargs=basic_op_kwargs)

    def _check_call(
        self, input_: Any, extra_inputs: Sequence[Any], basic_op_kwargs: Optional[list[dict[str, Any]]]
    ) -> None:
        """ValueError for a call that does not fit this group (messages built on failure only)."""
        if not isinstance(input_, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor input, got {type(input_).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            names = ", ".join(
                f"{type(self.basic_ops[i]).__name__}[{i}]" for i, _ in self.routing.external_input_slots
            ) or "none"
            raise ValueError(
                f"expected {self.num_extra_inputs} extra input(s) (ops taking them: {names}), "
                f"got {len(extra_inputs)}"
            )
        if basic_op_kwargs is not None and len(basic_op_kwargs) != len(self.basic_ops):
            raise ValueError(
                f"basic_op_kwargs needs one dict per basic op ({len(self.basic_ops)}), "
                f"got {len(basic_op_kwargs)}"
            )

    def _eager_call(
        self,
        input_: torch.Tensor,
        *extra_inputs: torch.Tensor,
        basic_op_kwargs: Optional[list[dict[str, Any]]] = None,
    ):
        """The group as one autograd function (eager mode, or a graph break under compile)."""
        self._check_call(input_, extra_inputs, basic_op_kwargs)
        if basic_op_kwargs is None:
            basic_op_kwargs = [{} for _ in self.basic_ops]
        if not self._first_call_done:
            for op in self.basic_ops:
                op.pre_first_fuser_forward()
            self._first_call_done = True
        self.maybe_fuse()
        self._last_run = (self._fusion_key, self._fusion_recipe)

        params = self._parameters()
        if len(params) != self.num_params:
            raise RuntimeError(
                "parameters were added to or removed from an op after it was put in a fuser; "
                "build a new Sequential"
            )
        requires_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (input_, *params, *extra_inputs)
        )
        outputs = _OperationFuserAutogradFunction.apply(
            input_, self, basic_op_kwargs, requires_grad, *params, *extra_inputs
        )
        if self.num_extra_outputs == 0:
            return outputs[0]
        return outputs

    def _parameters(self) -> list[torch.Tensor]:
        """Every basic op's parameters in ``op.parameters()`` order, read every call
        (FSDP and users may swap a Parameter object between calls). Leaf ops -- all
        of tp_fuse's -- are read from ``_parameters`` directly: ``Module.parameters()``
        walks a generator chain per op (~3 us each)."""
        params: list[torch.Tensor] = []
        for op in self.basic_ops:
            if op._modules:
                params.extend(op.parameters())
            else:
                params.extend(p for p in op._parameters.values() if p is not None)
        return params

    def explain(self) -> FuserExplanation:
        """Fusion decisions, and which recipe they are for (``FuserExplanation.basis``).

        Inside ``autocast``: for the recipe in force (decided now if needed). Outside it,
        once the group has run: what its last forward ran, under that forward's recipe
        (e.g. FP8 when the forward ran in ``autocast`` and ``explain`` is called after
        it). Never run and no autocast: high precision.
        """
        if current_recipe() is None and self._last_run is not None:
            key, recipe = self._last_run
            self.maybe_fuse(recipe=recipe, key=key)
            return FuserExplanation.from_fuser(self, basis="last forward")
        self.maybe_fuse()
        return FuserExplanation.from_fuser(self, basis="recipe in force")


# A standalone op (``op(x)``) runs through an OperationFuser; op.py names it only here.
register_standalone_fuser(OperationFuser)
