"""GEMM + AllReduce in row chunks (row-parallel linear without sequence parallelism).

Each rank holds ``x [rows, *in_tail]`` (its shard of the contraction dim); the result is
``all_reduce(gemm(x))``. Rows are split into ``num_splits`` contiguous chunks; chunk i's
GEMM writes rows ``[lo_i, hi_i)`` of the output in place and its all-reduce is started
(async, in place on those rows) before chunk i + 1's GEMM runs. Only the last chunk's
all-reduce is exposed.

Shapes::

    x      [rows, *in_tail]
    out    [rows, *out_tail]     out[lo_i:hi_i] = all_reduce(gemm(x[lo_i:hi_i]))

Uneven splits follow ``torch.tensor_split`` sizes; ``num_splits > rows`` is a ValueError.
No workspace is needed: the all-reduce runs in place on the output.

Overlap: GEMM(chunk i+1) || all-reduce(chunk <= i); all chunks may be in flight at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from ..nccl_rules import check_collective
from ...strict import strict_cuda_enabled
from ._common import (
    GemmFn,
    InFlight,
    check_wire_tensor,
    group_size,
    resolve_out,
    run_gemm,
    split_sizes,
    wait_all,
)
from .collectives import check_same_shape

__all__ = ["gemm_all_reduce_chunked"]


def gemm_all_reduce_chunked(
    x: torch.Tensor,
    gemm: GemmFn,
    group: ProcessGroup | None,
    *,
    num_splits: int = 2,
    out: torch.Tensor | None = None,
    out_features: int | None = None,
    out_dtype: torch.dtype | None = None,
    check_shapes: bool = False,
) -> torch.Tensor:
    """``all_reduce(gemm(x))`` with chunk i's all-reduce hidden behind chunk i+1's GEMM.

    Args:
        x: ``[rows, *in_tail]``, same shape on every rank.
        gemm: ``gemm(chunk [r, *in_tail], out [r, *out_tail]) -> out``.
        group: TP group.
        num_splits: number of row chunks, 1 <= num_splits <= rows (uneven allowed).
        out / out_features / out_dtype: the ``[rows, *out_tail]`` output (see
            :func:`tp_fuse.comm.overlap.ring_exchange_ag_gemm`).
        check_shapes: collective shape-agreement check before starting.

    Returns:
        ``[rows, *out_tail]``, summed over the group. TP size 1: ``gemm(x)``.
    """
    what = "gemm_all_reduce_chunked"
    check_wire_tensor(x, what)
    tp = group_size(group)
    sizes = split_sizes(x.shape[0], num_splits, what)
    out = resolve_out(x, x.shape[0], out, out_features, out_dtype, what)
    x = x.contiguous()
    if tp == 1:
        run_gemm(gemm, x, out)
        return out
    if check_shapes or strict_cuda_enabled():  # strict: ranks must agree, as NCCL needs
        check_same_shape(x, group, what)
    works: list[Work] = []
    lo = 0
    with InFlight() as inflight:
        for mi in sizes:
            hi = lo + mi
            dst = out[lo:hi]
            run_gemm(gemm, x[lo:hi], dst)  # overlaps the all-reduces already in flight
            check_collective("all_reduce", [dst], world_size=tp, op=dist.ReduceOp.SUM)
            work = dist.all_reduce(dst, group=group, async_op=True)
            assert work is not None
            works.extend(inflight.add([work]))
            lo = hi
        wait_all(works)
    return out
