"""``wrap()``: convert an existing model, in place, to tp-fuse's sharded layers.

Two kinds of modules are converted:

1. Modules with Megatron-core's tensor-parallel linear interface, found by duck typing
   (``megatron.core.tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear`` or
   anything with the same attributes): already sharded, they keep their very
   ``Parameter`` objects (optimizer state stays valid) and their flags
   (``gather_output``, ``skip_bias_add``, ``input_is_parallel``, ``sequence_parallel``),
   and still return ``(output, bias_or_None)``.

   * column: ``input_size, output_size, output_size_per_partition, gather_output,
     skip_bias_add, weight, bias``
   * row: ``input_size, output_size, input_size_per_partition, input_is_parallel,
     skip_bias_add, weight, bias``

   Sequence-parallel row biases keep Megatron's contract: their gradient is left as the
   per-rank partial sum, tagged ``sequence_parallel=True``, for Megatron's
   ``finalize_model_grads`` to all-reduce -- so gradients are the same as before.
   Also: a column layer with stride-2 weights (SwiGLU fc1, per rank ``[gate_r; up_r]``,
   recorded as ``ShardSpec(blocks=2)``), a column layer whose weight arrives at call time
   (tied output layer), ``gradient_accumulation_fusion`` (wgrads into ``main_grad``).

2. Plain ``nn.Linear`` / norm modules named by a ``plan`` ``{module-name glob: style}``:

   * ``"column"``: ``nn.Linear`` (or GPT-2 ``Conv1D``) -> column-parallel (output
     features split; the output's last dim is ``out/tp``);
   * ``FusedColumn(parts)``: a fused ``[q; k; v]``-style projection, each part split
     over the ranks separately (rank r holds ``[q_r; k_r; v_r]``); ``parts`` is a number
     of equal parts or the parts' sizes (Phi-3's GQA ``qkv_proj``), or head counts with
     ``head_dim`` (``tp_fuse.layers.wrap.plan_styles``);
   * ``"row"``: ``nn.Linear`` -> row-parallel (input's last dim is ``in/tp``; the
     output is reduced over TP, then the bias is added once);
   * ``"sequence_parallel"``: ``nn.LayerNorm`` / ``nn.RMSNorm`` kept as they are; with
     ``sequence_parallel=True`` their gradients are all-reduced over TP (they see only
     this rank's sequence shard).
   * ``"sharded_norm"``: an RMSNorm applied to a column-parallel output over ALL its
     features (OLMo2's ``q_norm`` / ``k_norm``, ``[heads * head_dim]``) ->
     ``ShardedRMSNorm``: its weight sharded like the features, its mean of squares summed
     over TP (``tp_fuse.layers.wrap.modules``). Only ``nn.RMSNorm`` and the Hugging Face
     RMSNorms of ``HF_RMS_NORMS`` (whose formula it reproduces); the trace checks that its
     input is TP-sharded. A per-head norm (Qwen3's, ``[head_dim]``) is NOT this: it stays
     replicated and its gradient is summed (found by the trace).

   The full weights of the plain modules must be identical on every TP rank (checked,
   collectively); each rank keeps its slice. New ``Parameter``s are made: build the
   optimizer after ``wrap``. Plain modules keep returning a single tensor.

Everything is validated before anything is changed: problems (a plan entry that matches
nothing or the wrong module type, sizes not divisible by the TP size, unsupported
Megatron features, a different TP group, weights differing across ranks) are reported
together in ONE ``ValueError``; nothing is skipped silently. Modules neither
Megatron-style nor named in the plan, and those matched by ``exclude``, are left
untouched (replicated); the :class:`WrapReport` lists them with the reason. With
``plan=None`` a Hugging Face model gets its family's plan (``tp_fuse.layers.wrap.hf_plans``); an
explicit plan for such a model keeps the family's checks and fix-ups.
The replacements keep the model's ``state_dict`` keys (``tp_fuse.layers.wrap.modules``).

Never silently wrong: replicated parameters used on TP-sharded activations are found by a
traced forward and get their gradient summed over TP (``tp_fuse.layers.wrap.trace``,
``tp_fuse.layers.wrap.passes``); head counts stored on converted attention modules are localized
and per-head module lists refused (``tp_fuse.layers.wrap.heads``); ties, MoE experts and the
error's shape (``tp_fuse.layers.wrap.checks``); fused projections cut by the model
(``tp_fuse.layers.wrap.fused_split``) and per-head tensors left whole
(``tp_fuse.layers.wrap.per_head``) are found by the same trace; by default (whenever it
shards anything) the wrapped model is compared with the original on a probe
(``tp_fuse.layers.wrap.verify_step``, ``tp_fuse.layers.wrap.verify``).

``fp8=recipe`` makes the model's forward run inside ``tp_fuse.autocast(recipe,
amax_reduction_group=fp8_group)`` (one autocast for the whole forward: one amax
all-reduce per direction per step); ``overlap`` is the ``TPOverlap`` of every GEMM.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from tp_fuse.overlap.config import TPOverlap
from tp_fuse.recipe import Recipe

from ..grad_sync import sync_sequence_parallel_grad
from ..sharding import tp_rank_and_size
from .checks import attention_converted, collapse, replicated_norm_check, sequence_parallel_problems, tied_problems
from .fused_split import fused_problems
from .heads import attention_modules, head_problems, localize_heads
from .hf_plans import FamilyPlan, family_plan
from .megatron import convert_megatron, tag_untouched
from .modules import HF_RMS_NORMS, ParallelLinearAdapter
from .passes import probe_original, shard_with_heads, sync_traced, trace_lazily
from .per_head import per_head_check, split_sizes
from .plain import check_replicated, convert_plain, convert_sharded_norm, linear_sizes, rms_norm_params, style_name
from .plan_match import STYLES, Matched, match_plan
from .plan_styles import FusedColumn
from .report import WrapReport
from .trace import TraceChecks, exclude_for
from .verify_step import check_verify_arg, choose_probe, finish_verification, warn_unverified
from tp_fuse.quantization import autocast

__all__ = ["wrap", "ParallelLinearAdapter", "PLAN_STYLES", "WrapReport"]

Style = Literal["column", "row", "sequence_parallel", "sharded_norm"]
#: The plan styles given by name (``FusedColumn(...)`` besides): the launcher's ``model.plan``.
PLAN_STYLES = STYLES


def wrap(
    model: torch.nn.Module,
    tp_group: dist.ProcessGroup,
    *,
    plan: Optional[Mapping[str, Any]] = None,
    exclude: Sequence[str] = (),
    sequence_parallel: Optional[bool] = None,
    fp8: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
    overlap: Optional[TPOverlap] = None,
    verify: Any = None,
    fixup: Optional[Callable[[torch.nn.Module, int], None]] = None,
    verbose: bool = True,
) -> torch.nn.Module:
    """Convert ``model`` in place (see the module docstring) and return it.

    Args:
        model: the model; its Megatron-style parallel linears and the modules named in
            ``plan`` are replaced (the root module itself cannot be).
        tp_group: the TP process group (collective: call on every rank of it).
        plan: ``{glob over module names: "column" | "row" | "sequence_parallel" |
            FusedColumn(parts | sizes, names=..., head_dim=...)}``. None for a Hugging Face model (``model.config.model_type``
            in ``tp_fuse.layers.wrap.hf_plans.FAMILIES``) uses the family's built-in plan; an explicit
            plan for such a model keeps the family's head checks and fix-ups.
        exclude: globs over module names left exactly as they are (not converted, not
            checked); they are listed in the report.
        sequence_parallel: for plan modules (default False); for Megatron modules it
            must agree with theirs if given.
        fp8: run the model's forward inside ``tp_fuse.autocast(fp8, fp8_group)``.
        fp8_group: amax reduction group (None: torch's default group, i.e. the world).
        overlap: ``TPOverlap`` for every converted GEMM and comm op.
        verify: the probe the wrapped model is checked on against the original (one
            forward and backward each, every output and gradient compared; a difference is
            a ``ValueError`` naming the first differing module output in forward order and
            the plan entries that produced it; ``tp_fuse.layers.wrap.verify``). Default
            (None): whenever wrap shards anything, with the automatic ``[2, 8]``-token probe
            of a model that takes token ids (a Hugging Face model: the launcher's; nanoGPT,
            torchtitan; ``tp_fuse.layers.wrap.probe``), its cost in the report; models without
            one are not verified, with a warning. ``True`` (the automatic probe, required),
            a tensor, a tuple of args, a dict of kwargs or a callable ``f(model)``: that
            probe. ``False``: not verified, with a warning naming what is not checked
            (``tp_fuse.layers.wrap.verify_step``).
        fixup: ``f(model, tp_size)`` called after conversion, for model attributes the
            declared rules (``tp_fuse.layers.wrap.heads``) do not cover.
        verbose: print the :class:`WrapReport` (on TP rank 0; False: only store it).

    Replicated parameters used on TP-sharded activations (per-head q/k norms) are found by
    tracing one forward (``tp_fuse.layers.wrap.trace``): on the probe (``verify``, or the automatic
    one) before anything changes, else on the wrapped model's first
    forward; their gradients are summed over TP. The report of what was converted and what
    was left, and why, is stored as ``model.tp_fuse_wrap_report``.
    """
    _check_arguments(model, tp_group, fp8, exclude, fixup, verify)
    rank, tp = tp_rank_and_size(tp_group)
    family: Optional[FamilyPlan] = family_plan(model, explicit=plan is not None)
    builtin = plan is None and family is not None
    plan = family.plan_for(model.config) if builtin else dict(plan or {})
    report = WrapReport(family=family.model_type if family is not None else None)

    # 1. What to convert, and everything wrong with it, before anything changes.
    found = match_plan(model, plan, exclude, tp_group, sequence_parallel, report,
                       family.notes if builtin else {}, builtin_type=family.model_type if builtin else None)
    modules = dict(model.named_modules())
    attention = attention_modules(model, found.columns) if tp > 1 else {}
    problems = found.problems + _model_problems(model, modules, found, family, builtin, attention, tp, tp_group,
                                                sequence_parallel)
    # 2. One traced forward of the original on the probe (and its backward, to verify with).
    widths = _column_widths(modules, found.planned, found.columns) if not problems else {}
    problems += _per_head_norm_problems(modules, found.planned, found.entries, widths) if tp > 1 and not problems \
        else []
    checks = _trace_checks(model, found.planned, found.entries, widths, tp) if tp > 1 and not problems \
        else TraceChecks()
    choice = choose_probe(model, verify, bool(found.megatron or found.planned), tp)
    trace, reference = None, None
    if not problems:
        trace, reference, failed = probe_original(model, choice.probe, found.columns if tp > 1 else [], found.rows,
                                                  found.norms if tp > 1 else [], checks, strict=choice.strict)
        choice.unverified = choice.unverified or failed
        problems += trace.problems if trace is not None else []
    if problems:
        raise ValueError("wrap: cannot convert the model:\n  - " + "\n  - ".join(collapse(problems)))

    # 3. Convert, then set what the model keeps about its heads to this rank's.
    _convert_modules(model, modules, found, tp_group, bool(sequence_parallel), overlap, report)
    _localize(model, modules, found, attention, family, fixup, tp, report)
    # 4. Gradient sums for replicated parameters on sharded activations, layout tags.
    if trace is not None:
        shard_with_heads(model, trace, tp_group, report)
        sync_traced(model, trace, tp_group, report)
    elif found.columns and tp > 1:
        trace_lazily(model, found.columns, found.rows, tp_group, report, verbose=verbose and rank == 0,
                     norms=found.norms, checks=checks)
    tag_untouched(model)
    # 5. Verify against the original (raises on a difference), or say why not.
    if reference is not None:
        transposed = {f"{n}.weight" for n, m in model.named_modules()
                      if isinstance(m, ParallelLinearAdapter) and m.transposed}
        finish_verification(model, reference, choice.probe, tp_group, transposed, report, found.entries)
    elif choice.unverified is not None:
        report.unverified = choice.unverified
        warn_unverified(choice.unverified, len(report.converted))
    if fp8 is not None:
        _run_forward_in_autocast(model, fp8, fp8_group)
    model.tp_fuse_wrap_report = report
    if verbose and rank == 0:
        print(report)
    return model


def _check_arguments(model: Any, tp_group: Any, fp8: Any, exclude: Any, fixup: Any, verify: Any) -> None:
    """wrap's arguments, each a ``ValueError`` naming what it got."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"wrap: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(tp_group, dist.ProcessGroup):
        raise ValueError(f"wrap: tp_group must be a torch.distributed.ProcessGroup, got {type(tp_group).__name__}")
    if fp8 is not None and not isinstance(fp8, Recipe):
        raise ValueError(f"wrap: fp8 must be a tp_fuse.recipe.Recipe or None, got {type(fp8).__name__}")
    if isinstance(exclude, str):
        raise ValueError(f"wrap: exclude must be a list of globs, got the string {exclude!r}")
    if fixup is not None and not callable(fixup):
        raise ValueError(f"wrap: fixup must be a callable f(model, tp_size), got {type(fixup).__name__}")
    check_verify_arg(model, verify)


def _model_problems(model: torch.nn.Module, modules: dict[str, torch.nn.Module], found: Matched,
                    family: Optional[FamilyPlan], builtin: bool, attention: dict[str, torch.nn.Module], tp: int,
                    tp_group: dist.ProcessGroup, sequence_parallel: Optional[bool]) -> list[str]:
    """What the model as a whole says against the plan: its family's checks (an explicit
    plan that shards attention keeps them), sequence parallelism on a model that embeds
    token ids, ties, head counts, weights differing across ranks."""
    problems = []
    if family is not None and (builtin or attention_converted(model, found.columns)):
        problems += [f"{family.model_type}: {p}" for p in family.check(model.config, tp)]
        if not builtin:
            problems += _family_norm_problems(model, family, found.planned, found.columns)
    problems += sequence_parallel_problems(model, found.planned, found.entries, sequence_parallel)
    problems += tied_problems(model, found.planned)
    for name, m in attention.items():
        problems += head_problems(name, m, tp, getattr(model, "config", None), found.planned)
    problems += check_replicated([(n, modules[n]) for n, s in found.planned.items() if s != "sequence_parallel"],
                                 tp_group)
    return problems


def _convert_modules(model: torch.nn.Module, modules: dict[str, torch.nn.Module], found: Matched,
                     tp_group: dist.ProcessGroup, sp: bool, overlap: Optional[TPOverlap], report: WrapReport) -> None:
    """Replace the Megatron-style and planned modules (``modules``: the original ones)."""
    for name, kind in found.megatron.items():
        m = modules[name]
        new = convert_megatron(m, kind, tp_group, overlap)
        stride = getattr(m.weight, "partition_stride", 1) if m.weight is not None else 1
        how = f"Megatron {kind}-parallel" + (f", stride-{stride} blocks ([gate; up])" if stride > 1 else "")
        how += ", weight at call time" if m.weight is None else ""
        how += ", accumulate_into_main_grad" if getattr(m, "gradient_accumulation_fusion", False) else ""
        report.converted.append((name, how))
        _replace(model, name, new)
    for name, style in found.planned.items():
        m = modules[name]
        if style == "sharded_norm":
            report.converted.append((name, f"{type(m).__name__} -> sharded norm (weight split with the features, "
                                           f"statistics summed over TP)"))
            _replace(model, name, convert_sharded_norm(m, tp_group))
            continue
        if style == "sequence_parallel":
            if sp:
                for p in m.parameters():
                    sync_sequence_parallel_grad(p, tp_group)
            report.converted.append((name, "norm, grads synced over TP" if sp else "norm (replicated; SP off)"))
            continue
        report.converted.append((name, f"{type(m).__name__} -> {style_name(style)}-parallel"))
        _replace(model, name, convert_plain(m, style, tp_group, sp, overlap))


def _localize(model: torch.nn.Module, modules: dict[str, torch.nn.Module], found: Matched,
              attention: dict[str, torch.nn.Module], family: Optional[FamilyPlan],
              fixup: Optional[Callable[[torch.nn.Module, int], None]], tp: int, report: WrapReport) -> None:
    """Head counts and widths stored on the attention modules (``heads``; a fused
    projection's part sizes too), then the family's and the caller's fix-ups."""
    for name, m in attention.items():
        parts = [p for c in found.columns if c.rpartition(".")[0] == name and isinstance(found.planned[c], FusedColumn)
                 for p in found.planned[c].sizes(linear_sizes(modules[c])[1])]
        changes = localize_heads(m, tp, parts)
        if changes:
            report.localized.append((name, ", ".join(changes)))
    if family is not None and family.fixup is not None:
        family.fixup(model, tp)
    if fixup is not None:
        fixup(model, tp)


def _trace_checks(model: torch.nn.Module, planned: dict[str, Any], entries: dict[str, str],
                  widths: dict[int, list[str]], tp: int) -> TraceChecks:
    """What the trace checks at TP size ``tp`` > 1: full-width norms left replicated
    (``checks``), the plan's column projections against how the model cuts their outputs
    (``fused_split``), per-head tensors left whole (``per_head``)."""
    styles = {n: s for n, s in planned.items() if s == "column" or isinstance(s, FusedColumn)}
    sizes, ignore = split_sizes(getattr(model, "config", None), widths)
    vectors = {n: int(p.shape[0]) for n, p in model.named_parameters() if p.dim() == 1}
    return TraceChecks(module=_replicated_norm_check(widths, tp),
                       fused=lambda cuts, local: fused_problems(cuts, styles, entries, tp, local),
                       head=per_head_check(sizes, ignore, entries, exclude_for, vectors), entries=entries)


def _column_widths(modules: dict[str, torch.nn.Module], planned: dict[str, Any], columns: list[str]
                   ) -> dict[int, list[str]]:
    """``{output width: the plan's column projections with it}``, a fused projection's
    parts too (the model splits them before normalising one)."""
    widths: dict[int, list[str]] = {}
    for name in columns:
        out_f = linear_sizes(modules[name])[1]
        style = planned[name]
        # A fused projection's parts besides its whole (parts that do not add up are
        # plain_problems' refusal already).
        parts = style.sizes(out_f) if isinstance(style, FusedColumn) and not style.problems(out_f, 1) else ()
        for size in {out_f, *parts}:
            widths.setdefault(size, []).append(name)
    return widths


def _replicated_norm_check(widths: dict[int, list[str]], tp: int) -> Callable[..., Any]:
    """The trace's check for a full-width norm left replicated on sharded features
    (``checks.replicated_norm_check``), for the widths of the plan's column projections."""
    return replicated_norm_check(widths, tp, lambda m: rms_norm_params(m) is not None, HF_RMS_NORMS)


def _per_head_norm_problems(modules: dict[str, torch.nn.Module], planned: dict[str, Any], entries: dict[str, str],
                            widths: dict[int, list[str]]) -> list[str]:
    """``"sharded_norm"`` on a norm whose width is no column projection's output width: a
    per-head norm (Qwen3's ``q_norm``, ``[head_dim]``, applied to every head). Its weight
    is one head's, not split with the heads: sharded, each rank would get half of it."""
    problems = []
    for name, style in planned.items():
        params = rms_norm_params(modules[name]) if style == "sharded_norm" else None
        if params is None or params[1] in widths:
            continue
        problems.append(f"{name}: {entries[name]}, but this {type(modules[name]).__name__} normalises over "
                        f"{params[1]} features, which is no column projection's output width "
                        f"({sorted(widths)}): a per-head norm (one head's features, applied to every head), not "
                        f"a norm over the sharded features. Take {entries[name].split(' = ')[0]} out of the plan: "
                        f"the norm stays replicated and its gradient is summed over TP (found by the trace)")
    return problems


def _family_norm_problems(model: torch.nn.Module, family: FamilyPlan, planned: dict[str, Any],
                          columns: list[str]) -> list[str]:
    """An explicit plan that shards a block whose family norm must be sharded with it
    (OLMo2's full-width ``q_norm``) but leaves that norm replicated: its weight would not
    match the local features, and normalising each rank's slice alone is wrong."""
    problems = []
    sharded_parents = {c.rpartition(".")[0] for c in columns}
    for glob, style in family.plan_for(model.config).items():
        if style != "sharded_norm":
            continue
        missed = [n for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, glob)
                  and n.rpartition(".")[0] in sharded_parents and planned.get(n) != "sharded_norm"]
        if missed:
            problems.append(f"{family.model_type}: {glob} normalises over all heads of a projection this plan "
                            f"shards ({len(missed)} modules, e.g. {missed[0]}); it must be in the plan as "
                            f"'sharded_norm' (weight split with the heads, statistics summed over TP), as in the "
                            f"built-in {family.model_type} plan (plan=None)")
    return problems


def _replace(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


class _AutocastForward:
    """``module.forward`` run inside ``tp_fuse.autocast(recipe, group)``.

    A callable object stored as the instance's ``forward`` (``nn.Module.__call__`` uses
    it); it calls the class's forward, so it never captures a stale bound method.
    """

    def __init__(self, module: torch.nn.Module, recipe: Recipe, group: Optional[dist.ProcessGroup]) -> None:
        self.module, self.recipe, self.group = module, recipe, group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:

        with autocast(recipe=self.recipe, amax_reduction_group=self.group):
            return type(self.module).forward(self.module, *args, **kwargs)


def _run_forward_in_autocast(model: torch.nn.Module, recipe: Recipe, group: Optional[dist.ProcessGroup]) -> None:
    if "forward" in vars(model):
        raise ValueError("wrap(fp8=...): the model already has an instance-level forward "
                         "(an earlier wrap(fp8=...)?); run the FP8 autocast yourself instead")
    model.forward = _AutocastForward(model, recipe, group)  # nn.Module.__call__ picks it up
