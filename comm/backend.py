"""Backend choice and process-group start-up.

NCCL on CUDA, gloo on CPU. ``init_distributed`` reads the environment that ``torchrun``
sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and, when none of it is
present, starts a real one-process group on a file store in a fresh temporary directory,
so that code written for N ranks runs unchanged with one (collectives are then identity
operations, but they are real calls on a real group).

Everything this module creates is returned in a :class:`DistributedContext`; nothing is
kept in module globals (the default process group itself is torch's own global).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "DistributedContext",
    "backend_for_device",
    "device_type_for_backend",
    "device_for_local_rank",
    "init_distributed",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def backend_for_device(device: torch.device | str) -> str:
    """Collective backend for a device: ``"nccl"`` for CUDA, ``"gloo"`` for CPU."""
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        return "nccl"
    if dev_type == "cpu":
        return "gloo"
    raise ValueError(f"no collective backend known for device type {dev_type!r} (expected 'cuda' or 'cpu')")


def device_type_for_backend(backend: str) -> str:
    """Device type whose tensors a backend moves: ``"cuda"`` for NCCL, ``"cpu"`` for gloo.

    A mixed backend string such as ``"cpu:gloo,cuda:nccl"`` maps to ``"cuda"`` when CUDA is
    available (the NCCL part carries the training traffic), else ``"cpu"``.
    """
    b = backend.lower()
    if "nccl" in b and ("gloo" not in b or torch.cuda.is_available()):
        return "cuda"
    if "gloo" in b:
        return "cpu"
    raise ValueError(f"unknown backend {backend!r}: expected one containing 'nccl' or 'gloo'")


def device_for_local_rank(local_rank: int | None = None, device_type: str | None = None) -> torch.device:
    """The device a rank computes on.

    Args:
        local_rank: index of this process on its node; defaults to ``$LOCAL_RANK`` or 0.
        device_type: ``"cuda"`` or ``"cpu"``; defaults to CUDA when available.

    Returns ``cuda:<local_rank>`` on CUDA (ValueError if the node has fewer GPUs), ``cpu`` on
    CPU (all local ranks share the host).
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device_type='cuda' requested but CUDA is not available")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"local rank {local_rank} needs GPU {local_rank}, but this node has {count} GPU(s)"
            )
        return torch.device("cuda", local_rank)
    if device_type == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")


@dataclass
class DistributedContext:
    """What :func:`init_distributed` set up.

    Attributes:
        rank, world_size, local_rank: this process's place in the job.
        device: the device this rank computes on.
        backend: the default group's backend (``"nccl"`` or ``"gloo"``).
        owns_group: True when :func:`init_distributed` created the default group (then
            :meth:`shutdown` destroys it); False when it found one already initialized.
        store_dir: temporary directory of the one-process file store, removed on shutdown.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool
    store_dir: str | None = None

    def shutdown(self) -> None:
        """Destroy the default group if this context created it; remove its store directory."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None

    def abort(self) -> None:
        """After an error on this rank: tear the default group down now (if this context
        owns it), so that peers blocked in a collective with this rank fail at once
        instead of waiting for the group's timeout. NCCL groups are aborted (destroying
        one with work in flight can block); gloo peers see "connection closed by peer"."""
        if self.owns_group and dist.is_initialized():
            if self.backend == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        self.shutdown()

    def __enter__(self) -> "DistributedContext":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def init_distributed(
    backend: str | None = None,
    device_type: str | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> DistributedContext:
    """Initialize the default process group from ``torchrun``'s environment.

    Args:
        backend: ``"nccl"``/``"gloo"``; defaults to :func:`backend_for_device` of the device.
        device_type: ``"cuda"``/``"cpu"``; defaults to CUDA when available.
        timeout: collective timeout of the group.

    Behaviour:
        * If the default group already exists, it is described, not re-created
          (``owns_group=False``).
        * If RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all set: ``env://`` rendezvous.
          On CUDA the rank's device is made current first (NCCL needs it).
        * If none of them is set: a one-process group (rank 0, world size 1) on a
          :class:`torch.distributed.FileStore` in a fresh temporary directory.
        * If only some are set: ValueError naming the missing ones (a half-configured
          launch would otherwise silently run as one process).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for_local_rank(local_rank, device_type)
    if backend is None:
        backend = backend_for_device(device)
    if dist.is_initialized():
        return DistributedContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            device=device,
            backend=str(dist.get_backend()),
            owns_group=False,
        )
    if device.type == "cuda":
        # NCCL binds a communicator to the current device; without this every rank of
        # a node would use GPU 0.
        torch.cuda.set_device(device)

    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if len(present) == len(_TORCHRUN_VARS):
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return DistributedContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            device=device,
            backend=backend,
            owns_group=True,
        )
    if present:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise ValueError(
            f"incomplete launch environment: {present} set but {missing} missing; "
            "launch with torchrun, or unset all of them for a one-process run"
        )
    store_dir = tempfile.mkdtemp(prefix="tp_fuse_store_")
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    return DistributedContext(
        rank=0,
        world_size=1,
        local_rank=local_rank,
        device=device,
        backend=backend,
        owns_group=True,
        store_dir=store_dir,
    )
