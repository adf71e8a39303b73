"""Dropout RNG streams that are correct under tensor parallelism.

Dropout masks must be

* identical on all TP ranks where the activation is replicated (hidden dropout without
  sequence parallelism: every rank holds the same ``[s, b, h]`` tensor), and
* independent across TP ranks where each rank holds a different slice (attention
  dropout on this rank's heads; hidden dropout on this rank's sequence shard with SP).

Megatron-LM solves this with a CUDA RNG tracker whose "model-parallel" state is seeded
with ``seed + 2718 + tp_rank``. :class:`DropoutRNG` is the same idea as an ordinary
object (no global registry): two saved generator states, swapped into torch's global
RNG around the ops that draw masks (``tp_fuse.ops.Dropout`` and
``scaled_dot_product_attention`` both use the global RNG).

The states are part of the training state: :meth:`state_dict` / :meth:`load_state_dict`
let a checkpoint resume the exact dropout stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, Optional

import torch

__all__ = ["DropoutRNG", "Stream", "TrackerRNG"]

Stream = Literal["replicated", "tp_local"]
# Megatron-LM's offset between the data-parallel and model-parallel seeds.
_TP_SEED_OFFSET = 2718


class DropoutRNG:
    """Two RNG streams for dropout: ``"replicated"`` (same on all TP ranks) and ``"tp_local"``.

    Args:
        seed: base seed; the replicated stream uses it as is, the TP-local one
            ``seed + 2718 + tp_rank``. Give data-parallel replicas different seeds if
            their dropout masks should differ.
        tp_rank: this rank's index in its TP group.
        device: device whose RNG the ops use (CPU generator, or the CUDA device's).
    """

    def __init__(self, seed: int, tp_rank: int, device: Optional[torch.device | str] = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"DropoutRNG: seed must be an int, got {seed!r}")
        self.seed, self.tp_rank = seed, tp_rank
        self.reset(device)

    def reset(self, device: Optional[torch.device | str] = None) -> None:
        """Restart both streams from the seed, drawing on ``device`` (e.g. a model built
        on ``meta`` and materialized on its real device)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        # A meta "device" has no RNG: the streams are made for the real device on reset.
        self.device = torch.device("cpu") if device.type == "meta" else device
        self._states: dict[str, torch.Tensor] = {
            "replicated": self._initial_state(self.seed),
            "tp_local": self._initial_state(self.seed + _TP_SEED_OFFSET + self.tp_rank),
        }

    def _initial_state(self, seed: int) -> torch.Tensor:
        if self.device.type == "cuda":
            gen = torch.Generator(device=self.device)
        else:
            gen = torch.Generator()
        gen.manual_seed(seed)
        return gen.get_state()

    def _get_global(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_global(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, stream: Stream) -> Iterator[None]:
        """Run the block with ``stream`` as torch's global RNG; restore the caller's after."""
        if stream not in self._states:
            raise ValueError(f"DropoutRNG: unknown stream {stream!r}; expected 'replicated' or 'tp_local'")
        saved = self._get_global()
        self._set_global(self._states[stream])
        try:
            yield
        finally:
            self._states[stream] = self._get_global()
            self._set_global(saved)

    # Megatron's RNG-tracker names: tp_fuse.checkpoint replays the streams for recompute.
    def get_states(self) -> dict[str, torch.Tensor]:
        """The streams' states (copies); :meth:`set_states` puts them back."""
        return self.state_dict()

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(states)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self._states):
            raise ValueError(f"DropoutRNG.load_state_dict: expected keys {sorted(self._states)}, got {sorted(state)}")
        self._states = {k: v.clone() for k, v in state.items()}


class TrackerRNG:
    """Megatron-LM's / Transformer Engine's RNG tracker behind :class:`DropoutRNG`'s interface.

    ``get_rng_state_tracker`` (TE's argument: a callable returning the tracker, read at every
    use) or None. Stream ``"tp_local"`` runs inside ``get_rng_state_tracker().fork()`` (the
    tracker's model-parallel state, as TE's attention dropout), ``"replicated"`` on torch's
    global RNG (as Megatron's and TE's hidden dropout); without a tracker both use the
    global RNG, as TE does. ``get_states`` / ``set_states`` are the tracker's, so
    ``tp_fuse.checkpoint`` replays them for a recompute.
    """

    def __init__(self, get_rng_state_tracker: Optional[Callable[[], Any]]) -> None:
        if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
            raise ValueError("TrackerRNG: get_rng_state_tracker must be callable or None, "
                             f"got {get_rng_state_tracker!r}")
        self.get_rng_state_tracker = get_rng_state_tracker

    def fork(self, stream: Stream) -> contextlib.AbstractContextManager:
        if stream not in ("replicated", "tp_local"):
            raise ValueError(f"TrackerRNG: unknown stream {stream!r}; expected 'replicated' or 'tp_local'")
        if stream == "replicated" or self.get_rng_state_tracker is None:
            return contextlib.nullcontext()
        return self.get_rng_state_tracker().fork()

    def get_states(self) -> Any:
        return {} if self.get_rng_state_tracker is None else self.get_rng_state_tracker().get_states()

    def set_states(self, states: Any) -> None:
        if self.get_rng_state_tracker is not None:
            self.get_rng_state_tracker().set_states(states)


def maybe_fork(rng: DropoutRNG | TrackerRNG, stream: Stream, active: bool) -> contextlib.AbstractContextManager:
    """``rng.fork(stream)`` when dropout is active, else a no-op (zero cost at p = 0)."""
    return rng.fork(stream) if active else contextlib.nullcontext()
