"""Block-interleaved GLU layout (Transformer Engine's ``glu_interleave_size``).

With interleave size k the last dimension ``2n`` holds ``n / k`` pairs of blocks
``[gate block (k), value block (k)]`` instead of ``[all gates (n) | all values (n)]``.
``deinterleave`` turns the first layout into the second (the one the GLU math reads);
``interleave`` is its inverse (applied to the input gradient).
"""

from __future__ import annotations

from typing import Optional

import torch


def check_interleave(op_name: str, size: Optional[int]) -> Optional[int]:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{op_name}: glu_interleave_size must be a positive int or None, got {size!r}")
    return size


def deinterleave(x: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """``[..., (n/k, 2, k)] -> [..., (2, n/k, k)]``: gates first, then values."""
    if size is None:
        return x
    shape = x.shape
    blocks = x.reshape(*shape[:-1], shape[-1] // (2 * size), 2, size)
    return blocks.transpose(-3, -2).reshape(shape)


def interleave(x: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """Inverse of :func:`deinterleave`."""
    if size is None:
        return x
    shape = x.shape
    halves = x.reshape(*shape[:-1], 2, shape[-1] // (2 * size), size)
    return halves.transpose(-3, -2).reshape(shape)
