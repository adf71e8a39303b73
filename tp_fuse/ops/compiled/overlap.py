"""Tensor-parallel comm/GEMM overlap windows inside compiled graphs, as custom ops.

The eager fuser replaces ``[AllGather, BasicLinear(, Bias)]`` and ``[BasicLinear(, Bias),
ReduceScatter]`` with the userbuffers fused ops (``UserbuffersForwardLinear`` /
``UserbuffersBackwardLinear``: AG+GEMM ring exchange, GEMM+RS pipelined or ring, dgrad +
reduce-scatter with the wgrad input re-gathered behind it), and ``[BasicLinear(, Bias),
AllReduce]`` with ``UserbuffersForwardLinearAllReduce`` (GEMM+AR pipelined by chunks; its
backward has no communication and stays the basic ops'). Traced op by op, such a window
would become a functional collective followed by a GEMM: correct, but no overlap. Here the
window is ONE graph node, ``tp_fuse::ub_linear``, whose real implementation runs the eager
fused op at graph run time (its P2P ring / pipeline over the ``TPOverlap``'s
``UserBufferPool``), and whose registered autograd formula calls ``tp_fuse::ub_linear_backward``,
which runs the eager backward window. Dynamo and inductor see opaque ops with fake
implementations; the overlap inside them is the eager algorithm, not decomposed.

Non-tensor state (the fused ops, their ``OverlapPlan``, process group, pool) is reached
through a :class:`~tp_fuse.quantization.compile_ref.CompileRef` to the BasicLinear's
:class:`OverlapWindowState` -- the way the FP8 casts reach their quantizers.

Which windows fuse is decided at TRACE time (:func:`plan_windows`, run as plain Python
through ``torch._dynamo.assume_constant_result``): the fuser's own eager fusion decision for
high precision. The overlap METHOD is not part of the graph: with ``method: auto`` the
TPOverlap's tuner measures the candidates at the window's first real run (inside the
opaque op, at graph run time, exactly as in eager) and afterwards reads its cached choice;
the graph is the same whichever method wins (the output shapes do not depend on it).

Scope: high precision here; under a per-tensor FP8 recipe the window is one
``tp_fuse::ub_linear_fp8`` node instead (``overlap_fp8.py``: the same eager fused ops with
FP8 GEMMs). Under a block-scaled recipe, or for a window the eager fuser would not fuse
(overlap disabled, ``save_gathered_input``, a backward that does not fuse over the same
ops or reaches outside the window), the window is traced op by op as before (functional
collectives: correct, not overlapped). ``tp_fuse.explain`` says so, window by window, with
the reason (``compile:`` lines): the decision is
:func:`~tp_fuse.ops.compiled.overlap_plan.compile_windows`, shared by :func:`plan_windows`
and explain.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional, Sequence

import torch

from ...overlap.method import Collective
from ...quantization.compile_ref import CompileRef
from ..basic.all_gather import AllGather
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.reduce_scatter import ReduceScatter
from ..fused.userbuffers_forward_linear import _regather
from ..op import FusibleOperation, OperationContext
from ..op_group import OpGroup
from .overlap_plan import compile_windows

__all__ = [
    "BackwardOpChain", "OverlapWindowState", "plan_windows", "ub_linear", "ub_linear_backward", "unaliased",
    "window_backward", "window_forward",
]


class OverlapWindowState:
    """Per-BasicLinear holder of its overlap window for compiled graphs.

    ``window``: ``(forward fused op, backward)`` -- the eager fuser's
    ``UserbuffersForwardLinear`` / ``UserbuffersBackwardLinear`` over the same basic ops, or
    ``UserbuffersForwardLinearAllReduce`` and the window's :class:`BackwardOpChain` -- set
    when a graph containing the window is traced. ``fp8_backward``: what the last FP8
    forward of the window bound for its backward (``overlap_fp8``), else None.
    ``compile_ref`` names this object in the custom-op calls (a graph input, so one graph
    could serve several layers).
    """

    def __init__(self) -> None:
        self.window: Optional[tuple[Any, Any]] = None
        self.fp8_backward: Optional[Any] = None
        self.compile_ref = CompileRef(self)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy is another layer: its own ref, and its window is decided when traced.
        self.window = None
        self.fp8_backward = None
        self.compile_ref = CompileRef(self)


def window_state(linear: BasicLinear) -> OverlapWindowState:
    """The BasicLinear's window holder, made at its first trace (plan_windows runs as plain
    Python, not traced): eager programs never build one, nor import this module."""
    state = linear.__dict__.get("_overlap_window")
    if state is None:
        state = linear.__dict__["_overlap_window"] = OverlapWindowState()
    return state


@torch._dynamo.assume_constant_result
def plan_windows(op_ids: tuple[int, ...]) -> tuple[tuple[int, int, str], ...]:
    """``((start, length, mode), ...)`` of the group's overlap windows, decided at trace time.

    Runs as plain Python (not traced): the fuser's eager fusion decision for the autocast
    state in force (the caller only asks under high precision). A window counts when its
    forward fused into ``UserbuffersForwardLinear`` and its backward into
    ``UserbuffersBackwardLinear`` over the same basic ops, and the forward keeps only what
    the custom op can rebuild (the input and the weight: not ``save_gathered_input``).
    Records the fused ops in each BasicLinear's :class:`OverlapWindowState`.
    """
    # A group of our own over the same ops (its decisions only: it never runs): the fuser
    # being traced may exist only in dynamo's trace (a Sequential builds its fusers at the
    # first call), not as an object.
    fuser = OpGroup([_live_op(i) for i in op_ids], expand=False)
    fuser.maybe_fuse()
    # The same decision explain reports (overlap_plan.compile_windows): never one without
    # the other. Windows it does not overlap are traced op by op, and explain says why.
    found = []
    for w in compile_windows(fuser, fuser._fusion_recipe):
        if w.overlapped:
            fwd, span = next((op, tuple(idx)) for op, idx in fuser.forward_ops if idx[0] == w.start)
            if w.mode == Collective.ALL_REDUCE:
                # No fused backward op: the eager backward ops inside the window (compile_windows
                # checked that none reaches outside it), in the fuser's order.
                linear = fwd.basic_ops[0]
                bwd: Any = BackwardOpChain(
                    list(fwd.basic_ops),
                    [(op, tuple(i - span[0] for i in idx)) for op, idx in fuser.backward_ops if idx[0] in span],
                )
            else:
                bwd = next(op for op, idx in fuser.backward_ops if tuple(idx) == span)
                linear = fwd.linear
            window_state(linear).window = (fwd, bwd)
            # The custom ops' schema takes the collective as a str: the plain spelling.
            found.append((w.start, w.length, w.mode.value))
    return tuple(found)


class BackwardOpChain:
    """The eager backward ops of a window that has no fused backward op, as one.

    The GEMM+AllReduce window ``[BasicLinear(, Bias), AllReduce]``: the all-reduce's
    backward is the identity and the linear's needs no communication, so the eager fuser
    runs the window's backward as its ordinary backward ops (``ops``: each with the indices
    of its basic ops within the window), which this runs in the fuser's (reverse) order
    with the fuser's bookkeeping: ``dx`` flows from op to op, parameter gradients are
    collected per basic op.
    """

    def __init__(self, basic_ops: list[Any], ops: list[tuple[Any, tuple[int, ...]]]) -> None:
        assert sorted(i for _, idx in ops for i in idx) == list(range(len(basic_ops))), "ops must cover the window"
        self.basic_ops = basic_ops
        self.ops = ops
        self.linear = next(op for op in basic_ops if isinstance(op, BasicLinear))

    def fuser_backward(
        self, ctxs: list[OperationContext], dy: torch.Tensor, *, basic_op_grad_extra_outputs: list[tuple]
    ) -> tuple[Optional[torch.Tensor], list[list[Optional[torch.Tensor]]], list[tuple]]:
        grads: list[list[Optional[torch.Tensor]]] = [[] for _ in self.basic_ops]
        dx: Optional[torch.Tensor] = dy
        for op, idx in reversed(self.ops):
            dx, op_grads, _ = op.fuser_backward(
                [ctxs[i] for i in idx], dx, basic_op_grad_extra_outputs=[basic_op_grad_extra_outputs[i] for i in idx]
            )
            for i, g in zip(idx, op_grads):
                grads[i] = list(g)
        return dx, grads, [() for _ in self.basic_ops]


def _live_op(op_id: int) -> Any:
    """The op whose ``id()`` is ``op_id``. Dynamo passes a constant-result function only
    constants, not modules, so the traced code passes ``id(op)``; the ops are alive (the
    group being traced holds them) and the result's type is checked."""
    op = ctypes.cast(op_id, ctypes.py_object).value
    if not isinstance(op, FusibleOperation):
        raise RuntimeError(f"plan_windows: id {op_id} is not a live FusibleOperation")
    return op


# ---- the custom ops ---------------------------------------------------------------------


def _contexts(fused: Any) -> list[OperationContext]:
    ctxs = [OperationContext() for _ in fused.basic_ops]
    for c in ctxs:
        c.requires_grad, c.dtype = True, None
    return ctxs


def _index(fused: Any, kind: type) -> Optional[int]:
    return next((i for i, op in enumerate(fused.basic_ops) if isinstance(op, kind)), None)


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _check_params(fused: Any, w: torch.Tensor, b: Optional[torch.Tensor]) -> None:
    # The eager fused op reads the module's parameters; the graph passes them as inputs.
    # They must be the same tensors, or the op would compute with other numbers than the
    # graph's autograd thinks (never silently: raise).
    linear = fused.basic_ops[_index(fused, BasicLinear)]
    bias_i = _index(fused, Bias)
    if not _same_data(w, linear.weight):
        raise RuntimeError("tp_fuse::ub_linear: the weight passed is not the BasicLinear's parameter")
    if (b is None) != (bias_i is None) or (b is not None and not _same_data(b, fused.basic_ops[bias_i].bias)):
        raise RuntimeError("tp_fuse::ub_linear: the bias passed is not the window's Bias parameter")


def window_forward(window: CompileRef, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                    where: str) -> tuple[torch.Tensor, OperationContext]:
    """Run the window's eager fused forward; ``(y, the BasicLinear's context)``."""
    fwd, _ = window.target().window
    _check_params(fwd, w, b)
    ctxs = _contexts(fwd)
    n = len(fwd.basic_ops)
    y, _ = fwd.fuser_forward(ctxs, x, basic_op_extra_inputs=[()] * n, basic_op_kwargs=[{}] * n)
    lin_ctx = ctxs[_index(fwd, BasicLinear)]
    if lin_ctx.to_save is None:
        raise RuntimeError(f"{where}: the fused forward saved nothing for backward")
    return y, lin_ctx


def window_backward(
    window: CompileRef, dy: torch.Tensor, saved: tuple[Any, Any], x_shape: Sequence[int], w: torch.Tensor,
    b: Optional[torch.Tensor], tp: int, mode: str, fp8: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the window's eager backward from the context its forward leaves: ``saved`` =
    (this rank's input as ``[rows, in]``, the weight), as plain or FP8 tensors; ``fp8``: the
    FP8 forward's ``(grad_quantizer, grad_tracker)`` binding (``overlap_fp8``), else None."""
    _, bwd = window.target().window
    _check_params(bwd, w, b)
    ctxs = _contexts(bwd)
    lin_i = _index(bwd, BasicLinear)
    lin_ctx = ctxs[lin_i]
    # The context the eager fused forward leaves (ub_linear checked it saved exactly these).
    lin_ctx.saved_tensors = tuple(saved)
    lin_ctx.fp8 = fp8 is not None
    if fp8 is not None:
        lin_ctx.grad_quantizer, lin_ctx.grad_tracker = fp8.grad_quantizer, fp8.grad_tracker
    if mode == Collective.ALL_GATHER:
        lin_ctx.input_shape = torch.Size((x_shape[0] * tp, *x_shape[1:]))
        lin_ctx.regather_input = functools.partial(_regather, _comm_group(bwd))
    else:
        lin_ctx.input_shape = torch.Size(x_shape)
    n = len(bwd.basic_ops)
    dx, grads, _ = bwd.fuser_backward(ctxs, dy, basic_op_grad_extra_outputs=[()] * n)
    dw = grads[lin_i][0]
    bias_i = _index(bwd, Bias)
    db = grads[bias_i][0] if bias_i is not None else None
    dw = torch.zeros_like(w) if dw is None else dw
    db = dy.new_empty(0) if db is None else db
    return dx.contiguous(), dw, db


def unaliased(outputs: Sequence[torch.Tensor], inputs: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """``outputs`` with a copy of each that shares storage with an input or an earlier
    output (a custom op's outputs may alias neither)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(t)
    return out


@torch.library.custom_op("tp_fuse::ub_linear", mutates_args=())
def ub_linear(
    x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], window: CompileRef, tp: int, mode: str
) -> torch.Tensor:
    """One tensor-parallel linear with its collective overlapped (the eager fused forward).

    ``mode="all_gather"`` (column-parallel, sequence parallel)::

        x [s/tp, ..., in]   W [out/tp, in]   b [out/tp]
        y [s, ..., out/tp] = all_gather(x) @ W^T + b       (ring exchange: the GEMM of
                                                            each block overlaps the next
                                                            block's P2P transfer)

    ``mode="reduce_scatter"`` (row-parallel)::

        x [s, ..., in/tp]   W [out, in/tp]   b [out]
        y [s/tp, ..., out] = reduce_scatter(x @ W^T + b)   (pipelined chunks or ring)

    ``mode="all_reduce"`` (row-parallel without sequence parallelism)::

        x [s, ..., in/tp]   W [out, in/tp]   b [out]
        y [s, ..., out]    = all_reduce(x @ W^T + b)       (pipelined chunks; b on every
                                                            rank before the sum, as eager)

    ``window``: the BasicLinear's :class:`OverlapWindowState` ref; ``tp``: the TP size.
    Method (``method: auto``: measured at the first run, then cached) and pool as eager.
    """
    y, lin_ctx = window_forward(window, x, w, b, "tp_fuse::ub_linear")
    saved = lin_ctx.to_save
    # What backward rebuilds: this rank's input (as [rows, in]) and the weight itself.
    if lin_ctx.fp8 or not (_same_data(saved[0], x.reshape(-1, x.shape[-1])) and _same_data(saved[1], w)):
        raise RuntimeError("tp_fuse::ub_linear: the fused forward saved other tensors than (x, W) "
                           "(FP8 under a graph traced for high precision?)")
    return unaliased([y], [x, w, b])[0]


@ub_linear.register_fake
def ub_linear_fake(x, w, b, window, tp, mode):
    rows = {Collective.ALL_GATHER: x.shape[0] * tp, Collective.REDUCE_SCATTER: x.shape[0] // tp}.get(mode, x.shape[0])
    return x.new_empty((rows, *x.shape[1:-1], w.shape[0]))


@torch.library.custom_op("tp_fuse::ub_linear_backward", mutates_args=())
def ub_linear_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], window: CompileRef, tp: int,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`ub_linear`: the eager ``UserbuffersBackwardLinear`` window.

    ``mode="all_gather"``: ``dy [s, ..., out/tp]``::

        dx [s/tp, ..., in] = reduce_scatter(dy @ W)     (dgrad GEMM overlapped with the
                                                         reduce-scatter; x re-gathered
                                                         behind it for wgrad)
        dW [out/tp, in]    = dy^T @ all_gather(x)
        db [out/tp]        = sum(dy)

    ``mode="reduce_scatter"``: ``dy [s/tp, ..., out]``::

        dy_full = all_gather(dy)                         (ring exchange with the dgrad GEMM)
        dx [s, ..., in/tp] = dy_full @ W;  dW = dy_full^T @ x;  db = sum(dy_full)

    ``mode="all_reduce"``: ``dy [s, ..., out]`` (the all-reduce's backward is the identity;
    the window's eager backward ops, :class:`BackwardOpChain`, no communication)::

        dx [s, ..., in/tp] = dy @ W;  dW = dy^T @ x;  db = sum(dy)

    Returns ``(dx, dW, db)``; ``db`` is empty (``[0]``) without a bias.
    """
    return window_backward(window, dy, (x.reshape(-1, x.shape[-1]), w), x.shape, w, b, tp, mode)


@ub_linear_backward.register_fake
def _ub_linear_backward_fake(dy, x, w, b, window, tp, mode):
    return torch.empty_like(x), torch.empty_like(w), (torch.empty_like(b) if b is not None else dy.new_empty(0))


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, w, b, window, tp, mode = inputs
    ctx.save_for_backward(x, w, b)
    ctx.window, ctx.tp, ctx.mode = window, tp, mode


def _backward(ctx: Any, dy: torch.Tensor):
    x, w, b = ctx.saved_tensors
    dx, dw, db = torch.ops.tp_fuse.ub_linear_backward(dy.contiguous(), x, w, b, ctx.window, ctx.tp, ctx.mode)
    return dx, dw, (db if b is not None else None), None, None, None


ub_linear.register_autograd(_backward, setup_context=_setup_context)


def _comm_group(fused: Any):
    comm = next(op for op in fused.basic_ops if isinstance(op, (AllGather, ReduceScatter)))
    return comm.process_group
