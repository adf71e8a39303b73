"""Which comm/GEMM overlap windows of a fusion group run overlapped under ``torch.compile``.

One decision, used both by the compiled path (``overlap.plan_windows``, at trace time) and
by ``tp_fuse.explain`` (its ``compile:`` lines), so that what explain reports is what the
graph does. Plain Python, no dynamo: ``explain`` must not load ``torch._dynamo``
(``tp_fuse/graph_breaks.py``), and ``overlap.py`` applies a dynamo decorator at import.

A *window* is a communication next to a GEMM in the group's basic ops:
``[AllGather, BasicLinear(, Bias)]`` (mode ``all_gather``), ``[BasicLinear(, Bias),
ReduceScatter]`` (``reduce_scatter``) or ``[BasicLinear(, Bias), AllReduce]``
(``all_reduce``). Under compile each is either ONE ``tp_fuse::ub_linear`` node (the eager
overlapped algorithm at graph run time; ``ub_linear_fp8`` under a per-tensor FP8 recipe) or
traced op by op -- a functional collective and a GEMM, correct but not overlapped -- and
then :attr:`CompileWindow.reason` says why.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from ..basic.all_gather import AllGather
from ..basic.all_reduce import AllReduce
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.reduce_scatter import ReduceScatter
from ..fused.userbuffers_backward_linear import UserbuffersBackwardLinear
from ..fused.userbuffers_forward_linear import UserbuffersForwardLinear
from ..fused.userbuffers_forward_linear_all_reduce import UserbuffersForwardLinearAllReduce
from ..op import op_display_name
from ...overlap.method import Collective
from ...quantization.compile_state import recipe_key

if TYPE_CHECKING:
    from ..op_group import OpGroup

__all__ = ["CompileWindow", "compile_windows", "structural_windows"]

@dataclasses.dataclass(frozen=True)
class CompileWindow:
    """One overlap window of a group and what ``torch.compile`` does with it."""

    start: int  # index of its first basic op
    length: int  # number of basic ops
    mode: Collective
    ops: str  # e.g. "AllGather[0]+BasicLinear[1]+Bias[2]"
    overlapped: bool  # comm and GEMM overlap in the compiled program
    how: str  # "ub_linear node", "eager fuser behind a graph break", "traced op by op"
    reason: str  # why not overlapped (or what overlaps it)

    def line(self) -> str:
        state = "overlapped" if self.overlapped else "NOT overlapped"
        return f"{self.ops} ({self.mode}): {state}, {self.how}: {self.reason}"


def structural_windows(ops: list[Any]) -> list[tuple[int, int, Collective]]:
    """``(start, length, mode)`` of every comm-next-to-GEMM window in the basic ops."""
    found = []
    for i, op in enumerate(ops):
        if isinstance(op, AllGather) and i + 1 < len(ops) and isinstance(ops[i + 1], BasicLinear):
            n = 3 if i + 2 < len(ops) and isinstance(ops[i + 2], Bias) else 2
            found.append((i, n, Collective.ALL_GATHER))
        elif isinstance(op, BasicLinear):
            k = i + 2 if i + 1 < len(ops) and isinstance(ops[i + 1], Bias) else i + 1
            if k < len(ops) and isinstance(ops[k], ReduceScatter):
                found.append((i, k - i + 1, Collective.REDUCE_SCATTER))
            elif k < len(ops) and isinstance(ops[k], AllReduce):
                found.append((i, k - i + 1, Collective.ALL_REDUCE))
    return found


def _record_reason(fuser: "OpGroup", direction: str, fusions: tuple[str, ...], first: str) -> Optional[str]:
    """The eager fuser's rejection reason for a window starting at basic op ``first``."""
    for r in fuser.fusion_log.records:
        if r.direction == direction and not r.fused and r.fusion in fusions and r.window.split(" ")[0] == first:
            return r.reason
    return None


def compile_windows(
    fuser: "OpGroup", recipe: Any, graph_break: Optional[str] = None
) -> list[CompileWindow]:
    """The group's overlap windows and, for each, whether it runs overlapped under compile.

    ``fuser`` has decided its fusions for ``recipe`` (the recipe in force; None: high
    precision). ``graph_break``: why the group is not traced (``fuser_path.trace_plan``), or
    None when it is traced into the caller's graph. A traced window is one ``ub_linear``
    node exactly when (the conditions ``overlap.plan_windows`` applies): its forward fused
    into a ``UserbuffersForwardLinear`` (high precision, or a per-tensor FP8 recipe:
    ``ub_linear_fp8``), its backward into a
    ``UserbuffersBackwardLinear`` over the same basic ops, and the forward saves only what
    the custom op's backward can rebuild (not ``save_gathered_input``); or its forward fused
    into a ``UserbuffersForwardLinearAllReduce`` and no backward op reaches
    outside the window (the all-reduce's backward is the identity: no overlap to keep).
    """
    ops = fuser.basic_ops
    forward = {idx[0]: (op, tuple(idx)) for op, idx in fuser.forward_ops}
    backward = {tuple(idx): op for op, idx in fuser.backward_ops if isinstance(op, UserbuffersBackwardLinear)}
    recipe_name = type(recipe).__name__ if recipe is not None else None
    out = []
    for start, n, mode in structural_windows(ops):
        fop, idx = forward.get(start, (None, ()))
        if isinstance(fop, (UserbuffersForwardLinear, UserbuffersForwardLinearAllReduce)):
            n = len(idx)  # the fused op's span (a mismatched Bias stays outside it)
        label = "+".join(op_display_name(op, start + j) for j, op in enumerate(ops[start:start + n]))

        def window(overlapped: bool, how: str, reason: str) -> CompileWindow:
            return CompileWindow(start, n, mode, label, overlapped, how, reason)

        fused = isinstance(fop, (UserbuffersForwardLinear, UserbuffersForwardLinearAllReduce))
        if not fused:
            why = _record_reason(
                fuser, "forward",
                ("fuse_userbuffers_forward_linear", "fuse_userbuffers_forward_linear_all_reduce"),
                op_display_name(ops[start], start),
            )
            how = "eager fuser behind a graph break" if graph_break else "traced op by op (functional collective + GEMM)"
            out.append(window(False, how, "the eager fuser does not fuse it either" + (f": {why}" if why else "")))
            continue
        if graph_break is not None:
            # The group runs through the eager fuser, whose fused op overlaps as in eager.
            out.append(window(True, "eager fuser behind a graph break", f"the group is not traced ({graph_break})"))
            continue
        traced = "traced op by op (functional collective + GEMM)"
        node = "one tp_fuse::ub_linear_fp8 node" if fop.fp8 else "one tp_fuse::ub_linear node"
        if fop.fp8 and not recipe_key(recipe).per_tensor:
            out.append(window(False, "traced op by op (FP8 casts + functional collective + FP8 GEMM)",
                              f"FP8 recipe {recipe_name}: tp_fuse::ub_linear_fp8 carries per-tensor FP8 operands "
                              "only (DelayedScaling, Float8CurrentScaling)"))
        elif isinstance(fop, UserbuffersForwardLinearAllReduce):
            straddling = [op for op, ix in fuser.backward_ops
                          if set(ix) & set(idx) and not set(ix) <= set(idx)]
            if straddling:
                out.append(window(False, traced, "its backward fuses with ops outside the window ("
                                  + ", ".join(type(op).__name__ for op in straddling) + ")"))
            else:
                out.append(window(True, node,
                                  "the eager GEMM+AllReduce forward runs inside it at graph run time; its "
                                  "backward (no communication) runs the eager backward ops of the same basic ops"))
        elif idx not in backward:
            why = _record_reason(fuser, "backward", ("fuse_userbuffers_backward_linear",),
                                 op_display_name(ops[start], start))
            out.append(window(False, traced, "its backward does not fuse into UserbuffersBackwardLinear over the "
                                             "same ops" + (f" ({why})" if why else "")))
        elif mode == Collective.ALL_GATHER and fop.plan.overlap.save_gathered_input:
            out.append(window(False, traced, "save_gathered_input: the forward keeps the gathered input, which "
                                             "ub_linear's backward does not rebuild"))
        else:
            out.append(window(True, node, "the eager userbuffers forward/backward run inside it at graph run time"))
    return out
