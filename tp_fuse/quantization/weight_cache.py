"""FP8 weights cast once per optimizer step and reused across micro-batches.

With gradient accumulation every micro-batch's forward casts the same weights to FP8
again (one kernel per weight, and its amax). Transformer Engine caches the first
micro-batch's FP8 weight (``is_first_microbatch``, ``fp8_weight_caching``); this is the
same, as an explicit object::

    cache = tp_fuse.FP8WeightCache()
    for step in steps:
        for micro_batch in micro_batches:
            with tp_fuse.autocast(recipe=recipe, weight_cache=cache):
                loss = model(micro_batch)
            loss.backward()
        optimizer.step()
        cache.clear()            # the weights changed: cast them again next step

A cached FP8 weight is reused only while it is provably the cast of the weight as it
is now: the same parameter object and storage, an unchanged version counter (every
in-place write through the parameter -- ``optimizer.step()``, ``load_state_dict``, an
edit under ``no_grad`` -- bumps it), no ``torch.optim`` optimizer step anywhere in the
process since the cast (a global step hook: writes through ``param.data``, as optimizers
and frameworks that copy into ``.data`` after their step do, bump no version counter),
the same quantizer (a new recipe builds new ones) and a cast with the copies the GEMMs
need. Call ``cache.clear()`` after a write to the weights outside an optimizer step
through ``.data``.

Current scaling with an amax reduction group of several ranks casts every micro-batch:
the cast all-reduces the weight's amax, and whether a cached cast is still valid is
decided per rank (storage and version counters are per-rank facts, e.g. under FSDP2's
re-gathered weights), so a rank that reused its cast would leave the others waiting.

Every later micro-batch of the window sees the first micro-batch's cast, reused or not:
when the cached cast cannot be reused (a storage or version change, e.g. FSDP2 gathers
its weights again for every micro-batch) the weight is cast again *with the first cast's
scale and without recording its amax* (``Quantizer.recast_in_window``), the bytes a reuse
would have given for unchanged values. So whether a rank reuses or recasts never changes
the numbers (FSDP2 and DDP train alike), and changed values still reach the GEMM. This is
Transformer Engine's weight caching (``skip_fp8_weight_update``): later micro-batches
record no weight amax; the weight quantizer still joins each step's reduction, its history
slot saying "no data". The cached tensor keeps its own ``scale_inv``, so later scale
updates do not change its value.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .float8.tensor import Float8Tensor

__all__ = ["FP8WeightCache"]


class _OptimizerSteps:
    """How many ``torch.optim`` optimizer steps this process has taken since the first
    ``FP8WeightCache`` was made (one step post-hook, registered then, once)."""

    count = 0
    _hook = None

    @classmethod
    def watch(cls) -> None:
        if cls._hook is None:
            cls._hook = register_optimizer_step_post_hook(cls._stepped)

    @classmethod
    def _stepped(cls, optimizer: Any, args: Any, kwargs: Any) -> None:
        cls.count += 1


class FP8WeightCache:
    """FP8 casts of weights, reused by later micro-batches of one optimizer step.

    Holds one FP8 weight (and its transposed copy or decode, where the backward needs
    them) per Linear until :meth:`clear`: memory of about one FP8 copy of the weights
    (plus an fp32 decode per weight on CPU, where the GEMM reads decoded operands).
    """

    def __init__(self) -> None:
        # id(op) -> (key, FP8 weight, the first cast's state for recasts); the key pins
        # everything the cast depended on.
        self._entries: dict[int, tuple[tuple, Float8Tensor, Any]] = {}
        self.hits = 0
        self.misses = 0
        _OptimizerSteps.watch()

    def clear(self) -> None:
        """Forget every cast (after ``optimizer.step()``, a checkpoint load, or any write
        to the weights)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def weight(
        self, op: Any, weight: torch.Tensor, quantizer: Any, copies: tuple, cast: Callable[[Any], Float8Tensor]
    ) -> tuple[Float8Tensor, bool]:
        """``(FP8 weight, cast_now)``: the cached cast of ``weight`` for ``op`` when it is
        still valid (see the module doc), else ``cast(recast)``'s result, stored:
        ``recast`` None for the window's first cast of ``op`` (a normal cast), else the
        first cast's state (``Quantizer.window_state``) to repeat. ``copies`` names what
        the cast made besides the bytes (transposed copy, kept decode)."""
        key = (id(weight), weight.data_ptr(), weight._version, _OptimizerSteps.count, id(quantizer), copies)
        entry = self._entries.get(id(op))
        if entry is not None and entry[0][3] != key[3]:
            entry = None  # an optimizer step since: the window is over, cast as its first
        if entry is not None and entry[0] == key:
            self.hits += 1
            return entry[1], False
        if entry is not None and entry[2] is not None and entry[0][4] == id(quantizer):
            state = entry[2]
            fresh = cast(state)
        else:
            # The window's first cast of this op (or a new quantizer: a new recipe).
            state = quantizer.window_state()
            fresh = cast(None)
        self._entries[id(op)] = (key, fresh, state)
        self.misses += 1
        return fresh, True


def check_weight_cache(who: str, cache: Optional[FP8WeightCache]) -> None:
    """Validate a ``weight_cache`` argument."""
    if cache is not None and not isinstance(cache, FP8WeightCache):
        raise ValueError(f"{who}: weight_cache: expected a tp_fuse.FP8WeightCache or None, got {type(cache).__name__}")
