"""``explain``: what the fuser did with a model, and why.

For every group of fusible ops this reports the forward and backward op
lists after fusion and every fusion decision: windows that fused (with what
the fused op does, e.g. which overlap method a communication fusion uses) and
windows that were considered and rejected, each with its reason.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from .fusion import FusionRecord
from .op import op_display_name

if TYPE_CHECKING:
    from .fuser import OperationFuser


def _describe_runs(runs) -> list[str]:
    out = []
    for op, idxs in runs:
        span = f"[{idxs[0]}]" if len(idxs) == 1 else f"[{idxs[0]}..{idxs[-1]}]"
        detail = op.fusion_summary() if hasattr(op, "fusion_summary") else ""
        out.append(op_display_name(op) + span + (f" ({detail})" if detail else ""))
    return out


@dataclasses.dataclass
class FuserExplanation:
    """Fusion decisions of one :class:`OperationFuser`."""

    basic_ops: list[str]
    forward_ops: list[str]
    backward_ops: list[str]
    records: list[FusionRecord]
    recipe: Optional[str]

    @classmethod
    def from_fuser(cls, fuser: "OperationFuser") -> "FuserExplanation":
        from .fuser import _current_recipe

        recipe = _current_recipe()
        return cls(
            basic_ops=[op_display_name(op, i) for i, op in enumerate(fuser.basic_ops)],
            forward_ops=_describe_runs(fuser.forward_ops),
            backward_ops=_describe_runs(fuser.backward_ops),
            records=list(fuser.fusion_log.records),
            recipe=None if recipe is None else repr(recipe),
        )

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
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclasses.dataclass
class Explanation:
    """Fusion decisions of a whole module, group by group."""

    groups: list[tuple[str, Any]]  # (label, FuserExplanation | module description)
    recipe: Optional[str]

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

    def __str__(self) -> str:
        header = f"FP8 recipe: {self.recipe}" if self.recipe else "FP8: off (high precision)"
        out = [header]
        for label, group in self.groups:
            out.append(f"{label}:")
            if isinstance(group, FuserExplanation):
                out.extend("  " + line for line in group.lines())
            else:
                out.append(f"  {group} (not fusible: runs as a plain module and splits fusion groups)")
        return "\n".join(out)


def explain(module: torch.nn.Module) -> Explanation:
    """Explain the fusions of ``module`` under the FP8 recipe in force.

    ``module`` may be a :class:`~tp_fuse.ops.Sequential`, a single fusible op,
    or any module containing Sequentials (each is explained, labelled with its
    qualified name). Call it inside ``tp_fuse.autocast(...)`` to see the FP8
    fusions.
    """
    from .fuser import OperationFuser, _current_recipe
    from .op import FusibleOperation
    from .sequential import Sequential

    recipe = _current_recipe()
    recipe_repr = None if recipe is None else repr(recipe)
    if isinstance(module, Sequential):
        return Explanation(module.explain_groups(), recipe_repr)
    if isinstance(module, FusibleOperation):
        fuser = module.__dict__.get("_standalone_fuser") or OperationFuser([module])
        return Explanation([(type(module).__name__, fuser.explain())], recipe_repr)
    groups: list[tuple[str, Any]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, Sequential):
            groups.extend((f"{name}/{label}", g) for label, g in sub.explain_groups())
    if not groups:
        raise ValueError(
            f"explain: {type(module).__name__} contains no tp_fuse.ops.Sequential or fusible op"
        )
    return Explanation(groups, recipe_repr)
