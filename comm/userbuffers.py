"""Registered, reused communication workspaces ("userbuffers").

Overlap algorithms need the same scratch tensors every step (gathered inputs, partial sums,
receive buffers). Allocating them once and handing back the same storage each step keeps
the allocator out of the hot loop and, on CUDA, lets the buffers be registered once for
peer access. A :class:`UserBufferPool` is an ordinary object that callers create and pass
in; buffers are keyed by ``(process group, name, device)``.

Each buffer is one flat byte tensor; :meth:`UserBufferPool.get` returns a view of its
first ``numel * itemsize`` bytes with the requested dtype and shape, so one registration
serves fp32 partial sums and FP8 data (as ``torch.uint8``) alike.

Memory kinds:

* CUDA with ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``) present,
  and (with ``use_symmetric_memory="auto"``) an NCCL group: buffers are allocated as symmetric memory and rendezvoused over the group, so peers can
  map each other's buffers (:meth:`UserBufferPool.symmetric_handle`). The overlap
  algorithms in :mod:`tp_fuse.comm.overlap` still move data with NCCL point-to-point on these
  buffers; a peer-write (copy-engine) path is not implemented.
* CUDA without symmetric memory: plain device tensors (NCCL point-to-point).
* CPU: plain tensors (gloo point-to-point).

Collective caveat: with symmetric memory, allocating or growing a buffer is a collective
over the group, so every rank must request the same buffers in the same order with the
same sizes (the overlap algorithms do). If the rendezvous fails (a platform without peer
access, say), its error propagates: there is no silent fallback to plain tensors; pass
``use_symmetric_memory=False`` to choose them explicitly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["UserBufferPool", "symmetric_memory_available"]


def symmetric_memory_available(device: torch.device | str) -> bool:
    """True when PyTorch symmetric memory can back buffers on ``device``.

    Only CUDA devices qualify, and only when ``torch.distributed._symmetric_memory``
    imports and provides ``empty`` and ``rendezvous`` (the API this pool uses).
    """
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


def _norm_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` so that one GPU has one key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _group_key(group: ProcessGroup | None) -> str:
    g = group if group is not None else dist.group.WORLD
    if g is None:
        raise ValueError("no process group given and the default process group is not initialized")
    return g.group_name


@dataclass
class _Registered:
    storage: torch.Tensor  # flat uint8, contiguous
    handle: Any | None  # _SymmetricMemory handle when symmetric

    @property
    def nbytes(self) -> int:
        return self.storage.numel()


class UserBufferPool:
    """Named communication workspaces, allocated once and reused.

    Args:
        use_symmetric_memory: ``"auto"`` uses symmetric memory for CUDA buffers where
            :func:`symmetric_memory_available` says so; ``True`` requires it (ValueError on a
            device without it); ``False`` never uses it.

    A request larger than a buffer's registered size reallocates it and warns once for
    that growth (naming the buffer, old and new size in bytes); further requests up to the
    new size reuse it silently. Buffers are never shrunk. Use :meth:`reserve` to register
    the largest size up front.

    Lifetime: a buffer's contents are valid until the next :meth:`get` of the same key
    writes to it; algorithms that return data to the caller must not return pool views.
    """

    def __init__(self, *, use_symmetric_memory: bool | Literal["auto"] = "auto") -> None:
        if use_symmetric_memory not in (True, False, "auto"):
            raise ValueError(
                f"use_symmetric_memory must be True, False or 'auto', got {use_symmetric_memory!r}"
            )
        self.use_symmetric_memory = use_symmetric_memory
        self._buffers: dict[tuple[str, str, torch.device], _Registered] = {}

    def _wants_symmetric(self, group: ProcessGroup | None, device: torch.device) -> bool:
        if self.use_symmetric_memory is False:
            return False
        available = symmetric_memory_available(device)
        if self.use_symmetric_memory is True:
            if not available:
                raise ValueError(
                    f"use_symmetric_memory=True but symmetric memory is not available on {device} "
                    "(it needs CUDA and torch.distributed._symmetric_memory.empty/rendezvous)"
                )
            return True
        # "auto": only over an NCCL group, which guarantees one GPU per rank. A gloo group
        # on CUDA tensors may put several ranks on one GPU (make gpu-check's TP=2 does),
        # where the rendezvous refuses "allocations from overlapping devices".
        g = group if group is not None else dist.group.WORLD
        return available and "nccl" in str(dist.get_backend(g))

    def _allocate(self, group: ProcessGroup | None, nbytes: int, device: torch.device) -> _Registered:
        if self._wants_symmetric(group, device):
            from torch.distributed import _symmetric_memory as symm_mem

            g = group if group is not None else dist.group.WORLD
            storage = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            # Collective over the group: maps every peer's buffer into this process.
            handle = symm_mem.rendezvous(storage, g)
            return _Registered(storage, handle)
        return _Registered(torch.empty(nbytes, dtype=torch.uint8, device=device), None)

    def reserve(self, group: ProcessGroup | None, name: str, nbytes: int, device: torch.device | str) -> None:
        """Register buffer ``name`` with at least ``nbytes`` bytes, without a growth warning."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        device = _norm_device(device)
        key = (_group_key(group), name, device)
        reg = self._buffers.get(key)
        if reg is None or reg.nbytes < nbytes:
            self._buffers[key] = self._allocate(group, max(nbytes, 1), device)

    def get(
        self,
        group: ProcessGroup | None,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> torch.Tensor:
        """Contiguous tensor of ``shape``/``dtype`` on the registered buffer ``name``.

        The same storage (same ``data_ptr``) is returned on every call unless a request
        exceeds the registered size. Contents are unspecified (not zeroed).
        """
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"buffer {name!r}: negative dimension in shape {shape}")
        device = _norm_device(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        key = (_group_key(group), name, device)
        reg = self._buffers.get(key)
        if reg is None:
            reg = self._buffers[key] = self._allocate(group, max(nbytes, 1), device)
        elif reg.nbytes < nbytes:
            warnings.warn(
                f"UserBufferPool: buffer {name!r} (group {key[0]}, {device}) grows from "
                f"{reg.nbytes} to {nbytes} bytes; reserve() it at its largest size to avoid "
                "reallocating during training",
                RuntimeWarning,
                stacklevel=2,
            )
            reg = self._buffers[key] = self._allocate(group, nbytes, device)
        return reg.storage[:nbytes].view(dtype).view(shape)

    def registered_bytes(self, group: ProcessGroup | None, name: str, device: torch.device | str) -> int:
        """Registered size of buffer ``name`` in bytes (0 if it does not exist)."""
        reg = self._buffers.get((_group_key(group), name, _norm_device(device)))
        return 0 if reg is None else reg.nbytes

    def symmetric_handle(
        self, group: ProcessGroup | None, name: str, device: torch.device | str
    ) -> Any | None:
        """The ``_SymmetricMemory`` handle of buffer ``name``, or None if it is not symmetric."""
        reg = self._buffers.get((_group_key(group), name, _norm_device(device)))
        return None if reg is None else reg.handle

    @property
    def total_bytes(self) -> int:
        """Bytes held by all buffers of this pool."""
        return sum(r.nbytes for r in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Drop all buffers (the next :meth:`get` of each allocates afresh)."""
        self._buffers.clear()
