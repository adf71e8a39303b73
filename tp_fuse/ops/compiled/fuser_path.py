"""A fusion group under ``torch.compile``: traced as basic ops, or run eagerly behind a graph break.

``OperationFuser.__call__`` comes here while dynamo traces it. When every basic op has a
traced forward for the recipe in force (its ``compiled_forward`` method;
``basic.unsupported_reason``), the group is traced op by op -- the same order, dtype
casts, extra-tensor routing and output copies as the eager fuser, without its autograd
function -- and becomes part of the caller's graph: one graph for a whole
``TransformerLayer``, forward and backward. A ``Bias`` right after an FP8 ``BasicLinear``
on the CUDA path is traced as that GEMM's epilogue, as the eager fused Linear+Bias.
Otherwise the group runs through the eager fuser behind ``torch.compiler.disable``
(``tp_fuse.graph_breaks``) (a graph break, as before this path existed); :func:`trace_plan`
says why.

The recipe in force is read from ``compile_state.traced_key()`` (dynamo guards on it), not
from the autocast ``ContextVar``, which dynamo cannot read.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from ...quantization.compile_state import CompileKey, traced_key
from ...kernels import fp8_gemm_reads_views
from ...quantization.quantized_tensor import QuantizedTensor
from ..basic import AllGather, AllReduce, BasicLinear, Bias, ReduceScatter
from .basic import unsupported_reason
from .fp8_linear_cuda import cast_mode
from .overlap_plan import structural_windows

if TYPE_CHECKING:
    from ..fuser import OperationFuser
    from ..op_group import OpGroup

__all__ = ["compiled_call", "describe_fp8_linears", "trace_plan"]


def trace_plan(fuser: "OpGroup", fp8: Optional[CompileKey]) -> Optional[str]:
    """None when the group can be traced under ``fp8``, else the reason it cannot."""
    for i, op in enumerate(fuser.basic_ops):
        reason = unsupported_reason(op, fp8)
        if reason is not None:
            return f"{type(op).__name__}[{i}]: {reason}"
    return None


def describe_fp8_linears(fuser: "OpGroup", fp8: Optional[CompileKey], device: torch.device) -> Optional[str]:
    """How a traced group's per-tensor FP8 Linears cast and multiply on ``device`` (for
    ``explain``), or None without any: the CPU's exact emulation; on the CUDA path ATen
    casts (inductor fuses them) and ``torch._scaled_mm`` with the bias epilogue -- or the
    opaque ``tp_fuse::fp8_cast`` where a ``tp_fuse.debug`` observer reads the FP8 tensors."""
    linears = [(i, op) for i, op in enumerate(fuser.basic_ops) if type(op) is BasicLinear]
    if fp8 is None or not fp8.per_tensor or not linears:
        return None
    if fp8_gemm_reads_views(device):
        return "FP8 Linears: the CPU's exact emulation (tp_fuse::fp8_cast, emulated GEMMs traced)"
    track = ", tp_fuse::fp8_track joins the amax reduction" if fp8.recipe == "DelayedScaling" else ""
    parts = []
    for i, op in linears:
        if cast_mode(fp8, op.debug_hooks is not None) == "aten":
            parts.append(f"BasicLinear[{i}] casts as ATen ops (inductor fuses them){track}")
        else:
            parts.append(f"BasicLinear[{i}] casts with the opaque tp_fuse::fp8_cast (tp_fuse.debug observes its "
                         "FP8 tensors in Python)")
    return "; ".join(parts) + "; GEMMs torch._scaled_mm, bias as its epilogue"


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _unshared(outputs: list[torch.Tensor], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Copy an output that IS an input or an earlier output (``MakeExtraOutput``,
    ``Identity``): the eager fuser returns independent tensors there, so that a caller's
    in-place op on one cannot change another behind autograd's back."""
    seen: list[torch.Tensor] = [t for t in inputs if isinstance(t, torch.Tensor)]
    safe = []
    for t in outputs:
        if any(t is s for s in seen):
            t = t.clone()
        seen.append(t)
        safe.append(t)
    return safe


def _traced_forward(
    fuser: "OpGroup", input_: torch.Tensor, extra_inputs: Sequence[torch.Tensor], fp8: Optional[CompileKey]
) -> list[torch.Tensor]:
    routing = fuser.routing
    external = routing.place_external_inputs(extra_inputs)
    produced: list[list[torch.Tensor]] = []
    device_type = input_.device.type
    autocast_dtype = _autocast_dtype(device_type)
    # As in the eager fuser: ops pick their dtypes (input_dtype), torch.autocast stays off inside.
    no_autocast = torch.autocast(device_type, enabled=False) if autocast_dtype is not None else contextlib.nullcontext()
    x = input_
    # Overlap windows (high precision and per-tensor FP8): one tp_fuse::ub_linear(_fp8) node each (compiled/overlap.py).
    # Imported here, while dynamo traces: overlap.py applies a dynamo decorator at import,
    # and eager programs must not load torch._dynamo (tp_fuse/graph_breaks.py).
    from . import overlap_fp8  # noqa: F401  (registers tp_fuse::ub_linear_fp8)
    from .overlap import plan_windows

    # Asked only for groups with a comm op next to a GEMM: plan_windows takes the ops' ids,
    # which specializes the graph on them (one graph per layer); groups without a window (a
    # layer without tensor parallelism) keep one graph for all layers.
    windows = {}
    if (fp8 is None or fp8.per_tensor) and structural_windows(fuser.basic_ops):
        windows = {start: (n, mode) for start, n, mode in plan_windows(tuple(id(op) for op in fuser.basic_ops))}
    skip = 0
    with no_autocast:
        for i, op in enumerate(fuser.basic_ops):
            if skip:
                skip -= 1
                produced.append([])
                continue
            if i in windows:
                n, mode = windows[i]
                x = _overlap_window(fuser.basic_ops[i:i + n], x, mode, fp8)
                produced.append([])
                skip = n - 1
                continue
            want = op.input_dtype(autocast_dtype)
            if want is not None and x.dtype != want:
                x = x.to(want)  # differentiable: the gradient is cast back
            extras = [
                external[i][k] if src is None else produced[src[0]][src[1]]
                for k, src in enumerate(routing.input_sources[i])
            ]
            bias_op = _foldable_bias(fuser, i, x, fp8, autocast_dtype)
            if bias_op is not None:
                # The FP8 GEMM's bias epilogue, as the eager fused Linear+Bias.
                bias_op.check_input_spec((*x.shape[:-1], op.out_features), x.dtype, x.device)
                x, outs = op.compiled_forward(x, extras, fp8, bias=bias_op.bias)
                produced += [outs, []]
                skip = 1
                continue
            x, outs = op.compiled_forward(x, extras, fp8)
            produced.append(outs)
    return _unshared([x, *routing.public_outputs(produced)], (input_, *extra_inputs))


def _foldable_bias(
    fuser: "OpGroup", i: int, x: torch.Tensor, fp8: Optional[CompileKey], autocast_dtype: Optional[torch.dtype]
) -> Optional[Bias]:
    """The ``Bias`` right after the ``BasicLinear`` at ``i`` when the traced GEMM takes it
    as its epilogue (``BasicLinear.compiled_folds_bias``: per-tensor FP8 on the CUDA
    path), else None.
    Not when the bias would see another input dtype than the GEMM's output, or takes
    extra inputs."""
    ops = fuser.basic_ops
    op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
    if type(op) is not BasicLinear or type(nxt) is not Bias or fuser.routing.input_sources[i + 1]:
        return None
    if nxt.input_dtype(autocast_dtype) != x.dtype or not op.compiled_folds_bias(x, fp8):
        return None
    return nxt


def _overlap_window(ops: Sequence[Any], x: torch.Tensor, mode: str, fp8: Optional[CompileKey]) -> torch.Tensor:
    """``[AllGather, BasicLinear(, Bias)]``, ``[BasicLinear(, Bias), ReduceScatter]`` or
    ``[BasicLinear(, Bias), AllReduce]`` as one ``tp_fuse::ub_linear`` call (the eager
    overlapped algorithm at graph run time); ``tp_fuse::ub_linear_fp8`` under a per-tensor
    FP8 recipe (``fp8``: the key traced for)."""
    linear = next(op for op in ops if isinstance(op, BasicLinear))
    bias_op = next((op for op in ops if isinstance(op, Bias)), None)
    comm = next(op for op in ops if isinstance(op, (AllGather, ReduceScatter, AllReduce)))
    want = linear.input_dtype(_autocast_dtype(x.device.type))
    if want is not None and x.dtype != want:
        x = x.to(want)
    args = (x, linear.weight, None if bias_op is None else bias_op.bias, linear._overlap_window.compile_ref,
            comm.tp_size, mode)
    if fp8 is None:
        return torch.ops.tp_fuse.ub_linear(*args)
    return torch.ops.tp_fuse.ub_linear_fp8(*args, fp8.recipe, fp8.fwd_dtype)[0]


def compiled_call(
    fuser: "OperationFuser",
    input_: torch.Tensor,
    extra_inputs: Sequence[torch.Tensor],
    basic_op_kwargs: Optional[list[dict[str, Any]]],
):
    """``fuser(input_, *extra_inputs)`` while dynamo traces: traced when possible."""
    fp8 = traced_key()
    quantized = any(isinstance(t, QuantizedTensor) for t in (input_, *extra_inputs))
    with_kwargs = basic_op_kwargs is not None and any(basic_op_kwargs)
    if quantized or with_kwargs or trace_plan(fuser, fp8) is not None:
        # A graph break. Imported here, while dynamo traces: see tp_fuse/graph_breaks.py.
        from ...graph_breaks import eager_call

        return eager_call(fuser._eager_call, input_, *extra_inputs, basic_op_kwargs=basic_op_kwargs)
    outputs = _traced_forward(fuser, input_, extra_inputs, fp8)
    return outputs[0] if fuser.num_extra_outputs == 0 else tuple(outputs)
