"""AllGather + GEMM by ring exchange (column-parallel / sequence-parallel forward).

Each rank holds ``x_local [m, *in_tail]``, one block of rows of the sequence-parallel input.
The full product ``all_gather(x) @ W_shard^T`` is computed in ``tp`` steps. At step ``s`` a
rank holds block ``(rank - s) mod tp``: it forwards that block to ``rank + 1`` and receives
block ``(rank - s - 1) mod tp`` from ``rank - 1`` (async), and *while the block travels* runs
the GEMM on the block it holds, writing the rows in place into the preallocated output.
Only the last step's GEMM has no communication to hide behind; a transfer is exposed only
when it takes longer than one chunk's GEMM.

Shapes (tp = group size, m = local rows)::

    x_local   [m, *in_tail]          this rank's block (uint8 for FP8 bytes)
    gathered  [tp * m, *in_tail]     block r = rank r's x_local (pool buffer, or returned;
                                     in the pool buffer, this rank's own block is not filled)
    out       [tp * m, *out_tail]    out[r*m:(r+1)*m] = gemm(block r)

Overlap: GEMM(step s) || send/recv(step s); wait(step s) before step s+1.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ...strict import strict_cuda_enabled
from ..userbuffers import UserBufferPool
from ._common import (
    GemmFn,
    InFlight,
    check_wire_tensor,
    exchange,
    resolve_out,
    ring_peers,
    run_gemm,
    wait_all,
)
from .collectives import check_same_shape

__all__ = ["ring_exchange_ag_gemm"]


def ring_exchange_ag_gemm(
    x_local: torch.Tensor,
    gemm: GemmFn,
    group: ProcessGroup | None,
    pool: UserBufferPool,
    *,
    out: torch.Tensor | None = None,
    out_features: int | None = None,
    out_dtype: torch.dtype | None = None,
    return_gathered: bool = False,
    name: str = "ag_gemm",
    check_shapes: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``gemm(all_gather_dim0(x_local))`` with the all-gather hidden behind the GEMM.

    Args:
        x_local: ``[m, *in_tail]`` local rows; same shape on every rank (float8: pass a
            uint8 view).
        gemm: ``gemm(chunk [m, *in_tail], out [m, *out_tail]) -> out`` (see
            :mod:`tp_fuse.comm.overlap._common` for the contract).
        group: TP group.
        pool: workspace pool; the gathered input lives in buffer ``f"{name}.gathered"``
            unless ``return_gathered``.
        out: preallocated ``[tp * m, *out_tail]`` output (contiguous), or None to allocate
            ``[tp * m, *in_tail[:-1], out_features]`` of ``out_dtype`` (default: x's dtype;
            required for uint8 input).
        return_gathered: also return the gathered input ``[tp * m, *in_tail]`` (e.g. for
            the weight gradient). It is then a fresh tensor owned by the caller, not a pool
            buffer, since pool buffers are overwritten by the next call.
        name: pool-buffer prefix.
        check_shapes: collective check that all ranks pass the same shape (one small
            all-gather); the local checks always run first.

    Returns:
        ``out`` or ``(out, gathered)``. TP size 1: ``gemm(x_local)``, gathered = ``x_local``.
    """
    what = "ring_exchange_ag_gemm"
    check_wire_tensor(x_local, what)
    tp, rank, nxt, prv = ring_peers(group)
    m = x_local.shape[0]
    if m < 1:
        raise ValueError(f"{what}: x_local has no rows")
    out = resolve_out(x_local, tp * m, out, out_features, out_dtype, what)
    x_local = x_local.contiguous()
    if tp == 1:
        run_gemm(gemm, x_local, out)
        return (out, x_local) if return_gathered else out
    if check_shapes or strict_cuda_enabled():  # strict: ranks must agree, as NCCL needs
        check_same_shape(x_local, group, what)

    gshape = (tp * m, *x_local.shape[1:])
    if return_gathered:
        gathered = torch.empty(gshape, dtype=x_local.dtype, device=x_local.device)
    else:
        gathered = pool.get(group, f"{name}.gathered", gshape, x_local.dtype, x_local.device)
    blocks = gathered.view(tp, *x_local.shape)  # blocks[r]: rank r's rows
    out_blocks = out.view(tp, m, *out.shape[1:])

    with InFlight() as inflight:
        for s in range(tp):
            cur = (rank - s) % tp
            # Step 0 works on x_local itself: no copy stands between the call and the first
            # transfer, and our own block is only copied into `gathered` if it is returned.
            held = x_local if s == 0 else blocks[cur]
            works = []
            if s < tp - 1:
                # Forward the block we hold and receive our predecessor's. The send and the
                # GEMM below only read `held`; the receive writes blocks[cur - 1], which
                # nothing reads until the next step (after the wait).
                works = inflight.add(exchange(held, nxt, blocks[(cur - 1) % tp], prv, group))
            run_gemm(gemm, held, out_blocks[cur])  # overlaps the exchange just posted
            if s == 0 and return_gathered:
                blocks[rank].copy_(x_local)  # also overlaps the exchange
            wait_all(works)
    return (out, gathered) if return_gathered else out
