"""``wrap(..., verify=...)``: one forward and backward of the wrapped model against the original.

``wrap`` runs the *original* model once on a probe batch before changing anything (that
same forward is traced by ``tp_fuse.layers.wrap.trace`` to find the replicated parameters that
see sharded activations), keeps its outputs and every gradient, converts the model, runs
the wrapped model on the same batch and compares: every output tensor, then every
parameter's gradient (sharded ones gathered to their full, original layout -- GPT-2
``Conv1D`` weights transposed back). The first output and the first parameter that
differ are named in a ``ValueError``; the ranks agree on the verdict (all raise).

The loss of both passes is ``sum(output * w)`` over the floating-point outputs with a
fixed random ``w`` per output, so every output element reaches every gradient with a
different weight. Both passes run in ``eval()`` mode (no dropout; the training flags are
restored) with the RNG state forked, so neither changes the caller's random streams,
and without FP8 (``wrap(fp8=...)`` is applied after): this checks the tensor-parallel
conversion, not quantization.

Cost: two forwards and backwards on the probe (a ``[2, 8]`` token batch for a model
that takes token ids), one full-model gradient held per rank between them
(the original's parameters' size), and one all-gather per sharded parameter. Gradients
that existed before are put back afterwards on the parameters wrap kept; the rest are
None.

Probes: ``tp_fuse.layers.wrap.probe`` (the automatic one of a model that takes token ids,
or the caller's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..sharding import gather_tensor
from .module_outputs import ModuleOutputs, first_difference
from .trace import output_leaves

__all__ = ["Reference", "evaluation", "reference_pass", "compare"]

# Largest max|wrapped - original| / max|original| accepted, by the parameters' dtype. A
# conversion error is O(1) on this scale (a wrong head, a partial gradient: 0.5 to 1.2 in
# issue 22's models); rounding is ~1e-6 in float32. bf16 / fp16 sum the sharded GEMMs in
# a different order at 8-bit mantissas: 0.1 keeps that noise out and the errors in.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
LOW_PRECISION_TOLERANCE = 0.1


@contextlib.contextmanager
def evaluation(model: torch.nn.Module) -> Iterator[None]:
    """``eval()`` mode and a forked RNG for the probe passes; training flags restored."""
    flags = [(m, m.training) for m in model.modules()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            model.eval()
            yield
    finally:
        for m, flag in flags:
            m.training = flag


def _loss(out: Any) -> Optional[torch.Tensor]:
    total = None
    for i, (_, t) in enumerate(output_leaves(out)):
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(t.shape, generator=torch.Generator().manual_seed(100 + i), dtype=torch.float32)
            term = (t.float() * w.to(t.device)).sum()
            total = term if total is None else total + term
    return total


@dataclasses.dataclass
class Reference:
    """The original model's outputs and gradients on the probe."""

    outputs: list[tuple[str, torch.Tensor]]
    grads: dict[str, Optional[torch.Tensor]]
    params: dict[str, int]  # name -> id of the original Parameter (same object after wrap: Megatron's)
    stashed: list[tuple[torch.nn.Parameter, torch.Tensor]]  # gradients that existed before
    #: Every module's outputs in the probe forward, ``{(module name, call index): tensors}``.
    modules: dict[tuple[str, int], list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    #: Seconds the reference backward took (part of verification's cost).
    seconds: float = 0.0


def stash_grads(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Take the existing gradients off the parameters (put back by :func:`restore_grads`)."""
    out = []
    for p in model.parameters():
        if p.grad is not None:
            out.append((p, p.grad))
            p.grad = None
    return out


def reference_pass(model: torch.nn.Module, out: Any, stashed: list,
                   modules: Optional[ModuleOutputs] = None) -> Reference:
    """Backward of the original model's probe output ``out``; moves the gradients off the
    parameters into the returned :class:`Reference` (with ``modules``: what every module
    returned in that forward)."""
    start = time.perf_counter()
    loss = _loss(out)
    if loss is not None:
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad
        p.grad = None
    outputs = [(path, t.detach()) for path, t in output_leaves(out)]
    return Reference(outputs, grads, {n: id(p) for n, p in model.named_parameters()}, stashed,
                     modules.by_key() if modules is not None else {}, time.perf_counter() - start)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, floor)``: relative to the tensor's own scale, with a
    floor for tensors whose true value is ~0 (a key bias's gradient: softmax ignores a
    per-query shift), which are otherwise pure rounding noise in both models."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / max(float(b.abs().max()), floor, 1e-30)) if b.numel() else 0.0


def compare(model: torch.nn.Module, ref: Reference, probe: Callable[[torch.nn.Module], Any],
            tp_group: dist.ProcessGroup, transposed: set[str], plan_entries: Optional[dict[str, str]] = None
            ) -> list[str]:
    """Run the wrapped model on the probe and compare with ``ref``; the problems found
    (the first module output in forward order, the first output and the first parameter
    that differ, and how many more), the same on every rank. Gradients end as they were
    before the reference pass. ``plan_entries``: ``{module name: its plan entry}``, named
    with the first differing module output."""
    try:
        with evaluation(model), ModuleOutputs(model) as recorded:
            out = probe(model)
            loss = _loss(out)
            if loss is not None:
                loss.backward()
    except Exception as e:  # noqa: BLE001 - a shape error after conversion: named, and agreed by every rank
        for p in model.parameters():
            p.grad = None
        for p, g in ref.stashed:
            p.grad = g
        return _agree([recorded.failure(e, plan_entries or {})], tp_group)
    dtype = next(model.parameters()).dtype
    tol = TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
    mine = output_leaves(out)
    problems: list[str] = []
    bad_out = []
    if [p for p, _ in mine] != [p for p, _ in ref.outputs]:
        bad_out.append(f"outputs {[p for p, _ in mine]} are not the original's {[p for p, _ in ref.outputs]}")
    for (path, t), (_, r) in zip(mine, ref.outputs):
        if t.shape != r.shape:
            bad_out.append(f"{path}: shape {tuple(t.shape)}, the original's is {tuple(r.shape)}")
        elif t.is_floating_point() and (err := _rel(t, r)) > tol:
            bad_out.append(f"{path}: max relative difference {err:.2e} (tolerance {tol:.0e})")
        elif not t.is_floating_point() and not torch.equal(t.cpu(), r.cpu()):
            bad_out.append(f"{path}: differs")
    bad_grad = []
    # Gradients are compared relative to their own scale, floored at 1% of the largest.
    floor = 1e-2 * max((float(g.abs().max()) for g in ref.grads.values() if g is not None and g.numel()), default=0.0)
    for name, p in model.named_parameters():
        want = ref.grads.get(name)
        got = p.grad
        if got is not None and ref.params.get(name) != id(p):  # converted by the plan: gather the full tensor
            got = gather_tensor(got, getattr(p, "tp_shard", None), tp_group)
            if name in transposed:
                got = got.t()
        if name not in ref.grads:
            bad_grad.append(f"{name}: not a parameter of the original model")
        elif (got is None) != (want is None):
            bad_grad.append(f"{name}: has {'no ' if got is None else 'a '}gradient after wrap, "
                            f"{'none' if want is None else 'one'} in the original")
        elif got is not None and got.shape != want.shape:
            bad_grad.append(f"{name}: gradient shape {tuple(got.shape)}, the original's is {tuple(want.shape)}")
        elif got is not None and (err := _rel(got, want, floor)) > tol:
            bad_grad.append(f"{name}: gradient max relative difference {err:.2e} (tolerance {tol:.0e})")
    for p in model.parameters():
        p.grad = None
    for p, g in ref.stashed:
        p.grad = g
    if bad_out or bad_grad:
        first = first_difference(recorded, ref.modules, tol, _rel, plan_entries or {})
        if first is not None:
            problems.append(first)
    for what, found in (("output", bad_out), ("gradient", bad_grad)):
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            problems.append(f"first differing {what}: {found[0]}{more}")
    return _agree(problems, tp_group)


def _agree(problems: list[str], tp_group: dist.ProcessGroup) -> list[str]:
    """Every rank's problems, so that all ranks raise (a per-head bug shows on rank > 0
    only)."""
    gathered: list[Any] = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(gathered, problems, group=tp_group)
    ranks: dict[str, list[int]] = {}
    for rank, found in enumerate(gathered):
        for p in found:
            ranks.setdefault(p, []).append(rank)
    return [f"TP rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {p}" for p, r in ranks.items()]
