"""Parallel topology: the world's ranks laid out on named axes ("dp", "tp").

Ranks are laid out row-major on a ``(dp, tp)`` mesh, so the ranks of one TP group are
consecutive (global rank = dp_rank * tp + tp_rank), matching Megatron-LM: TP traffic is the
heaviest and consecutive ranks share a node.

Groups come from :func:`torch.distributed.device_mesh.init_device_mesh`, which works on CPU
with gloo as well as on CUDA with NCCL in torch 2.13 (checked: ``init_device_mesh("cpu",
(2, 2), mesh_dim_names=("dp", "tp"))`` yields TP groups [0, 1], [2, 3] and DP groups
[0, 2], [1, 3]). A topology is an ordinary object: pass it (or its groups) to whatever
needs them; nothing here is stored in module globals.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .backend import device_type_for_backend

__all__ = ["ParallelTopology", "resolve_parallel_sizes", "FP8_GROUP_KINDS"]

FP8_GROUP_KINDS = ("tp", "dp", "world")
Size = int | Literal["auto"]


def _check_size(name: str, value: Size) -> None:
    if value == "auto":
        return
    # bool is an int subclass; tp=True is a mistake, not a size of 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int or 'auto', got {value!r}")


def resolve_parallel_sizes(tp: Size, dp: Size, world_size: int) -> tuple[int, int]:
    """Resolve ``"auto"`` sizes and validate ``tp * dp == world_size``.

    ``tp="auto"`` takes every rank not used by ``dp`` (all ranks when ``dp`` is also
    ``"auto"``); ``dp="auto"`` takes ``world_size // tp``. Returns ``(tp, dp)``.
    Raises ValueError, with the numbers, when the sizes do not tile the world.
    """
    _check_size("tp", tp)
    _check_size("dp", dp)
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if tp == "auto" and dp == "auto":
        return world_size, 1
    if tp == "auto":
        assert isinstance(dp, int)
        if world_size % dp:
            raise ValueError(f"dp={dp} does not divide the world size {world_size}; cannot infer tp")
        return world_size // dp, dp
    if dp == "auto":
        assert isinstance(tp, int)
        if world_size % tp:
            raise ValueError(f"tp={tp} does not divide the world size {world_size}; cannot infer dp")
        return tp, world_size // tp
    assert isinstance(tp, int) and isinstance(dp, int)
    if tp * dp != world_size:
        raise ValueError(f"tp ({tp}) * dp ({dp}) = {tp * dp} does not equal the world size ({world_size})")
    return tp, dp


class ParallelTopology:
    """Validated (dp, tp) layout of all ranks of the default process group.

    Collective: every rank must construct it with the same arguments (group creation is
    collective).

    Args:
        tp: tensor-parallel size, or ``"auto"`` (all ranks not used by ``dp``).
        dp: data-parallel size, or ``"auto"`` (``world_size // tp``).
        device_type: mesh device type; defaults to the default group's backend
            (``"cuda"`` for NCCL, ``"cpu"`` for gloo).

    Attributes:
        mesh: the :class:`DeviceMesh` with dims ``("dp", "tp")``.
        tp_group, dp_group: this rank's groups; ``tp_rank``/``tp_size``, ``dp_rank``/``dp_size``.
        world_group: the default group (all ranks).
    """

    def __init__(self, tp: Size = "auto", dp: Size = "auto", *, device_type: str | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "ParallelTopology needs an initialized default process group "
                "(call tp_fuse.comm.init_distributed() or torch.distributed.init_process_group first)"
            )
        world_size = dist.get_world_size()
        self.tp_size, self.dp_size = resolve_parallel_sizes(tp, dp, world_size)
        self.world_size = world_size
        self.rank = dist.get_rank()
        self.device_type = device_type or device_type_for_backend(str(dist.get_backend()))
        self.mesh: DeviceMesh = init_device_mesh(
            self.device_type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp")
        )
        self.tp_group: ProcessGroup = self.mesh.get_group("tp")
        self.dp_group: ProcessGroup = self.mesh.get_group("dp")
        world = dist.group.WORLD
        assert world is not None
        self.world_group: ProcessGroup = world
        self.tp_rank = dist.get_rank(self.tp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        # Internal invariant: the mesh is row-major (dp, tp), so TP groups are consecutive.
        assert self.rank == self.dp_rank * self.tp_size + self.tp_rank, (
            self.rank,
            self.dp_rank,
            self.tp_rank,
        )

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this rank's TP group, in TP-rank order."""
        return dist.get_process_group_ranks(self.tp_group)

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group, in DP-rank order."""
        return dist.get_process_group_ranks(self.dp_group)

    def fp8_group(self, kind: str) -> ProcessGroup:
        """Amax-reduction group for FP8 scaling.

        ``"tp"``: ranks that share activations (enough for all-gathering FP8 bytes);
        ``"dp"``: replicas of the same shard; ``"world"``: every rank (what delayed scaling
        with ``reduce_amax=True`` usually wants, so all ranks keep identical scales).
        """
        if kind == "tp":
            return self.tp_group
        if kind == "dp":
            return self.dp_group
        if kind == "world":
            return self.world_group
        raise ValueError(f"unknown FP8 group kind {kind!r}; expected one of {FP8_GROUP_KINDS}")

    def __repr__(self) -> str:
        return (
            f"ParallelTopology(world={self.world_size}, dp={self.dp_size}, tp={self.tp_size}, "
            f"rank={self.rank}, dp_rank={self.dp_rank}, tp_rank={self.tp_rank}, "
            f"device_type={self.device_type!r})"
        )
