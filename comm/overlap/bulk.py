"""Bulk overlap: an independent collective runs while an unrelated computation proceeds.

Typical use (backward of a column-parallel linear): re-gather the input for the weight
gradient while the data-gradient GEMM runs::

    gathered, dgrad = bulk_overlap(
        lambda: all_gather_dim0_async(x_local, tp_group),
        lambda: grad_out @ weight,
    )

The collective is started first (async: NCCL stream or gloo worker threads), then
``compute_fn`` runs on the calling thread, then the collective is waited on.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from ._common import InFlight
from .collectives import PendingCollective

__all__ = ["bulk_overlap"]

T = TypeVar("T")


def bulk_overlap(
    collective_fn: Callable[[], PendingCollective],
    compute_fn: Callable[[], T],
) -> tuple[torch.Tensor, T]:
    """Run ``collective_fn``'s communication concurrently with ``compute_fn``.

    Args:
        collective_fn: starts a collective and returns its :class:`PendingCollective`
            (e.g. ``lambda: all_gather_dim0_async(x, group)``). It must only *start* the
            communication; ``compute_fn`` must not touch the collective's buffers.
        compute_fn: the independent computation (e.g. a GEMM); runs on this thread.

    Returns:
        ``(collective result, compute_fn result)``.

    If ``compute_fn`` raises, the collective is waited on before the exception propagates
    (see :class:`tp_fuse.comm.overlap._common.InFlight` for why unwaited work is not dropped).
    """
    pending = collective_fn()
    if not isinstance(pending, PendingCollective):
        raise ValueError(
            "bulk_overlap: collective_fn must return a PendingCollective "
            f"(e.g. from all_gather_dim0_async), got {type(pending).__name__}"
        )
    with InFlight() as inflight:
        inflight.add(pending.works)
        result = compute_fn()
    return pending.wait(), result
