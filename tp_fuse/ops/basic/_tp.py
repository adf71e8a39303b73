"""Shared helpers of the tensor-parallel communication ops."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..op import require


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialized)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 1
    return dist.get_world_size(group)


def check_first_dim_divisible(op_name: str, x: torch.Tensor, size: int) -> None:
    """Local shape check done before any communication (so every rank raises)."""
    require(x.dim() >= 1, f"{op_name}: expected a tensor with a sequence dimension, got a scalar")
    require(
        x.shape[0] % size == 0,
        f"{op_name}: first (sequence) dimension {x.shape[0]} is not divisible by the "
        f"tensor-parallel size {size}",
    )
