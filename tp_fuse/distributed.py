"""Activation recompute (``checkpoint``) that keeps FP8 state consistent.

``checkpoint(function, *args)`` runs ``function`` without keeping its activations and
runs it again in the backward pass to rebuild them, through PyTorch's own engine
(``torch.utils.checkpoint.checkpoint``, non-reentrant by default; ``use_reentrant=True``
selects its reentrant engine). What this module adds is the state the recomputed forward
must share with the first one:

* **FP8 autocast.** The backward pass runs outside ``tp_fuse.autocast``; the recompute
  re-enters the *same* autocast context (same recipe and amax group, same step state,
  so gradient quantizers join the same end-of-backward amax reduction) without
  issuing a second forward amax reduction when it ends.
* **Delayed-scaling scales.** By the time the backward pass runs, the outermost
  autocast has reduced this step's amaxes and updated every scale. The recompute must
  quantize with the scales of the first forward (otherwise the rebuilt activations
  differ from the ones the loss was computed with), and must not fold its amaxes into
  the next step's history slot (that would record the step's amax twice). So the
  scales of every delayed-scaling quantizer inside the region are snapshotted at the end
  of the first forward, swapped in for the recompute, and the live scales and the
  history slot written by the recompute are restored after it.
* **Current-scaling statistics** (last amax, counters) are restored after the
  recompute the same way: the step is counted once.
* **Dropout RNG.** torch's global RNG is preserved by ``torch.utils.checkpoint``; a
  model-specific tracker (``get_rng_state_tracker``, an object with ``get_states()`` /
  ``set_states(states)`` like Megatron's CUDA RNG tracker) is snapshotted and replayed
  the same way, so dropout masks are identical.

Transformer Engine's ``transformer_engine.pytorch.checkpoint`` has the same purpose and
arguments, both engines included. Differences: the default here is ``use_reentrant=False``
(TE's is True; the gradients are the same), and ``distribute_saved_activations`` is not
implemented (ValueError).

``use_reentrant=True`` is PyTorch's reentrant engine (as TE's ``_CheckpointFunction``): the
region runs under ``no_grad``, only its positional inputs are saved, and the backward pass
reruns it with grad enabled and backpropagates through the rerun; gradients reach the
positional tensor inputs that require grad (at least one must, or the output has no
gradient), not tensors passed by keyword, and only ``loss.backward()`` (not
``torch.autograd.grad``) may run it. That engine takes no ``context_fn``: the FP8 / RNG
state above is set up by the function it calls (:class:`_ReentrantRun`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from .quantization.autocast import AutocastContext, current_autocast, reenter_autocast
from .quantization.float8.current_scaling import CurrentScalingQuantizer
from .quantization.float8.delayed_scaling import DelayedScalingQuantizer
from .ops.basic.grouped_linear import GroupQuantizers
from .quantization.op_quantizers import OpQuantizers

__all__ = ["checkpoint", "checkpoint_eager", "fp8_quantizers"]

# torch.utils.checkpoint's own keyword arguments (the rest are the checkpointed function's).
_TORCH_OPTIONS = ("preserve_rng_state", "determinism_check", "debug")

# The state a current-scaling quantize writes in place (its buffers are never rebound).
_CURRENT_SCALING_STATE = ("scale", "last_amax", "nonfinite_amax_count", "zero_amax_count")


def fp8_quantizers(modules: list[torch.nn.Module]) -> list[Any]:
    """Every quantizer owned by an op inside ``modules`` (built ones only), deduplicated.

    Inside means a submodule, or a module a module runs without registering it and lists in
    its ``unregistered_modules()`` (``tp_fuse.te``'s module classes: their ops block, kept
    out of the module tree so that the parameters carry Transformer Engine's names)."""
    seen: dict[int, Any] = {}
    pending = list(modules)
    while pending:
        for m in pending.pop().modules():
            owned = getattr(m, "_quantizers", None)
            groups = owned.groups if isinstance(owned, GroupQuantizers) else [owned]
            for g in groups:
                if isinstance(g, OpQuantizers):
                    for q in g.quantizers.values():
                        seen.setdefault(id(q), q)
            unregistered = getattr(m, "unregistered_modules", None)
            if unregistered is not None:
                pending.extend(unregistered())
    return list(seen.values())


class _RecomputeState:
    """What the first forward of one checkpointed call leaves for its recompute."""

    def __init__(self, modules: list[torch.nn.Module], rng_tracker: Any) -> None:
        self.modules = modules
        self.rng_tracker = rng_tracker
        self.autocast: Optional[AutocastContext] = None
        self.rng_states: Any = None
        self.scales: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def first_forward(self) -> Iterator[None]:
        self.autocast = current_autocast()
        if self.rng_tracker is not None:
            self.rng_states = self.rng_tracker.get_states()
        yield
        # Scales do not change during a forward (updates happen at autocast exit), so the
        # end of the region sees the scales every quantize in it used -- including those
        # of quantizers built lazily by this very forward.
        for q in fp8_quantizers(self.modules):
            if isinstance(q, DelayedScalingQuantizer):
                self.scales[id(q)] = q.scale.detach().clone()

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        quantizers = fp8_quantizers(self.modules)
        live: list[tuple[Any, Any]] = []
        with torch.no_grad():
            for q in quantizers:
                if isinstance(q, DelayedScalingQuantizer) and id(q) in self.scales:
                    live.append((q, (q.scale.clone(), q.amax_history[0].clone())))
                    q.scale.copy_(self.scales[id(q)])
                elif isinstance(q, CurrentScalingQuantizer):
                    live.append((q, tuple(getattr(q, a).clone() for a in _CURRENT_SCALING_STATE)))
        rng_live = None
        if self.rng_tracker is not None:
            rng_live = self.rng_tracker.get_states()
            self.rng_tracker.set_states(self.rng_states)
        try:
            with reenter_autocast(self.autocast):
                yield
        finally:
            if self.rng_tracker is not None:
                self.rng_tracker.set_states(rng_live)
            with torch.no_grad():
                for q, saved in live:
                    if isinstance(q, DelayedScalingQuantizer):
                        q.scale.copy_(saved[0])
                        q.amax_history[0] = saved[1]
                    else:
                        for name, value in zip(_CURRENT_SCALING_STATE, saved):
                            getattr(q, name).copy_(value)


class _ReentrantRun:
    """``function(*args, **kwargs)`` for PyTorch's reentrant engine, which calls it twice and
    takes no ``context_fn``: the first call (the forward) inside ``state.first_forward()``,
    every later one (the recompute in the backward pass) inside ``state.recompute()``. The
    keyword arguments are bound here: that engine passes positional inputs only."""

    def __init__(self, function: Callable[..., Any], kwargs: dict[str, Any], state: _RecomputeState) -> None:
        self.function, self.kwargs, self.state = function, kwargs, state
        self.ran_forward = False

    def __call__(self, *args: Any) -> Any:
        region = self.state.recompute() if self.ran_forward else self.state.first_forward()
        self.ran_forward = True
        with region:
            return self.function(*args, **self.kwargs)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in backward, FP8
    scales and dropout streams of the first forward replayed: see :func:`checkpoint_eager`
    for the arguments.

    Under torch.compile this is a graph break (dynamo cannot trace torch.utils.checkpoint
    with a custom ``context_fn``); compile the function passed in instead (the launcher
    does so for full recompute), and its recompute runs the compiled code too.
    """
    if torch.compiler.is_compiling():
        # Imported while dynamo traces: see tp_fuse/graph_breaks.py.
        from .graph_breaks import eager_call

        return eager_call(checkpoint_eager, function, *args, **kwargs)
    return checkpoint_eager(function, *args, **kwargs)


def checkpoint_eager(
    function: Callable[..., Any],
    *args: Any,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Optional[Callable[[], Any]] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    use_reentrant: bool = False,
    modules: Optional[list[torch.nn.Module]] = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in backward.

    Args:
        function: the region to recompute; if it is an ``nn.Module`` its FP8 quantizers
            are found by itself, otherwise pass the modules it runs in ``modules``.
        distribute_saved_activations: not implemented (ValueError if True).
        get_rng_state_tracker: returns an object with ``get_states()`` /
            ``set_states(states)`` (e.g. ``tp_fuse.layers.DropoutRNG``) whose streams the region
            draws from; replayed for the recompute.
        tp_group: accepted for Transformer Engine compatibility (only used by
            ``distribute_saved_activations`` there).
        use_reentrant: False (default): PyTorch's non-reentrant engine; True: its reentrant
            engine (the module docstring says what differs).
        modules: the modules whose quantizers the region uses (default: ``[function]``
            when ``function`` is a module, else none -- then FP8 regions raise).
    """
    if distribute_saved_activations:
        raise ValueError("tp_fuse.checkpoint: distribute_saved_activations=True is not implemented")
    if not isinstance(use_reentrant, bool):
        raise ValueError(f"tp_fuse.checkpoint: use_reentrant must be a bool, got {use_reentrant!r}")
    if modules is None:
        if not isinstance(function, torch.nn.Module):
            raise ValueError("tp_fuse.checkpoint: function is not an nn.Module: pass the modules it runs as modules=[...] "
                             "(their FP8 scales are replayed in the recompute)")
        modules = [function]
    del tp_group  # no distributed saving of activations: nothing to do with it
    state = _RecomputeState(list(modules), get_rng_state_tracker() if get_rng_state_tracker is not None else None)
    if use_reentrant:
        # torch's own options stay torch's; every other keyword is the function's.
        options = {k: kwargs.pop(k) for k in _TORCH_OPTIONS if k in kwargs}
        return torch_checkpoint.checkpoint(_ReentrantRun(function, kwargs, state), *args, use_reentrant=True,
                                           **options)
    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (state.first_forward(), state.recompute()), **kwargs,
    )


#: Transformer Engine's ``transformer_engine.pytorch.distributed`` names, defined in the TE room.
_TE_NAMES = frozenset({"CudaRNGStatesTracker", "activation_recompute_forward", "is_fp8_activation_recompute_enabled"})


def __getattr__(name: str) -> Any:
    if name in _TE_NAMES:
        # Lazy: the TE room (tp_fuse.te) sits on tp_fuse.layers, which imports this module.
        from .te import distributed as te_distributed

        return getattr(te_distributed, name)
    raise AttributeError(f"module 'tp_fuse.distributed' has no attribute {name!r}")
