"""The passes ``wrap()`` runs around the conversion itself.

* :func:`probe_original` -- before anything changes: one traced forward of the original
  model on the probe (``tp_fuse.layers.wrap.trace``: which replicated parameters meet
  TP-sharded activations; what cannot be made right), and with ``verify=`` its backward,
  kept for the comparison after conversion (``tp_fuse.layers.wrap.verify``);
* :func:`sync_traced` -- after conversion: the gradients of the replicated parameters
  used on sharded activations only are summed over TP (``tp_fuse.layers.grad_sync``);
* :func:`trace_lazily` -- a model without a probe (one that takes no token ids, no
  ``verify=``): the wrapped model's first forward is traced instead, and the same sync
  is installed right after it, before its backward (a hook on a leaf tensor registered
  then still applies to that backward). Problems found then raise from that forward.
  Until that forward ends the tensors it follows are kept alive (ids must stay unique):
  the first forward's peak memory is higher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..grad_sync import sync_sharded_activation_grad
from ..sharding import ShardSpec, set_shard_spec, shard_tensor, tp_rank_and_size
from .checks import collapse
from .report import WrapReport
from .module_outputs import ModuleOutputs
from .trace import FIRST_FORWARD_ERROR, TraceChecks, TraceResult, trace_first_forward, trace_sharded_uses
from .probe import auto_probe
from .verify import Reference, evaluation, reference_pass, stash_grads

__all__ = ["probe_original", "sync_traced", "shard_with_heads", "trace_lazily"]


def probe_original(model: torch.nn.Module, probe: Optional[Callable[[torch.nn.Module], Any]], columns: list[str],
                   rows: list[str], norms: list[str] = (), checks: TraceChecks = TraceChecks(), strict: bool = True
                   ) -> tuple[Optional[TraceResult], Optional[Reference], Optional[str]]:
    """Trace one forward of the original model (and, with a ``probe`` to verify with, its
    backward and every module's output, for the comparison after wrapping). Without a
    ``probe`` the automatic one (a model that takes token ids) is traced (best effort: if it
    fails, the wrapped model's first forward is traced). A ``strict`` probe (the caller's)
    failing is a ``ValueError``; the default one failing returns why, as the third value,
    and no reference (the model is then not verified)."""
    run = probe if probe is not None else (auto_probe(model) if columns else None)
    if run is None:
        return None, None, None
    stashed = stash_grads(model) if probe is not None else []
    try:
        with evaluation(model), contextlib.ExitStack() as stack:
            recorder = stack.enter_context(ModuleOutputs(model)) if probe is not None else None
            trace = trace_sharded_uses(model, lambda: run(model), columns, rows, norms=norms, checks=checks)
            stack.close()
            reference = reference_pass(model, trace.output, stashed, recorder) if probe is not None else None
    except Exception as e:  # noqa: BLE001 - a failing user probe is reported, the automatic one falls back
        for p, g in stashed:
            p.grad = g
        if probe is not None and strict:
            raise ValueError(f"wrap(verify=...): the probe failed on the original model: {type(e).__name__}: {e}") \
                from e
        return None, None, f"the automatic probe failed on the original model ({type(e).__name__}: {e})"
    trace.output = None
    return trace, reference, None


def sync_traced(model: torch.nn.Module, trace: TraceResult, tp_group: dist.ProcessGroup,
                 report: WrapReport) -> list[tuple[str, str]]:
    """Sum over TP the gradients of the replicated parameters the trace saw on sharded
    activations only (``tp_fuse.layers.grad_sync``)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    added = []
    for name in trace.to_sync():
        sync_sharded_activation_grad(params[name], tp_group)
        added.append((name, f"replicated, used on TP-sharded activations in {sorted(trace.sharded_uses[name])[0]}: "
                            f"gradient summed over TP"))
    report.synced += added
    return added


def shard_with_heads(model: torch.nn.Module, trace: TraceResult, tp_group: dist.ProcessGroup,
                     report: WrapReport) -> None:
    """Replace each one-dimensional per-head parameter the trace found (GPT-OSS's
    ``sinks``) by this rank's slice of it (``ShardSpec(dim=0)``: rank r's heads), a new
    ``Parameter`` on the same module attribute (build the optimizer after ``wrap``)."""
    rank, tp = tp_rank_and_size(tp_group)
    spec = ShardSpec(dim=0)
    for name, where in trace.head_sharded.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        full = getattr(owner, attr)
        local = torch.nn.Parameter(shard_tensor(full.detach(), spec, rank, tp).clone(),
                                   requires_grad=full.requires_grad)
        set_shard_spec(local, spec)
        setattr(owner, attr, local)
        report.converted.append((name, f"per-head parameter {tuple(full.shape)} -> this rank's heads "
                                       f"{tuple(local.shape)} (used per head in {where})"))


def trace_lazily(model: torch.nn.Module, columns: list[str], rows: list[str], tp_group: dist.ProcessGroup,
                 report: WrapReport, verbose: bool, norms: list[str] = (), checks: TraceChecks = TraceChecks()) -> None:
    """Trace the wrapped model's first forward and install the gradient sums after it."""

    def finish(result: TraceResult) -> None:
        if result.problems:
            raise ValueError(FIRST_FORWARD_ERROR + "\n  - ".join(collapse(result.problems)))
        added = sync_traced(model, result, tp_group, report)
        if verbose and added:
            print("wrap (traced first forward):\n" + "\n".join(f"  ~ {n}: {how}" for n, how in added))

    trace_first_forward(model, columns, rows, finish, norms, checks)
    report.traced = "on the first forward (no probe: pass verify=... to trace before converting)"
