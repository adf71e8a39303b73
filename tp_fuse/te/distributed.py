"""Transformer Engine's ``transformer_engine.pytorch.distributed`` names that ``tp_fuse.distributed``
(tp_fuse's own module: ``checkpoint``) does not define: ``CudaRNGStatesTracker``,
``activation_recompute_forward``, ``is_fp8_activation_recompute_enabled``.

``tp_fuse.distributed`` serves these lazily (module ``__getattr__``), so TE's path
``te.distributed.CudaRNGStatesTracker`` works with ``import tp_fuse as te``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Optional

import torch

from tp_fuse.quantization.autocast import active_autocast

# Not ``checkpoint``: TE's path to it is ``tp_fuse.distributed`` itself, which serves these names
# (importing it here would close a circle with that module's lazy import of this one).
__all__ = ["CudaRNGStatesTracker", "activation_recompute_forward", "is_fp8_activation_recompute_enabled"]

#: TE's default stream name for ``fork()`` (Megatron's model-parallel stream).
_DEFAULT_NAME = "model-parallel-rng"

_RECOMPUTE: contextvars.ContextVar[Optional[tuple[bool, bool]]] = contextvars.ContextVar(
    "tp_fuse_te_activation_recompute", default=None)


class CudaRNGStatesTracker:
    """TE's ``CudaRNGStatesTracker``: named RNG streams, each a saved generator state swapped
    into the device's global RNG inside ``fork(name)`` (dropout drawn in a stream continues it).

    The device RNG is CUDA's where CUDA is available, else the CPU generator (the same
    stream logic as :class:`tp_fuse.layers.DropoutRNG`, with TE's names and API: ``add``,
    ``fork``, ``get_states``, ``set_states``, ``reset``).
    """

    def __init__(self) -> None:
        self.reset()

    def _cuda(self) -> bool:
        return torch.cuda.is_available()

    def _get_global(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self._cuda() else torch.get_rng_state()

    def _set_global(self, state: torch.Tensor) -> None:
        if self._cuda():
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def reset(self) -> None:
        """Forget every stream."""
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """The streams' states (a copy of the dict; :meth:`set_states` puts them back)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed`` (TE: both must be new)."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: rng state {name!r} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator(device="cuda") if self._cuda() else torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _DEFAULT_NAME) -> Iterator[None]:
        """Run the block with stream ``name`` as the global RNG; the caller's is restored after."""
        if name not in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.fork: rng state {name!r} is not added")
        saved = self._get_global()
        self._set_global(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = self._get_global()
            self._set_global(saved)


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False,
                                 recompute_phase: bool = False) -> Iterator[None]:
    """TE's marker around a forward that is (``recompute_phase=False``) or repeats
    (``recompute_phase=True``) a checkpointed region.

    TE's modules read it to save and restore their FP8 scales across the recompute. tp_fuse's
    modules do that only inside :func:`tp_fuse.distributed.checkpoint` (which also re-enters
    the first forward's autocast), so an FP8 region recomputed by another engine under this
    marker would quantize with the wrong scales: that combination raises
    ``NotImplementedError``. Without FP8 the marker only records the phase
    (:func:`is_fp8_activation_recompute_enabled`).
    """
    if activation_recompute and active_autocast() is not None:
        raise NotImplementedError(
            "activation_recompute_forward under FP8: tp_fuse restores FP8 scales for a recompute only "
            "inside tp_fuse.distributed.checkpoint (TE's te_checkpoint / distributed.checkpoint); use it")
    token = _RECOMPUTE.set((bool(activation_recompute), bool(recompute_phase)))
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


def is_fp8_activation_recompute_enabled() -> bool:
    """Whether the caller runs inside ``activation_recompute_forward(activation_recompute=True)``."""
    state = _RECOMPUTE.get()
    return state is not None and state[0]
