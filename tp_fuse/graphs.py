"""``tp_fuse.make_graphed_callables``: CUDA graphs of tp_fuse modules, FP8 included.

Transformer Engine's function, with its signature and meaning, built on
``torch.cuda.make_graphed_callables`` (one forward and one backward CUDA graph per
callable; the graphed module's ``forward`` replays them while training with grad enabled,
and runs eagerly otherwise).

What runs where under FP8 (``fp8_enabled=True``):

* **inside the graphs**: every cast kernel, which folds its amax into the delayed
  quantizer's history slot or (current scaling) computes the scale and writes
  ``scale``/``last_amax``/counters in place, all at the addresses fixed before capture;
  current scaling's amax all-reduce over its group (a NCCL collective, capturable);
* **outside, after each backward pass through the graphed callables**, as Transformer
  Engine's ``reduce_and_update_fp8_tensors`` after backward: one all-reduce(MAX) of the
  delayed amaxes per (direction, ``fp8_group``) and one fused scale update
  (``step_record.FP8StepMembership``, with the membership recorded during the warm-up).
  Bit-identical to eager, where the forward quantizers update at the ``autocast`` exit:
  no backward kernel reads a forward quantizer's scale.

Before capture: ``num_warmup_iters`` eager forward + backward passes under
``tp_fuse.autocast(fp8_recipe, fp8_group)`` (quantizers are built, their state moves to
the GPU -- the only host-to-device copies -- and the end-of-step reductions are recorded,
not run); then every quantizer's state is put back as it was before the call (a
quantizer born in the warm-up: its initial state) and the delayed-scaling groups are fixed,
so nothing is rebound afterwards; then ``torch.cuda.make_graphed_callables`` warms up once
more on its side stream and captures; the state is put back again, and the RNG state too.

All callables of one call form one step: the update after a backward pass covers all of
their delayed quantizers (call each graphed callable once per forward/backward pass, as
in eager training where one autocast and one backward cover them all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .quantization.autocast import autocast
from .quantization.step_record import (
    FP8StepMembership,
    find_quantizers,
    record_fp8_step,
    reset_fp8_state,
    snapshot_fp8_state,
)
from .recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = ["make_graphed_callables"]

#: Recipes whose state the graphed path keeps static (the block-scaled recipes carry no
#: per-step state, but their casts are not yet checked under capture).
_GRAPHABLE_RECIPES = (DelayedScaling, Float8CurrentScaling)


def make_graphed_callables(
    modules: Union[Callable, tuple[Callable, ...]],
    sample_args: Union[tuple[torch.Tensor, ...], tuple[tuple[torch.Tensor, ...], ...]],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Optional[Union[dict[str, Any], tuple[dict[str, Any], ...]]] = None,
    fp8_enabled: bool = False,
    fp8_calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
    fp8_weight_caching: bool = False,
    _order: Optional[list[int]] = None,
    _num_layers_per_chunk: Optional[list[int]] = None,
    pool: Optional[tuple[int, ...]] = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
) -> Union[Callable, tuple[Callable, ...]]:
    """CUDA-graphed versions of ``modules`` (one callable, or a tuple), as Transformer
    Engine's ``make_graphed_callables``.

    ``sample_args``: the positional tensors of each callable (a tuple, or a tuple of
    tuples for several callables); the graphs replay on tensors of these shapes, dtypes
    and ``requires_grad``. ``num_warmup_iters`` eager passes before capture.
    ``fp8_enabled``: capture under ``tp_fuse.autocast(recipe=fp8_recipe,
    amax_reduction_group=fp8_group)`` (default recipe ``DelayedScaling()``); the delayed
    scales are then updated after each backward pass, outside the graphs (module
    docstring). ``pool``: a ``torch.cuda.graph_pool_handle()`` the graphs share.

    Not supported, refused with a ValueError naming the argument: ``sample_kwargs``,
    ``fp8_calibrating``, ``fp8_weight_caching``, ``_order``/``_num_layers_per_chunk``/
    ``_reuse_graph_input_output_buffers`` (pipeline-parallel schedules),
    ``retain_graph_in_backward``, recipes other than delayed and current scaling. Without
    CUDA: a RuntimeError (CUDA graphs need a GPU).
    """
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    recipe = _check_arguments(callables, args, num_warmup_iters, sample_kwargs, fp8_enabled, fp8_calibrating,
                              fp8_recipe, fp8_group, fp8_weight_caching, _order, _num_layers_per_chunk,
                              retain_graph_in_backward, _reuse_graph_input_output_buffers)
    if not torch.cuda.is_available():
        raise RuntimeError("tp_fuse.make_graphed_callables: CUDA graphs need a GPU, and CUDA is not available here")
    if not fp8_enabled:
        return torch.cuda.make_graphed_callables(modules, sample_args, num_warmup_iters=num_warmup_iters,
                                                 allow_unused_input=allow_unused_input, pool=pool)
    assert recipe is not None
    rng = torch.cuda.get_rng_state()
    snapshot = snapshot_fp8_state(find_quantizers(callables))
    membership = FP8StepMembership()
    with record_fp8_step(membership):
        for _ in range(num_warmup_iters):
            for fn, a in zip(callables, args):
                _eager_pass(fn, a, recipe, fp8_group, allow_unused_input)
    quantizers = find_quantizers(callables)
    found = {id(q) for q in quantizers}
    # A quantizer the modules do not hold could not be reset nor grouped before capture:
    # its first update would rebind state the graphs hold.
    assert all(id(q) in found for q in membership.quantizers()), \
        "a delayed-scaling quantizer used by the graphed callables is not reachable from their modules"
    reset_fp8_state(quantizers, snapshot)  # also fixes the delayed groups: no rebinding from here on
    with record_fp8_step(FP8StepMembership()), autocast(recipe=recipe, amax_reduction_group=fp8_group):
        graphed = torch.cuda.make_graphed_callables(callables, args, num_warmup_iters=1,
                                                    allow_unused_input=allow_unused_input, pool=pool)
    reset_fp8_state(quantizers, snapshot)
    torch.cuda.set_rng_state(rng)
    update = _UpdateOnce(membership)
    for g in graphed:
        g.forward = _with_update_after_backward(g, g.forward, update)
    return graphed[0] if single else graphed


def _check_arguments(
    callables: Sequence[Any], args: Sequence[Any], num_warmup_iters: Any, sample_kwargs: Any, fp8_enabled: Any,
    fp8_calibrating: Any, fp8_recipe: Any, fp8_group: Any, fp8_weight_caching: Any, order: Any,
    layers_per_chunk: Any, retain_graph: Any, reuse_buffers: Any,
) -> Optional[Recipe]:
    """The arguments' checks (ValueError naming the argument); the recipe in force."""
    who = "tp_fuse.make_graphed_callables"
    if len(callables) != len(args) or not all(isinstance(a, tuple) for a in args):
        raise ValueError(f"{who}: sample_args: expected a tuple of tensors per callable ({len(callables)} callables)")
    if not isinstance(num_warmup_iters, int) or isinstance(num_warmup_iters, bool) or num_warmup_iters < 1:
        raise ValueError(f"{who}: num_warmup_iters: expected an int >= 1, got {num_warmup_iters!r}")
    if sample_kwargs is not None and any(kw for kw in (sample_kwargs if isinstance(sample_kwargs, tuple)
                                                         else (sample_kwargs,))):
        raise ValueError(f"{who}: sample_kwargs is not supported (torch.cuda.make_graphed_callables takes "
                         "positional tensors only): pass the tensors positionally")
    unsupported = {
        "fp8_calibrating": (fp8_calibrating, "calibration is not supported"),
        "fp8_weight_caching": (fp8_weight_caching, "FP8 weight caching across micro-batches is not supported "
                                                   "in graphs yet"),
        "_order": (order is not None, "pipeline-parallel schedules are not supported"),
        "_num_layers_per_chunk": (layers_per_chunk is not None, "pipeline-parallel schedules are not supported"),
        "_reuse_graph_input_output_buffers": (reuse_buffers, "pipeline-parallel schedules are not supported"),
        "retain_graph_in_backward": (retain_graph, "torch.cuda.make_graphed_callables frees the backward graph"),
    }
    for name, (given, why) in unsupported.items():
        if given:
            raise ValueError(f"{who}: {name}: {why}; got {name}={given!r}")
    if not isinstance(fp8_enabled, bool):
        raise ValueError(f"{who}: fp8_enabled: expected a bool, got {fp8_enabled!r}")
    if fp8_group is not None and not isinstance(fp8_group, dist.ProcessGroup):
        raise ValueError(f"{who}: fp8_group: expected a torch.distributed.ProcessGroup or None, "
                         f"got {type(fp8_group).__name__}")
    if not fp8_enabled:
        return None
    recipe = DelayedScaling() if fp8_recipe is None else fp8_recipe
    if not isinstance(recipe, _GRAPHABLE_RECIPES):
        raise ValueError(f"{who}: fp8_recipe: expected DelayedScaling or Float8CurrentScaling under CUDA graphs, "
                         f"got {type(recipe).__name__}")
    for fn in callables:
        if not isinstance(fn, torch.nn.Module):
            raise ValueError(f"{who}: modules: with fp8_enabled every callable must be a torch.nn.Module (its "
                             f"FP8 state is found through its submodules), got {type(fn).__name__}")
    return recipe


def _eager_pass(fn: Callable, args: tuple[torch.Tensor, ...], recipe: Recipe, group: Optional[dist.ProcessGroup],
                allow_unused: bool) -> None:
    """One eager forward + backward of ``fn`` (the warm-up), as torch's warm-up does it."""
    with autocast(recipe=recipe, amax_reduction_group=group):
        out = fn(*args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    inputs += [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, torch.nn.Module) else []
    if outs and inputs:
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], allow_unused=allow_unused)


class _UpdateOnce:
    """The recorded end-of-step FP8 work, queued at most once per backward pass."""

    def __init__(self, membership: FP8StepMembership) -> None:
        self.membership = membership
        self.queued = False

    def queue(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self.membership.reduce_and_update()


class _AfterBackward(torch.autograd.Function):
    """Identity on the graphed outputs whose backward queues the end-of-step FP8 work
    for the end of the whole backward pass (after the graphed backward it precedes)."""

    @staticmethod
    def forward(ctx: Any, update: _UpdateOnce, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.update = update
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        ctx.update.queue()
        return (None, *grads)


def _with_update_after_backward(module: torch.nn.Module, replay: Callable, update: _UpdateOnce) -> Callable:
    """``module``'s graphed forward, its outputs passed through :class:`_AfterBackward`."""

    def forward(*args: Any) -> Any:
        out = replay(*args)
        if not (module.training and torch.is_grad_enabled()):
            return out  # torch ran the module eagerly: eager FP8 bookkeeping applies
        flat = out if isinstance(out, tuple) else (out,)
        grads = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not grads:
            return out
        wrapped = list(flat)
        for i, o in zip(grads, _AfterBackward.apply(update, *(flat[i] for i in grads))):
            wrapped[i] = o
        return tuple(wrapped) if isinstance(out, tuple) else wrapped[0]

    return forward
