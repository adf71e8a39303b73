"""What ``explain`` reports: the fusion decisions of a group or of a whole module, and why.

:class:`FuserExplanation` is one fuser's report, made from its decisions
(:meth:`FuserExplanation.from_fuser`): the forward and backward op lists after fusion and
every fusion decision -- windows that fused (with what the fused op does, e.g. which
overlap method a communication fusion uses) and windows that were considered and
rejected, each with its reason; per op that calls ``tp_fuse.kernels``, which path each
kernel would take (Triton or torch, and why), decided by ``kernels.planned_backend``
without running; and what ``torch.compile`` does with the group (traced, or a graph break
and why), with every comm/GEMM overlap window's fate there: overlapped (one
``tp_fuse::ub_linear`` node, or the eager fuser behind a graph break) or traced op by op
without overlap, and why (FP8 recipe, ``save_gathered_input``, ...). :class:`Explanation`
gathers them for a module.

These are data, below the fuser and ``Sequential`` that make them; the entry point
:func:`tp_fuse.ops.explain.explain`, which finds the groups of any module, sits above both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import kernels
from ..quantization.compile_state import recipe_key
from ..quantization.gemm_choice import decision_of
from .compiled.fuser_path import describe_fp8_linears, trace_plan
from .compiled.overlap_plan import CompileWindow, compile_windows
from .fusion import FusionRecord
from .op import FusibleOperation, op_display_name
from .op_group import OpGroup, current_recipe

__all__ = ["Explanation", "FuserExplanation", "KernelPlan", "op_kernels"]


def _describe_runs(runs) -> list[str]:
    out = []
    for op, idxs in runs:
        span = f"[{idxs[0]}]" if len(idxs) == 1 else f"[{idxs[0]}..{idxs[-1]}]"
        detail = op.fusion_summary() if hasattr(op, "fusion_summary") else ""
        out.append(op_display_name(op) + span + (f" ({detail})" if detail else ""))
    return out


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The path one ``tp_fuse.kernels`` call of one op would take."""

    direction: str  # "forward" | "backward"
    op: str  # e.g. "LayerNorm[0]"
    kernel: str  # e.g. "layernorm_fwd"
    backend: str  # "torch" | "triton"
    reason: str


def op_kernels(op: FusibleOperation, direction: str) -> tuple[str, ...]:
    """``tp_fuse.kernels`` functions ``op`` calls in ``direction``.

    Ops say so with ``kernels_used(direction)``; a fused op without its own list calls
    what its basic ops call.
    """
    own = getattr(op, "kernels_used", None)
    if own is not None:
        return tuple(own(direction))
    names: list[str] = []
    if op.is_fused_op:
        for basic in op.basic_op_list:
            names.extend(op_kernels(basic, direction))
    return tuple(dict.fromkeys(names))


def _kernel_target(fuser: OpGroup) -> tuple[torch.device, Optional[torch.dtype], str]:
    """Device and dtype the group's kernels will see: those of its parameters."""
    for op in fuser.basic_ops:
        for p in op.parameters():
            return p.device, p.dtype, str(p.device)
    # Nothing tells the device before a call; CPU is where tp_fuse runs without a GPU.
    return torch.device("cpu"), None, "cpu (assumed: the group has no parameters)"


def _plan_kernels(fuser: OpGroup, device: torch.device, dtype: Optional[torch.dtype]) -> list[KernelPlan]:
    plans = []
    for direction, runs in (("forward", fuser.forward_ops), ("backward", fuser.backward_ops)):
        for op, idxs in runs:
            span = f"[{idxs[0]}]" if len(idxs) == 1 else f"[{idxs[0]}..{idxs[-1]}]"
            for name in op_kernels(op, direction):
                choice = kernels.planned_backend(name, device, dtype)
                plans.append(KernelPlan(direction, op_display_name(op) + span, name, choice.backend, choice.reason))
    return plans


def _compile_plan(fuser: OpGroup, recipe: Any, device: torch.device) -> tuple[str, list[CompileWindow]]:
    """What ``torch.compile`` does with this group under ``recipe`` (see ``ops/compiled``):
    the ``compile:`` line, and each comm/GEMM overlap window's fate (overlapped as one
    ``tp_fuse::ub_linear`` node, or traced without overlap and why) -- the decision the
    compiled path itself takes (``overlap_plan.compile_windows``)."""
    key = recipe_key(recipe)
    reason = trace_plan(fuser, key)
    windows = compile_windows(fuser, recipe, reason)
    if reason is None:
        line = "traced into the caller's graph as basic ops (no fused ops: inductor fuses)"
        if any(w.overlapped for w in windows):
            line = ("traced into the caller's graph as basic ops (inductor fuses), overlap windows as "
                    "tp_fuse::ub_linear nodes")
        fp8_line = describe_fp8_linears(fuser, key, device)
        return line if fp8_line is None else f"{line}; {fp8_line}", windows
    return f"graph break, runs the eager fuser: {reason}", windows


def _fp8_gemm_lines(fuser: OpGroup) -> list[str]:
    """Per ``BasicLinear`` of the group that ran under ``autocast(gemms="auto")``: whether
    its GEMMs ran FP8 at the last shape, and why (the prior's rule or the measured ratio)."""
    lines = []
    for i, op in enumerate(fuser.basic_ops):
        decision = decision_of(op)
        if decision is not None:
            lines.append(f"{op_display_name(op)}[{i}]: {decision.describe()}")
    return lines


def _overlap_auto_lines(fuser: OpGroup) -> list[str]:
    """Decisions of the ``auto`` overlap stages of the group's fused ops (plans expose
    ``auto_lines()``), each GEMM stage once."""
    lines: list[str] = []
    for op, _ in (*fuser.forward_ops, *fuser.backward_ops):
        plan = getattr(op, "plan", None)  # a wgrad plan rides on its dgrad stage's choice
        for line in plan.auto_lines() if hasattr(plan, "auto_lines") else ():
            if line not in lines:
                lines.append(line)
    return lines


@dataclasses.dataclass
class FuserExplanation:
    """Fusion decisions of one :class:`OperationFuser`, and the kernel paths its ops take."""

    basic_ops: list[str]
    forward_ops: list[str]
    backward_ops: list[str]
    records: list[FusionRecord]
    recipe: Optional[str]
    kernels: list[KernelPlan] = dataclasses.field(default_factory=list)
    kernel_device: str = ""
    # ``method: auto`` overlap stages: candidates, measured times and the choice, per shape.
    overlap_auto: list[str] = dataclasses.field(default_factory=list)
    # ``autocast(gemms="auto")``: per Linear, FP8 or high precision at its last shape, and why.
    fp8_gemms: list[str] = dataclasses.field(default_factory=list)
    # What ``recipe`` is: "last forward" (what the group last ran) or "recipe in force".
    basis: str = "recipe in force"
    # Under torch.compile with this recipe: traced into the caller's graph, or why not.
    compile: str = ""
    # Under torch.compile: each comm/GEMM overlap window, overlapped or not and why.
    compile_windows: list[CompileWindow] = dataclasses.field(default_factory=list)

    @classmethod
    def from_fuser(cls, fuser: OpGroup, basis: str = "recipe in force") -> "FuserExplanation":
        recipe = fuser._fusion_recipe  # the recipe the fuser's current decisions were made for
        device, dtype, device_label = _kernel_target(fuser)
        compile_line, windows = _compile_plan(fuser, recipe, device)
        return cls(
            basic_ops=[op_display_name(op, i) for i, op in enumerate(fuser.basic_ops)],
            forward_ops=_describe_runs(fuser.forward_ops),
            backward_ops=_describe_runs(fuser.backward_ops),
            records=list(fuser.fusion_log.records),
            recipe=None if recipe is None else repr(recipe),
            kernels=_plan_kernels(fuser, device, dtype),
            kernel_device=device_label,
            overlap_auto=_overlap_auto_lines(fuser),
            fp8_gemms=_fp8_gemm_lines(fuser),
            basis=basis,
            compile=compile_line,
            compile_windows=windows,
        )

    def kernel_backends(self, kernel: Optional[str] = None) -> set[str]:
        """Backends the planned calls (of ``kernel``, or all) take, e.g. ``{"torch"}``."""
        return {p.backend for p in self.kernels if kernel is None or p.kernel == kernel}

    @property
    def fused(self) -> list[FusionRecord]:
        return [r for r in self.records if r.fused]

    @property
    def rejected(self) -> list[FusionRecord]:
        return [r for r in self.records if not r.fused]

    def lines(self) -> list[str]:
        lines = ["ops:      " + " ".join(self.basic_ops)]
        lines.append("forward:  " + " -> ".join(self.forward_ops))
        lines.append("backward: " + " -> ".join(self.backward_ops))
        for r in self.records:
            mark = "fused   " if r.fused else "rejected"
            tail = f": {r.reason}" if r.reason else ""
            lines.append(f"  {r.direction:8s} {mark} {r.fusion} on {r.window}{tail}")
        if self.kernels:
            lines.append(f"kernels:  on {self.kernel_device}")
            by_op: dict[tuple[str, str], list[str]] = {}
            for p in self.kernels:
                by_op.setdefault((p.direction, p.op), []).append(f"{p.kernel}={p.backend}")
            for (direction, op), calls in by_op.items():
                lines.append(f"  {direction:8s} {op}: {' '.join(calls)}")
            for backend, reason in dict.fromkeys((p.backend, p.reason) for p in self.kernels):
                lines.append(f"  {backend}: {reason}")
        if self.fp8_gemms:
            lines.append("fp8 gemms (gemms=auto, last decision per Linear):")
            lines.extend(f"  {line}" for line in self.fp8_gemms)
        if self.overlap_auto:
            lines.append("overlap auto (median time per candidate, max over TP ranks):")
            lines.extend(f"  {line}" for line in self.overlap_auto)
        if self.compile:
            lines.append(f"compile:  {self.compile}")
            lines.extend(f"  overlap {w.line()}" for w in self.compile_windows)
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclasses.dataclass
class Explanation:
    """Fusion decisions of a whole module, group by group."""

    groups: list[tuple[str, Any]]  # (label, FuserExplanation | module description)
    recipe: Optional[str]
    # "last forward": outside autocast, the decisions (and recipe) of the last forward;
    # "recipe in force": inside autocast, or before the first forward (high precision).
    basis: str = ""

    @classmethod
    def from_groups(cls, groups: list[tuple[str, Any]]) -> "Explanation":
        """The explanation of ``groups`` (``(label, FuserExplanation | module description)``),
        headed by the recipe its fusers' decisions are for (the recipe in force when there is
        no fuser) and their basis."""
        fusers = [g for _, g in groups if isinstance(g, FuserExplanation)]
        if fusers:
            recipes = {f.recipe for f in fusers}
            bases = {f.basis for f in fusers}
            recipe_repr = recipes.pop() if len(recipes) == 1 else " / ".join(sorted(str(r) for r in recipes))
            basis = bases.pop() if len(bases) == 1 else "mixed: " + ", ".join(sorted(bases))
        else:
            recipe = current_recipe()
            recipe_repr, basis = (None if recipe is None else repr(recipe)), "recipe in force"
        return cls(groups, recipe_repr, basis)

    @property
    def fusers(self) -> list[FuserExplanation]:
        return [g for _, g in self.groups if isinstance(g, FuserExplanation)]

    @property
    def forward_ops(self) -> list[str]:
        return [op for f in self.fusers for op in f.forward_ops]

    @property
    def backward_ops(self) -> list[str]:
        return [op for f in self.fusers for op in f.backward_ops]

    @property
    def records(self) -> list[FusionRecord]:
        return [r for f in self.fusers for r in f.records]

    @property
    def kernels(self) -> list[KernelPlan]:
        return [p for f in self.fusers for p in f.kernels]

    @property
    def compile_windows(self) -> list[CompileWindow]:
        """Every overlap window and its fate under ``torch.compile``."""
        return [w for f in self.fusers for w in f.compile_windows]

    def __str__(self) -> str:
        header = f"FP8 recipe: {self.recipe}" if self.recipe else "FP8: off (high precision)"
        if self.basis:
            header += f" [{self.basis}]"
        out = [header]
        for label, group in self.groups:
            out.append(f"{label}:")
            if isinstance(group, FuserExplanation):
                out.extend("  " + line for line in group.lines())
            else:
                out.append(f"  {group} (not fusible: runs as a plain module and splits fusion groups)")
        return "\n".join(out)
