"""GEMM + ReduceScatter, pipelined over row chunks (row-parallel / sequence-parallel forward).

Each rank holds ``x [tp * m, *in_tail]`` (full rows, its shard of the contraction dim); the
result ``reduce_scatter_dim0(gemm(x))`` is ``[m, *out_tail]``. The rows of every rank's
output block are split into ``num_splits`` sub-ranges; chunk i gathers sub-range i of all
``tp`` blocks (``[tp * m_i, *in_tail]``), so its GEMM output reduce-scatters straight into
rows ``[lo_i, hi_i)`` of the local output. The reduce-scatter of chunk i is in flight while
the GEMM of chunk i + 1 runs; only the last chunk's communication is exposed.

Shapes::

    x        [tp * m, *in_tail]       block r (rows r*m .. r*m+m) is summed onto rank r
    chunk i  [tp * m_i, *in_tail]     rows {r*m + lo_i .. r*m + hi_i} for r in 0..tp-1
    partial  [tp * m_i, *out_tail]    gemm(chunk i) (pool buffer, double-buffered)
    out      [m, *out_tail]           out[lo_i:hi_i] = sum over ranks of partial block

Uneven splits: ``m`` need not be divisible by ``num_splits``; chunks follow
``torch.tensor_split`` sizes (largest first). ``num_splits > m`` is a ValueError.

Communication (``impl``): "collective" = ``reduce_scatter_single`` (``reduce_scatter_tensor``
before torch 2.13); "all_to_all" = ``all_to_all_single`` + local sum after the wait;
"auto" = collective on NCCL, all_to_all on gloo (gloo's reduce-scatter measured ~4x slower).

Overlap: GEMM(chunk i+1) || reduce-scatter(chunk i); then chunk i+1's reduce-scatter is
started before chunk i's is waited on (and, for all_to_all, summed), so at most two chunks
are in flight and the local sum of chunk i overlaps chunk i+1's communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..nccl_rules import check_collective
from ...strict import strict_cuda_enabled
from ..userbuffers import UserBufferPool
from ._common import (
    GemmFn,
    InFlight,
    check_rows_divisible,
    check_wire_tensor,
    group_size,
    resolve_out,
    run_gemm,
    split_sizes,
)
from .collectives import (
    PendingCollective,
    RsImpl,
    _reduce_scatter_single,
    check_same_shape,
    resolve_impl,
)

__all__ = ["gemm_reduce_scatter_pipelined"]


def gemm_reduce_scatter_pipelined(
    x: torch.Tensor,
    gemm: GemmFn,
    group: ProcessGroup | None,
    pool: UserBufferPool,
    *,
    num_splits: int = 2,
    out: torch.Tensor | None = None,
    out_features: int | None = None,
    out_dtype: torch.dtype | None = None,
    impl: RsImpl = "auto",
    name: str = "gemm_rs",
    check_shapes: bool = False,
) -> torch.Tensor:
    """``reduce_scatter_dim0(gemm(x))`` with chunk i's reduce-scatter hidden behind chunk i+1's GEMM.

    Args:
        x: ``[tp * m, *in_tail]``; dim 0 divisible by the TP size (checked locally).
        gemm: ``gemm(chunk [rows, *in_tail], out [rows, *out_tail]) -> out``.
        group: TP group.
        pool: workspace pool (buffers ``f"{name}.in"``, ``.partial{0,1}``, ``.recv{0,1}``).
        num_splits: number of chunks, 1 <= num_splits <= m (uneven allowed, see module doc).
        out / out_features / out_dtype: the ``[m, *out_tail]`` output (see
            :func:`tp_fuse.comm.overlap.ring_exchange_ag_gemm`).
        impl: "auto" | "collective" | "all_to_all".
        name: pool-buffer prefix.
        check_shapes: collective shape-agreement check before starting.

    Returns:
        ``[m, *out_tail]``: this rank's block of the summed product. TP size 1: ``gemm(x)``.
    """
    what = "gemm_reduce_scatter_pipelined"
    check_wire_tensor(x, what)
    tp = group_size(group)
    m = check_rows_divisible(x.shape[0], tp, what)
    sizes = split_sizes(m, num_splits, what)
    impl = resolve_impl(impl, group, "collective", "all_to_all", ("auto", "collective", "all_to_all"))
    out = resolve_out(x, m, out, out_features, out_dtype, what)
    x = x.contiguous()
    if tp == 1:
        run_gemm(gemm, x, out)
        return out
    if check_shapes or strict_cuda_enabled():  # strict: ranks must agree, as NCCL needs
        check_same_shape(x, group, what)

    in_tail, out_tail = tuple(x.shape[1:]), tuple(out.shape[1:])
    xb = x.view(tp, m, *in_tail)
    pending: PendingCollective | None = None
    lo = 0
    with InFlight() as inflight:
        for i, mi in enumerate(sizes):
            hi = lo + mi
            if num_splits == 1:
                chunk = x
            else:
                # Strided rows -> contiguous workspace. Single-buffered: the GEMM that read the
                # previous chunk has returned (CPU) or is stream-ordered before this copy (CUDA).
                chunk = pool.get(group, f"{name}.in", (tp * mi, *in_tail), x.dtype, x.device)
                chunk.view(tp, mi, *in_tail).copy_(xb[:, lo:hi])
            # Double-buffered: partial/recv[i % 2] were last used by chunk i-2's communication,
            # which was waited on (and summed) in iteration i-1, below.
            slot = i % 2
            partial = pool.get(group, f"{name}.partial{slot}", (tp * mi, *out_tail), out.dtype, out.device)
            run_gemm(gemm, chunk, partial)  # overlaps chunk i-1's reduce-scatter
            nxt = _start_reduce_scatter(partial, out[lo:hi], group, pool, impl, f"{name}.recv{slot}", tp)
            inflight.add(nxt.works)
            if pending is not None:
                # Finish chunk i-1 only now, so that its wait and local sum overlap chunk i's
                # communication instead of delaying its start.
                pending.wait()
            pending = nxt
            lo = hi
        assert pending is not None and lo == m
        pending.wait()
    return out


def _start_reduce_scatter(
    partial: torch.Tensor,
    dst: torch.Tensor,
    group: ProcessGroup | None,
    pool: UserBufferPool,
    impl: str,
    recv_name: str,
    tp: int,
) -> PendingCollective:
    """Async reduce-scatter of ``partial [tp * r, ...]`` into ``dst [r, ...]`` (a view of out)."""
    if impl == "collective":
        check_collective("reduce_scatter_flat", [partial], [dst], world_size=tp, op=dist.ReduceOp.SUM)
        return PendingCollective([_reduce_scatter_single(dst, partial, group=group, async_op=True)], dst)
    recv = pool.get(group, recv_name, tuple(partial.shape), partial.dtype, partial.device)
    check_collective("all_to_all_single", [partial], [recv], world_size=tp)
    work = dist.all_to_all_single(recv, partial, group=group, async_op=True)
    assert work is not None

    def finish() -> None:
        # recv block r = rank r's partial of my rows; the sum happens after the wait.
        torch.sum(recv.view(tp, *dst.shape), dim=0, out=dst)

    return PendingCollective([work], dst, finish)
