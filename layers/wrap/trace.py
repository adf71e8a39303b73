"""Which replicated parameters of a wrapped model see TP-sharded activations.

After ``wrap()`` a column-parallel projection returns only this rank's slice of its
output features (its heads). Everything computed from that slice until the row-parallel
projection that sums it over the TP group is per-rank: a parameter that stays replicated
but is used there -- Qwen3's ``q_norm``/``k_norm`` (one small norm shared by all heads,
applied per head), a per-head bias, a learned attention temperature -- gets, on each
rank, only the gradient of this rank's heads. The true gradient is the sum over the TP
group; without that sum the ranks' copies drift apart and training is wrong, silently.

Which parameters those are depends on the model's code (``forward`` bodies, not module
types), so it is found by running one forward pass under a ``TorchFunctionMode`` that
follows the sharded tensors:

* the outputs of the column-parallel modules are *sharded*; the inside of every column
  and row module is not traced (it is tensor-parallel by construction), and a row
  module's output is replicated again;
* any torch op with a sharded input has sharded outputs;
* parameters (and tensors computed only from parameters: ``1 + weight``,
  ``weight.float()``) are followed by identity; an op that combines them with a sharded
  tensor is a *sharded use* of those parameters, one that combines them with other
  activations is a *replicated use*.

:func:`trace_sharded_uses` returns the uses and what cannot be made right by summing a
gradient: a parameter used both ways (the sum would also multiply the replicated part),
a replicated activation that requires grad entering the sharded region other than
through a column module (its gradient would be partial too), and a sharded tensor that
reaches the model's output without a row module (each rank returns only its slice).
The trace runs on the original model before ``wrap`` changes anything (the module names
to be converted are given), or on the wrapped model's first forward.

A module that receives a sharded input can also be checked as such (``module_check``):
``wrap`` uses it to refuse a full-width norm left replicated inside the sharded region
(``tp_fuse.layers.wrap.checks.replicated_norm_check``). On the wrapped model such a
problem raises at once, from that module's forward pre-hook: its forward would otherwise
fail on the shapes (or compute wrong numbers) before the trace could report it; the trace
then stays installed, so every later forward raises the same error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .fused_split import Cuts, SplitWatcher
from .checks import name_pattern
from .per_head import HeadCheck, HeadShard

__all__ = ["TraceResult", "TraceChecks", "trace_sharded_uses", "trace_first_forward", "output_leaves", "ModuleCheck",
           "FusedCheck", "exclude_for"]

#: ``check(module name, module, its first TP-sharded input, local)`` -> a problem line or
#: None; ``local``: the model is already wrapped (sharded tensors hold this rank's slice).
ModuleCheck = Callable[[str, torch.nn.Module, torch.Tensor, bool], Optional[str]]
#: ``check(cuts, local)`` -> problem lines: the plan against how the model cut each column
#: projection's output (``tp_fuse.layers.wrap.fused_split``).
FusedCheck = Callable[[dict[tuple[str, int], Cuts], bool], list[str]]
#: How a problem found on the wrapped model's first forward is raised (passes.trace_lazily too).
FIRST_FORWARD_ERROR = "wrap: the first forward of the wrapped model shows it cannot be correct:\n  - "


@dataclasses.dataclass
class TraceChecks:
    """What the trace checks besides the parameters' uses (all optional).

    Attributes:
        module: asked about every module entered with a sharded input (a full-width norm
            left replicated: ``checks.replicated_norm_check``).
        fused: judges how the model cut each column's output (``fused_split``).
        head: asked about every whole tensor meeting a sharded one (``per_head``).
        entries: ``{module name: its plan entry as written}``, for the messages.
    """

    module: Optional[ModuleCheck] = None
    fused: Optional[FusedCheck] = None
    head: Optional[HeadCheck] = None
    entries: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TraceResult:
    """What one traced forward showed.

    Attributes:
        sharded_uses: ``{parameter name: module names}`` where the (replicated) parameter
            met a TP-sharded activation.
        replicated_uses: ``{parameter name: module names}`` where it met replicated ones.
        problems: what summing gradients over TP cannot fix (one line each).
        head_sharded: ``{parameter name: module}``: one-dimensional parameters with an
            entry per head, to be sharded with the heads (``tp_fuse.layers.wrap.per_head``).
        output: what the traced forward returned.
    """

    sharded_uses: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    replicated_uses: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    head_sharded: dict[str, str] = dataclasses.field(default_factory=dict)
    output: Any = None

    def to_sync(self) -> list[str]:
        """Parameters whose gradient must be summed over TP: used on sharded activations
        only (in the order they were first seen), and not sharded with the heads."""
        return [n for n in self.sharded_uses if n not in self.replicated_uses and n not in self.head_sharded]


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def output_leaves(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in a model output (Mappings such as Hugging
    Face's ``ModelOutput`` by key, sequences by index)."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, Mapping):
        return [leaf for k, v in out.items() for leaf in output_leaves(v, f"{prefix}[{k!r}]")]
    if isinstance(out, (tuple, list)):
        return [leaf for i, v in enumerate(out) for leaf in output_leaves(v, f"{prefix}[{i}]")]
    return []


class _ShardTracer(TorchFunctionMode):
    """Follows sharded tensors and parameter lineage through every torch op (by ``id``;
    the tensors are kept alive until the trace ends so that ids stay unique)."""

    def __init__(self, params: dict[int, str], checks: TraceChecks, local: bool = False,
                 watcher: Optional[SplitWatcher] = None, constants: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.watcher = watcher
        self.constants = constants  # ids of the model's buffers: constants, not activations
        self.head_check = checks.head
        self.entries = checks.entries
        #: ``{id: column}``: the column projection each sharded tensor comes from.
        self.origin: dict[int, str] = {}
        #: Problems that cause the others (a row projection left as column): reported alone.
        self.root_causes: list[str] = []
        #: The modules those name: the sharded tensors they produce are consequences.
        self.flagged: set[str] = set()
        self.params = params
        self.module_check = checks.module
        self.local = local
        self.aborted = False
        self.sharded: set[int] = set()
        self.lineage: dict[int, frozenset[str]] = {}
        self.keep: list[torch.Tensor] = []
        self.suspended = 0
        self.stack: list[str] = []
        self.result = TraceResult()
        self._seen_problems: set[str] = set()

    # -- bookkeeping called from module hooks --------------------------------------------
    def mark_sharded(self, out: Any, origin: str) -> None:
        for t in _tensors(out):
            self.sharded.add(id(t))
            self.origin.setdefault(id(t), origin)
            self.keep.append(t)

    def origin_of(self, tensors: list[torch.Tensor]) -> str:
        return next((self.origin[id(t)] for t in tensors if id(t) in self.origin), "?")

    def root_cause(self, text: str) -> None:
        """A problem that explains the ones after it: raised at once on the wrapped model."""
        if text not in self.root_causes:
            self.root_causes.append(text)
        self.fail(text)

    def _record(self, uses: dict[str, set[str]], names: Iterable[str]) -> None:
        where = self.stack[-1] if self.stack else "<root>"
        for n in names:
            uses.setdefault(n, set()).add(where)

    def _problem(self, text: str) -> None:
        if text not in self._seen_problems:
            self._seen_problems.add(text)
            self.result.problems.append(text)

    def fail(self, text: str) -> None:
        """A problem seen on entering a module: recorded (original model: its forward can
        go on), or raised now (wrapped model: its forward would break or be wrong first)."""
        if not self.local:
            self._problem(text)
            return
        self.aborted = True
        raise ValueError(FIRST_FORWARD_ERROR + text)

    def _lineage_of(self, t: torch.Tensor) -> Optional[frozenset[str]]:
        name = self.params.get(id(t))
        if name is not None:
            return frozenset((name,))
        return self.lineage.get(id(t))

    # -- the mode ----------------------------------------------------------------------------
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.suspended:
            self._observe(func, args, kwargs, out)
        return out

    def _observe(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        ins = _tensors((args, kwargs))
        if not ins:
            return
        if self.watcher is not None and self.watcher.watches(ins):
            self.watcher.observe(func, args, kwargs, out, self.stack[-1] if self.stack else "")
        outs = _tensors(out)
        lineages = [self._lineage_of(t) for t in ins]
        params = frozenset().union(*(ln for ln in lineages if ln))
        activations = [t for t, ln in zip(ins, lineages) if ln is None and id(t) not in self.constants]
        float_out = any(t.is_floating_point() for t in outs)
        sharded = [t for t in ins if id(t) in self.sharded]
        if sharded:
            origin = self.origin_of(sharded)
            self.mark_sharded(outs, origin)
            if params and float_out:
                self._record(self.result.sharded_uses, sorted(params))
            where = self.stack[-1] if self.stack else "<root>"
            op = str(getattr(func, "__name__", func))
            if self.head_check is not None and not self.local:
                for t, ln in zip(ins, lineages):
                    if id(t) not in self.sharded and t.is_floating_point() and (ln or not t.requires_grad):
                        found = self.head_check(where, sorted(ln or ()), t, sharded[0], origin, op)
                        if isinstance(found, HeadShard):
                            self.result.head_sharded.setdefault(found.name, found.where)
                        elif found:
                            self._problem(found)
            for t in activations:
                if id(t) not in self.sharded and t.requires_grad and t.is_floating_point():
                    block = exclude_for(where, origin)
                    self._problem(
                        f"{where}: a replicated activation that requires grad meets the TP-sharded output of "
                        f"{origin} in {op} without passing a column-parallel module: its gradient would be this "
                        f"rank's part only. Convert the projection that produces it together with this path, or "
                        f"exclude {block!r} (it holds {origin})")
        elif params:
            if not activations:  # computed from parameters (and constants) only: follow it
                for t in outs:
                    self.lineage[id(t)] = params
                    self.keep.append(t)
            elif float_out:
                self._record(self.result.replicated_uses, sorted(params))


def _install_hooks(model: torch.nn.Module, tracer: _ShardTracer, columns: set[str], rows: set[str],
                   skip_root: bool = False, norms: frozenset[str] = frozenset()) -> list[Any]:
    """``norms``: sharded norms (plan style ``"sharded_norm"``): boundaries like the
    columns (their output is sharded), whose input must be sharded already -- a norm over
    features the ranks do not split would get a sharded weight for unsharded features.
    Every other module entered with a sharded input goes through ``tracer.module_check``."""
    handles = []
    for name, m in model.named_modules():
        if skip_root and not name:
            continue
        boundary = name in columns or name in rows

        def pre(mod: torch.nn.Module, args: Any, name: str = name, boundary: bool = boundary) -> None:
            tracer.stack.append(name or "<root>")
            sharded_in = [t for t in _tensors(args) if id(t) in tracer.sharded] if not tracer.suspended else []
            if name in norms and not tracer.suspended and not sharded_in:
                tracer.flagged.add(name)  # what follows from its sharded output is this problem's consequence
                tracer.root_cause(f"{name}: plan style 'sharded_norm' is for a norm over a column-parallel module's "
                            f"(TP-sharded) output features, but this module's input is not TP-sharded; "
                            f"leave it out of the plan (replicated) or shard the projection feeding it")
            elif sharded_in and name in columns and name not in norms:
                _column_after_column(tracer, name, sharded_in)
            elif sharded_in and not boundary and name not in norms and _is_linear(mod):
                _linear_left_out(tracer, name, mod, sharded_in)
            elif sharded_in and not boundary and name not in norms and tracer.module_check is not None:
                found = tracer.module_check(name, mod, sharded_in[0], tracer.local)
                if found:
                    tracer.fail(found)
            if boundary:
                tracer.suspended += 1

        def post(mod: torch.nn.Module, args: Any, out: Any, name: str = name, boundary: bool = boundary) -> None:
            tracer.stack.pop()
            if name in tracer.flagged:  # what a misplanned projection returns: its consequences
                for t in _tensors(out):
                    tracer.origin[id(t)] = name
            if boundary:
                tracer.suspended -= 1
                if name in columns and not tracer.suspended:
                    tracer.mark_sharded(out, name)
                    if tracer.watcher is not None and name not in norms:
                        tracer.watcher.column_output(name, out)

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    return handles


def _is_linear(m: torch.nn.Module) -> bool:
    """An ``nn.Linear`` or GPT-2 ``Conv1D`` (a projection the plan could have named)."""
    w = getattr(m, "weight", None)
    return (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D") and isinstance(w, torch.Tensor) \
        and w.dim() == 2


def exclude_for(where: str, origin: str) -> str:
    """The block to exclude so that ``where`` no longer sees ``origin``'s sharded output:
    the innermost module holding both (it then holds no sharded projection)."""
    common = []
    for a, b in zip(where.split("."), origin.split(".")):
        if a != b:
            break
        common.append(a)
    return ".".join(common) or origin.rpartition(".")[0] or origin


def _entry(tracer: "_ShardTracer", name: str) -> str:
    return tracer.entries.get(name, f"plan entry of {name}")


def _column_after_column(tracer: "_ShardTracer", name: str, sharded_in: list[torch.Tensor]) -> None:
    """A column projection whose input is already sharded: the row projection that closes
    the region was given as ``"column"`` (the residual add and the norms after it then
    see sharded tensors: their refusals follow from this one)."""
    origin = tracer.origin_of(sharded_in)
    tracer.flagged.add(name)
    if origin in tracer.flagged:
        return  # sharded only because of a projection already named
    entry = _entry(tracer, name)
    tracer.root_cause(f"{name}: {entry}, but its input is already TP-sharded (the output of {origin}, "
                      f"{_entry(tracer, origin)}): it closes the sharded region {origin} opens, so it is a row "
                      f"projection. Write {entry.split(' = ')[0]} = 'row'")


def _linear_left_out(tracer: "_ShardTracer", name: str, mod: torch.nn.Module, sharded_in: list[torch.Tensor]) -> None:
    """A projection the plan leaves replicated that takes a sharded input: the row
    projection closing the region was left out of the plan."""
    origin = tracer.origin_of(sharded_in)
    tracer.flagged.add(name)
    if origin in tracer.flagged:
        return  # sharded only because of a projection already named
    pattern = name_pattern(name)
    tracer.root_cause(f"{name}: this {type(mod).__name__} is not in the plan, but its input is TP-sharded (the "
                      f"output of {origin}, {_entry(tracer, origin)}): left replicated, each rank would multiply its "
                      f"share of the features by the whole weight. It closes the sharded region {origin} opens: add "
                      f"plan[{pattern!r}] = 'row' (or exclude {exclude_for(name, origin)!r})")


def _start(model: torch.nn.Module, columns: set[str], rows: set[str], skip_root: bool,
           norms: frozenset[str] = frozenset(), checks: TraceChecks = TraceChecks(),
           local: bool = False) -> tuple[_ShardTracer, list]:
    columns = columns | norms  # a sharded norm's output is sharded, its inside not traced
    inside = tuple(n + "." for n in columns | rows)
    params: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not name.startswith(inside) and id(p) not in params:
            params[id(p)] = name
    watcher = SplitWatcher(dict(model.named_modules()), local) if checks.fused is not None else None
    constants = frozenset(id(b) for b in model.buffers())
    tracer = _ShardTracer(params, checks, local, watcher, constants)
    return tracer, _install_hooks(model, tracer, columns, rows, skip_root, norms)


def _finish(tracer: _ShardTracer, handles: list, out: Any,
            check_outputs: Optional[Callable[[Any], list[tuple[str, torch.Tensor]]]],
            fused: Optional[FusedCheck] = None) -> TraceResult:
    for h in handles:
        h.remove()
    result = tracer.result
    result.output = out
    try:
        _judge(tracer, result, out, check_outputs, fused)
    finally:
        tracer.keep.clear()
        tracer.sharded.clear()
        tracer.lineage.clear()
        tracer.origin.clear()
        if tracer.watcher is not None:
            tracer.watcher.keep.clear()
    return result


def _judge(tracer: _ShardTracer, result: TraceResult, out: Any,
           check_outputs: Optional[Callable[[Any], list[tuple[str, torch.Tensor]]]],
           fused: Optional[FusedCheck]) -> None:
    """The problems of a finished trace, into ``result.problems``."""
    if tracer.root_causes:  # the other problems follow from these: report these alone
        result.problems = list(tracer.root_causes)
        return
    if fused is not None and tracer.watcher is not None:
        result.problems += fused(tracer.watcher.cuts, tracer.local)
    if check_outputs is not None and out is not None:
        for path, t in check_outputs(out):
            if id(t) in tracer.sharded:
                result.problems.append(
                    f"{path}: the model's output is still TP-sharded (a column-parallel module's output reaches it "
                    f"without a row-parallel module): each rank would return only its slice")
    for name in result.sharded_uses:
        if name in result.replicated_uses:
            result.problems.append(
                f"{name}: this replicated parameter is used on TP-sharded activations (in "
                f"{sorted(result.sharded_uses[name])}) and on replicated ones (in "
                f"{sorted(result.replicated_uses[name])}): summing its gradient over TP would also multiply the "
                f"replicated part. Exclude the block that uses it on sharded activations")


def trace_sharded_uses(model: torch.nn.Module, run: Callable[[], Any], columns: Iterable[str],
                       rows: Iterable[str], check_outputs: Optional[Callable[[Any], list[tuple[str, torch.Tensor]]]]
                       = output_leaves, norms: Iterable[str] = (), checks: TraceChecks = TraceChecks()) -> TraceResult:
    """Run ``run()`` (one forward of ``model``) and follow the outputs of the modules named
    in ``columns`` (TP-sharded) until the modules named in ``rows``.

    Parameters inside those modules are not followed (they are sharded or, for a row's
    bias, added after the reduction). ``check_outputs(output)`` gives the output tensors
    that must not be sharded (None: do not check); ``checks`` are the other checks
    (:class:`TraceChecks`; their problems join the result's). The model is left as it was.
    """
    tracer, handles = _start(model, set(columns), set(rows), skip_root=False, norms=frozenset(norms),
                             checks=checks)
    out = None
    try:
        with tracer:
            out = run()
    finally:
        result = _finish(tracer, handles, out, check_outputs, checks.fused)
    return result


def trace_first_forward(model: torch.nn.Module, columns: Iterable[str], rows: Iterable[str],
                        finish: Callable[[TraceResult], None], norms: Iterable[str] = (),
                        checks: TraceChecks = TraceChecks()) -> None:
    """Trace the next forward of ``model`` (already wrapped: the column/row modules are its
    converted ones) and call ``finish(result)`` right after it, before any backward --
    for models ``wrap`` has no probe for. Then the hooks are removed: later forwards run
    untraced. ``finish`` may raise (the forward then raises). A problem found on entering
    a module (``checks.module``, a sharded norm's input) raises from there, and the trace
    stays installed: the next forward is traced (and refused) again."""
    columns, rows, sharded_norms = set(columns), set(rows), frozenset(norms)
    state: dict[str, Any] = {}

    def pre(mod: torch.nn.Module, args: Any) -> None:
        tracer, handles = _start(model, columns, rows, skip_root=True, norms=sharded_norms, checks=checks,
                                 local=True)
        tracer.stack.append("<root>")
        tracer.__enter__()
        state.update(tracer=tracer, handles=handles)

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        tracer = state.pop("tracer", None)
        if tracer is None:
            return
        tracer.__exit__(None, None, None)
        if tracer.aborted:  # already raised from a module's pre-hook: clean up, trace again next time
            for h in state.pop("handles"):
                h.remove()
            tracer.keep.clear()
            return
        for h in root_handles:
            h.remove()
        finish(_finish(tracer, state.pop("handles"), out, output_leaves, checks.fused))

    root_handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post, always_call=True)]
