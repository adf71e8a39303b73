"""``wrap()``'s first step: which modules the plan and Megatron's duck typing select.

Every module is matched against ``exclude`` (the module and everything under it left as
it is; a plan entry for modules inside an excluded block still counts as matched), the
Megatron-core column/row interface (converted automatically) and the plan's globs
(``{glob: style}``). The result (:class:`Matched`) holds what to convert, each planned
module's plan entry as written (for messages), and the problems found: unknown styles,
a module matched by entries of different styles, styles on the wrong module type or
sizes, Megatron features not supported, MoE expert layers (one line), half of a
column/row pair excluded, plan entries and excludes that match nothing.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..sharding import tp_rank_and_size
from .checks import expert_problems
from .megatron import COLUMN_ATTRS, EXPERT_FLAGS, ROW_ATTRS, is_megatron, megatron_problems
from .plain import is_conv1d, plain_problems, style_name
from .plan_styles import FusedColumn
from .report import WrapReport

__all__ = ["STYLES", "NORM_STYLES", "Matched", "match_plan", "written"]

STYLES = ("column", "row", "sequence_parallel", "sharded_norm")
# Styles that keep or shard a norm: no GEMM, not a column/row pair member.
NORM_STYLES = ("sequence_parallel", "sharded_norm")


@dataclasses.dataclass
class Matched:
    """What :func:`match_plan` found.

    Attributes:
        megatron: ``{module name: "column" | "row"}``, Megatron-style layers.
        planned: ``{module name: style}``, plain modules named by the plan.
        entries: ``{module name: its plan entry as written}`` (``plan['glob'] = 'column'``).
        problems: one line each (not yet collapsed).
    """

    megatron: dict[str, str]
    planned: dict[str, Any]
    entries: dict[str, str]
    problems: list[str]

    @property
    def columns(self) -> list[str]:
        """Planned column projections (fused ones too)."""
        return [n for n, s in self.planned.items() if s not in ("row", *NORM_STYLES)]

    @property
    def rows(self) -> list[str]:
        return [n for n, s in self.planned.items() if s == "row"]

    @property
    def norms(self) -> list[str]:
        """Sharded norms: take a sharded input and give a sharded output (for the trace,
        column-like boundaries, not looked into, whose input must already be sharded)."""
        return [n for n, s in self.planned.items() if s == "sharded_norm"]


def match_plan(model: torch.nn.Module, plan: Mapping[str, Any], exclude: Sequence[str], tp_group: dist.ProcessGroup,
               sequence_parallel: Optional[bool], report: WrapReport, notes: Mapping[str, str],
               builtin_type: Optional[str]) -> Matched:
    """Match every module of ``model`` (see the module docstring); modules left as they are
    go into ``report.left`` (``notes``: a built-in plan's ``{glob: why replicated}``).
    ``builtin_type``: the family whose built-in plan this is (its names must match)."""
    _, tp = tp_rank_and_size(tp_group)
    problems: list[str] = []
    bad_styles = {g: s for g, s in plan.items() if not (isinstance(s, FusedColumn) or s in STYLES)}
    for glob, style in bad_styles.items():
        problems.append(f"plan[{glob!r}]: unknown style {style!r}; expected one of {STYLES} or "
                        f"FusedColumn(parts | sizes, names=..., head_dim=...)")

    megatron: dict[str, str] = {}
    experts: dict[str, list[str]] = {}
    planned: dict[str, Any] = {}
    entries: dict[str, str] = {}  # module name -> its plan entry as written, for messages
    matched_globs: set[str] = set()
    excluded_prefixes: list[str] = []
    # Excluded modules the plan would have sharded. (An excluded Megatron module keeps
    # Megatron's own TP, so its neighbours still agree with it.)
    excluded_gemms: list[str] = []
    for name, m in model.named_modules():
        label = name or "<root>"
        if any(name == p or name.startswith(p + ".") for p in excluded_prefixes):
            # A plan entry for modules inside an excluded block matches them (left as they
            # are): excluding the block a refusal names must not make its entries an error.
            matched_globs |= {g for g in plan if fnmatch.fnmatchcase(name, g)}
            continue
        if name and any(fnmatch.fnmatchcase(name, g) for g in exclude):
            excluded_prefixes.append(name)
            report.left.append((label, "excluded by the caller"))
            matched_globs |= {g for g in plan if fnmatch.fnmatchcase(name, g)}
            if any(fnmatch.fnmatchcase(name, g) and plan[g] not in NORM_STYLES for g in plan):
                excluded_gemms.append(name)
            continue
        kind = ("column" if is_megatron(m, COLUMN_ATTRS) else "row" if is_megatron(m, ROW_ATTRS) else None)
        matching = [g for g in plan if g not in bad_styles and fnmatch.fnmatchcase(name, g)]
        styles = {style_name(plan[g]): plan[g] for g in matching}
        matched_globs |= {g for g in plan if fnmatch.fnmatchcase(name, g)}
        if kind is not None:
            if styles:
                problems.append(f"{label}: Megatron-style {kind}-parallel module is converted automatically; "
                                f"remove it from the plan")
            megatron[name] = kind
            problems += megatron_problems(label, m, kind, tp_group, sequence_parallel)
            flags = [f for f in EXPERT_FLAGS if getattr(m, f, False)]
            if flags:
                experts[label] = flags
        elif len(styles) > 1:
            problems.append(f"{label}: matched by plan entries with different styles {sorted(styles)}")
        elif styles:
            planned[name] = next(iter(styles.values()))
            glob = next(g for g in matching if style_name(plan[g]) in styles)
            entries[name] = f"plan[{glob!r}] = {written(plan[glob])}"
            problems += plain_problems(label, m, planned[name], tp)
        elif type(m) is torch.nn.Linear or is_conv1d(m):
            report.left.append((label, "not named by the plan: replicated, runs unsharded"))
        if name == "" and (kind is not None or name in planned):
            problems.append("<root>: the root module itself cannot be replaced in place; wrap its parent")
    problems += expert_problems(experts)
    # What the family plan leaves replicated on purpose (MoE experts).
    report.left += [(n, why) for glob, why in notes.items() for n, _ in model.named_modules()
                    if fnmatch.fnmatchcase(n, glob) and not any(n == p or n.startswith(p + ".")
                                                                 for p in excluded_prefixes)]
    problems += split_pair_problems(excluded_gemms, [n for n, s in planned.items() if s not in NORM_STYLES])
    unmatched = [g for g in plan if g not in matched_globs]
    if builtin_type is not None and plan and len(unmatched) == len(plan):
        problems.append(f"{builtin_type}: no module matches the built-in plan, whose names are those of the "
                        f"*ForCausalLM model (e.g. {next(iter(plan))!r}); this is {type(model).__name__} (a model "
                        f"without its LM head?): wrap the *ForCausalLM model, or pass plan={{glob: style}} with this "
                        f"model's names")
    else:
        problems += [f"plan[{glob!r}]: matches no module" for glob in unmatched]
    for glob in exclude:
        if not any(fnmatch.fnmatchcase(n, glob) for n, _ in model.named_modules() if n):
            problems.append(f"exclude[{glob!r}]: matches no module")
    return Matched(megatron, planned, entries, problems)


def split_pair_problems(excluded: list[str], converted: list[str]) -> list[str]:
    """An excluded projection whose sibling is sharded: the pair no longer agrees on the
    per-rank sizes between them (e.g. a sharded ``q_proj`` feeding an unsharded ``o_proj``)."""
    problems = []
    for name in excluded:
        parent = name.rpartition(".")[0]
        siblings = [c for c in converted if c.rpartition(".")[0] == parent]
        if siblings:
            problems.append(f"exclude: {name} is excluded but its sibling(s) {siblings} are sharded; the "
                            f"tensor-parallel layers of one block are converted or left together: exclude "
                            f"{parent or '<root>'!s} instead")
    return problems


def written(style: Any) -> str:
    """A plan style as the user writes it in a plan (for messages)."""
    return repr(style) if isinstance(style, str) else style.written()
