"""Data-parallel layout for FSDP2 runs: the ``(dp_replicate, dp_shard, tp)`` device mesh.

``parallel.dp_shard > 1`` shards the model over ``dp_shard`` ranks with FSDP2
(``tp_fuse.layers.fsdp.fully_shard_gpt``); ``parallel.dp_replicate > 1`` as well gives HSDP
(replicas of sharded groups). The mesh is row-major like ``tp_fuse.comm.ParallelTopology``'s
``(dp, tp)`` mesh, so data-parallel rank ``dp = replicate_index * dp_shard +
shard_index`` and the TP groups are the same ranks in both.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ParallelLayout

__all__ = ["ShardedDataParallel", "make_sharded_dp"]


@dataclasses.dataclass(frozen=True)
class ShardedDataParallel:
    """The FSDP2 mesh (1-D ``dp_shard`` or 2-D ``(dp_replicate, dp_shard)``) and the
    group over which every rank holds a different slice of each parameter (the gradient
    norm sums over it)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup


def make_sharded_dp(layout: ParallelLayout, device_type: str) -> ShardedDataParallel:
    """Collective over the world: every rank must call it (new process groups)."""
    assert layout.fsdp and layout.dp_replicate * layout.dp_shard == layout.dp, layout
    full = init_device_mesh(device_type, (layout.dp_replicate, layout.dp_shard, layout.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    mesh = full["dp_shard"] if layout.dp_replicate == 1 else full["dp_replicate", "dp_shard"]
    return ShardedDataParallel(mesh=mesh, shard_group=full.get_group("dp_shard"))
