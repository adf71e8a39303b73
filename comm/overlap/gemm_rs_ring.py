"""GEMM + ReduceScatter by ring exchange of partial sums.

Each rank holds ``x [tp * m, *in_tail]`` and must end with the sum over ranks of
``gemm(block rank)``. Partial sums travel the ring: at step ``s`` every rank computes the
partial product of block ``b = (rank - s - 1) mod tp``, adds the partial sum for ``b`` that
arrived from ``rank - 1`` (which computed block b one step earlier), and sends the running
sum on to ``rank + 1``. At the last step ``b = rank``: the sum, now over all ranks, stays
home. Each step's GEMM runs while the previous step's partial sum travels.

Shapes::

    x        [tp * m, *in_tail]     block b = rows [b*m, (b+1)*m)
    acc0/1   [m, *out_tail]         running sums being sent (pool, double-buffered)
    recv     [m, *out_tail]         running sum from rank - 1 (pool)
    out      [m, *out_tail]         sum_r gemm_r(x_r[rank block])

Overlap: GEMM(step s) || send/recv(step s - 1); then wait, add, send.
Summation order differs from a reduce-scatter's (it follows the ring), so results match
the unfused path to fp rounding, not bit-for-bit.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ...strict import strict_cuda_enabled
from ..userbuffers import UserBufferPool
from ._common import (
    GemmFn,
    InFlight,
    check_rows_divisible,
    check_wire_tensor,
    exchange,
    resolve_out,
    ring_peers,
    run_gemm,
    wait_all,
)
from .collectives import check_same_shape

__all__ = ["gemm_reduce_scatter_ring"]


def gemm_reduce_scatter_ring(
    x: torch.Tensor,
    gemm: GemmFn,
    group: ProcessGroup | None,
    pool: UserBufferPool,
    *,
    out: torch.Tensor | None = None,
    out_features: int | None = None,
    out_dtype: torch.dtype | None = None,
    name: str = "gemm_rs_ring",
    check_shapes: bool = False,
) -> torch.Tensor:
    """``reduce_scatter_dim0(gemm(x))`` with partial sums passed around the ring.

    Args:
        x: ``[tp * m, *in_tail]``; dim 0 divisible by the TP size (checked locally).
        gemm: ``gemm(block [m, *in_tail], out [m, *out_tail]) -> out``; called once per block.
        group: TP group.
        pool: workspace pool (buffers ``f"{name}.acc{0,1}"``, ``f"{name}.recv"``).
        out / out_features / out_dtype: the ``[m, *out_tail]`` output (see
            :func:`tp_fuse.comm.overlap.ring_exchange_ag_gemm`); must be a floating dtype in
            practice (partial sums are added).
        name: pool-buffer prefix.
        check_shapes: collective shape-agreement check before starting.

    Returns:
        ``[m, *out_tail]``. TP size 1: ``gemm(x)``.
    """
    what = "gemm_reduce_scatter_ring"
    check_wire_tensor(x, what)
    tp, rank, nxt, prv = ring_peers(group)
    m = check_rows_divisible(x.shape[0], tp, what)
    out = resolve_out(x, m, out, out_features, out_dtype, what)
    x = x.contiguous()
    if tp == 1:
        run_gemm(gemm, x, out)
        return out
    if check_shapes or strict_cuda_enabled():  # strict: ranks must agree, as NCCL needs
        check_same_shape(x, group, what)

    xb = x.view(tp, m, *x.shape[1:])
    oshape = tuple(out.shape)
    acc = [pool.get(group, f"{name}.acc{j}", oshape, out.dtype, out.device) for j in (0, 1)]
    recv = pool.get(group, f"{name}.recv", oshape, out.dtype, out.device)
    works: list = []
    with InFlight() as inflight:
        for s in range(tp):
            b = (rank - s - 1) % tp
            last = s == tp - 1
            dst = out if last else acc[s % 2]
            # acc[s % 2]'s previous send (step s - 2) completed in the wait of step s - 1, and
            # the in-flight ops of step s - 1 touch acc[(s - 1) % 2] and recv only.
            run_gemm(gemm, xb[b], dst)  # overlaps step s - 1's send/recv
            wait_all(works)
            if s > 0:
                dst.add_(recv)
            works = [] if last else inflight.add(exchange(dst, nxt, recv, prv, group))
    return out
