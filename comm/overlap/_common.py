"""Shared plumbing of the overlap algorithms: group arithmetic, point-to-point exchange,
chunk sizes, output allocation and the GEMM-callable contract.

The GEMM contract used throughout :mod:`tp_fuse.comm.overlap`::

    gemm(chunk: Tensor, out: Tensor) -> Tensor

``chunk`` is a contiguous slice of the input along dim 0 (``[rows, *in_tail]``), ``out`` a
contiguous preallocated slice of the output (``[rows, *out_tail]``). The callable should
write into ``out`` and return it; if it returns another tensor of ``out``'s shape, that is
copied into ``out`` (one extra copy, still correct). comm never looks inside: for FP8 the
caller passes uint8 views and a GEMM that knows the scales.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from ..nccl_rules import check_collective, describe_shape, shape_descriptor
from ...strict import CudaConformanceError, strict_cuda_enabled

GemmFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_FLOAT8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def global_rank(group: ProcessGroup | None, rank_in_group: int) -> int:
    """Global rank of ``rank_in_group`` (P2POp takes global ranks in every torch >= 2.6)."""
    if group is None or group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def backend_name(group: ProcessGroup | None) -> str:
    return str(dist.get_backend(group)).lower()


def check_wire_tensor(x: torch.Tensor, what: str, min_dim: int = 1) -> None:
    """Local checks on a tensor about to travel: a real tensor, ``min_dim``-D or more, no float8.

    float8 tensors are rejected rather than reinterpreted: comm carries FP8 as raw bytes
    and gloo has no float8 support, so the caller passes ``data.view(torch.uint8)``.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{what}: expected at least {min_dim} dimension (dim 0 is split), got a 0-d tensor")
    if x.dtype in _FLOAT8_DTYPES:
        raise ValueError(
            f"{what}: got dtype {x.dtype}; comm moves FP8 data as raw bytes, "
            "pass tensor.view(torch.uint8) and keep the scale on the caller's side"
        )


def check_rows_divisible(rows: int, tp: int, what: str) -> int:
    """``rows // tp``, or ValueError naming both numbers (a local check, before any comm)."""
    if rows % tp:
        raise ValueError(f"{what}: first dimension {rows} is not divisible by the TP size {tp}")
    return rows // tp


def split_sizes(rows: int, num_splits: int, what: str) -> list[int]:
    """Row counts of ``num_splits`` chunks of ``rows`` rows, largest first.

    Uneven splits are allowed and follow :func:`torch.tensor_split`: the first
    ``rows % num_splits`` chunks get one extra row. ``num_splits`` must be in [1, rows]
    (an empty chunk would be a wasted collective).
    """
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"{what}: num_splits must be a positive int, got {num_splits!r}")
    if num_splits > rows:
        raise ValueError(f"{what}: num_splits={num_splits} exceeds the {rows} rows to split")
    base, extra = divmod(rows, num_splits)
    return [base + (1 if i < extra else 0) for i in range(num_splits)]


def resolve_out(
    x: torch.Tensor,
    rows: int,
    out: torch.Tensor | None,
    out_features: int | None,
    out_dtype: torch.dtype | None,
    what: str,
) -> torch.Tensor:
    """The output tensor ``[rows, *x.shape[1:-1], out_features]``: ``out`` after checks, or new.

    Exactly one of ``out`` / ``out_features`` must be given. ``out_dtype`` defaults to
    ``x.dtype`` except for uint8 input (FP8 bytes), where it must be given.
    """
    if out is not None:
        if out_features is not None and out.shape[-1] != out_features:
            raise ValueError(f"{what}: out has {out.shape[-1]} features but out_features={out_features}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"{what}: out has dtype {out.dtype} but out_dtype={out_dtype}")
        if out.dim() < 1 or out.shape[0] != rows:
            raise ValueError(f"{what}: out must have {rows} rows, got shape {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"{what}: out must be contiguous (its row blocks are written in place)")
        if out.device != x.device:
            raise ValueError(f"{what}: out is on {out.device} but the input is on {x.device}")
        return out
    if out_features is None:
        raise ValueError(f"{what}: pass either out= (preallocated) or out_features=")
    if out_features < 1:
        raise ValueError(f"{what}: out_features must be >= 1, got {out_features}")
    if out_dtype is None:
        if x.dtype == torch.uint8:
            raise ValueError(f"{what}: input is uint8 (FP8 bytes); pass out_dtype= for the GEMM output")
        out_dtype = x.dtype
    return torch.empty((rows, *x.shape[1:-1], out_features), dtype=out_dtype, device=x.device)


def run_gemm(gemm: GemmFn, chunk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Call the GEMM callable on one chunk; make sure the result sits in ``out``."""
    res = gemm(chunk, out)
    if res is out or (
        isinstance(res, torch.Tensor) and res.data_ptr() == out.data_ptr() and res.shape == out.shape
    ):
        return out
    if not isinstance(res, torch.Tensor) or res.shape != out.shape:
        got = tuple(res.shape) if isinstance(res, torch.Tensor) else type(res).__name__
        raise ValueError(
            f"gemm returned {got} for a chunk of shape {tuple(chunk.shape)}; expected {tuple(out.shape)}"
        )
    out.copy_(res)
    return out


def exchange(
    send: torch.Tensor | None,
    send_to: int | None,
    recv: torch.Tensor | None,
    recv_from: int | None,
    group: ProcessGroup | None,
) -> list[Work]:
    """Post one send and/or one receive (global peer ranks) as a single batch; returns handles.

    A batch (``batch_isend_irecv``) because on NCCL the ring's send and receive must be in
    one group call or ranks can deadlock; on gloo it posts each op asynchronously.
    """
    check_collective("p2p", [send] if send is not None else [], [recv] if recv is not None else [],
                     rank=dist.get_rank(), peers=[p for p in (send_to, recv_from) if p is not None])
    _check_p2p_backend(send if send is not None else recv, group)
    if strict_cuda_enabled():
        _check_peer_sizes(send, send_to, recv, recv_from, group)
    ops = []
    if send is not None:
        assert send_to is not None
        ops.append(dist.P2POp(dist.isend, send, send_to, group))
    if recv is not None:
        assert recv_from is not None
        ops.append(dist.P2POp(dist.irecv, recv, recv_from, group))
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def _check_p2p_backend(tensor: torch.Tensor | None, group: ProcessGroup | None) -> None:
    """gloo's send/recv hand the tensor's pointer to the socket: a CUDA tensor fails
    deep in gloo ("writev ...: Bad address", seen on an H200) after the peer has posted
    its half. Refuse it here, on every rank, before anything is posted."""
    if tensor is None or not tensor.is_cuda:
        return
    backend = str(dist.get_backend(group if group is not None else dist.group.WORLD))
    if "nccl" not in backend:
        raise ValueError(
            f"the TP overlap's point-to-point exchange got CUDA tensors over a {backend!r} process group: "
            "gloo cannot send or receive CUDA tensors point-to-point. Use an NCCL group for CUDA tensors "
            "(one GPU per rank), or turn the overlap off for this group."
        )


def _check_peer_sizes(
    send: torch.Tensor | None,
    send_to: int | None,
    recv: torch.Tensor | None,
    recv_from: int | None,
    group: ProcessGroup | None,
) -> None:
    """Strict mode: the tensor ``recv_from`` sends must have ``recv``'s shape and dtype.

    NCCL matches a send and a receive by byte count only (a mismatch hangs or corrupts);
    here each side first sends a small shape descriptor along the same edge.
    """
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, shape_descriptor(send), send_to, group))
    theirs = None
    if recv is not None:
        theirs = torch.empty_like(shape_descriptor(recv))
        ops.append(dist.P2POp(dist.irecv, theirs, recv_from, group))
    if ops:
        wait_all(dist.batch_isend_irecv(ops))
    if recv is not None and not torch.equal(theirs, shape_descriptor(recv)):
        raise CudaConformanceError(
            f"TP_FUSE_STRICT_CUDA=1: rank {recv_from} sends {describe_shape(theirs)} but rank "
            f"{dist.get_rank()} receives into {describe_shape(shape_descriptor(recv))}"
        )


def wait_all(works: Sequence[Work]) -> None:
    for w in works:
        w.wait()


class InFlight:
    """Posted async work of one algorithm call, drained if the call fails midway.

    Used as ``with InFlight() as inflight: inflight.add(exchange(...)) ...``. On an
    exception inside the block it waits for every added handle (ignoring secondary errors)
    before the exception propagates. Why: on gloo (torch 2.13, checked) a point-to-point
    Work that is dropped unwaited leaves the connection blocked and the group's *next*
    collective hangs. When the failure is symmetric (e.g. the GEMM callable raises on
    every rank at the same step), all peers posted their matching operations, so the drain
    completes; an asymmetric failure hangs until the group's timeout either way.
    Waiting again on already-completed handles is harmless.
    """

    def __init__(self) -> None:
        self._works: list[Work] = []

    def add(self, works: Sequence[Work]) -> list[Work]:
        self._works.extend(works)
        return list(works)

    def __enter__(self) -> "InFlight":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        if exc_type is not None:
            for w in self._works:
                try:
                    w.wait()
                except Exception:  # noqa: BLE001 - the original exception matters more
                    pass
        self._works.clear()
        return False


def ring_peers(group: ProcessGroup | None) -> tuple[int, int, int, int]:
    """``(tp_size, tp_rank, next_global, prev_global)`` for a ring over ``group``."""
    tp = group_size(group)
    rank = group_rank(group)
    return tp, rank, global_rank(group, (rank + 1) % tp), global_rank(group, (rank - 1) % tp)
