"""Plain (non-overlapped) dim-0 collectives: the reference path used by unfused ops, and
the building blocks handed to :func:`tp_fuse.comm.overlap.bulk_overlap`.

Each collective has an ``*_async`` launcher returning a :class:`PendingCollective` and a
blocking form (``launcher(...).wait()``). TP size 1 is the identity (no communication; the
input itself is returned, or copied into ``out`` if one is given).

Error checks happen before any communication, so a user mistake raises on every rank
instead of leaving peers waiting:

* local (free): tensor type, float8 dtype (pass uint8 views), first dimension divisible by
  the TP size (reduce-scatter), ``out`` shape/dtype/device.
* needs other ranks (``check_shapes=True`` here, every call): equal shapes and dtypes on
  all ranks. It costs one tiny all-gather; without it a mismatch surfaces as a backend
  error, SIGABRT in gloo, or a hang. The tp_fuse comm ops check by default, once per
  shape signature (:class:`ShapeAgreement`).

Implementation choice (``impl="auto"``): NCCL uses its native collectives. On gloo in
torch 2.13, measured on loopback with 2 and 4 ranks, ``reduce_scatter_tensor`` is ~2-4x
slower than ``all_to_all_single`` + a local sum, and ``all_gather_into_tensor`` ~1.5-3x
slower than posting all sends/receives at once, so "auto" picks those on gloo. Every
implementation is selectable explicitly and tested against the others.
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

from ..nccl_rules import check_collective
from ...strict import strict_cuda_enabled
from ..userbuffers import UserBufferPool
from ._common import (
    backend_name,
    check_rows_divisible,
    check_wire_tensor,
    global_rank,
    group_rank,
    group_size,
)

__all__ = [
    "PendingCollective",
    "all_gather_dim0",
    "all_gather_dim0_async",
    "reduce_scatter_dim0",
    "reduce_scatter_dim0_async",
    "all_reduce",
    "all_reduce_async",
    "check_same_shape",
    "resolve_impl",
]

# torch 2.13 renamed the "_tensor" collectives to "_single" and deprecates the old names;
# torch 2.6 (our minimum) only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

AgImpl = Literal["auto", "collective", "p2p"]
RsImpl = Literal["auto", "collective", "all_to_all"]


class PendingCollective:
    """An in-flight collective.

    ``wait()`` blocks until the communication is done, runs the local finishing step (e.g.
    the sum after an all-to-all) once, and returns the result tensor. Idempotent.
    """

    def __init__(
        self,
        works: Sequence[Work],
        result: torch.Tensor,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._works = list(works)
        self._result = result
        self._finish = finish
        self._done = False

    @property
    def works(self) -> tuple[Work, ...]:
        """The backend handles (for draining after an error)."""
        return tuple(self._works)

    def wait(self) -> torch.Tensor:
        if not self._done:
            for w in self._works:
                w.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
        return self._result


def resolve_impl(
    impl: str, group: ProcessGroup | None, native: str, gloo_choice: str, allowed: Sequence[str]
) -> str:
    """Map ``"auto"`` to the native collective on NCCL and to ``gloo_choice`` elsewhere."""
    if impl not in allowed:
        raise ValueError(f"impl must be one of {tuple(allowed)}, got {impl!r}")
    if impl != "auto":
        return impl
    return native if backend_name(group) == "nccl" else gloo_choice


_DTYPE_CODES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 8


def _signature(tensors: Sequence[torch.Tensor], what: str) -> list[int]:
    """Flat int description of (dtype, ndim, shape) per tensor, padded to _MAX_DIMS each."""
    out: list[int] = []
    for x in tensors:
        if x.dim() > _MAX_DIMS:
            raise ValueError(f"{what}: the shape check supports up to {_MAX_DIMS} dims, got {x.dim()}")
        code = _DTYPE_CODES.index(x.dtype) if x.dtype in _DTYPE_CODES else len(_DTYPE_CODES)
        out += [code, x.dim(), *x.shape, *([-1] * (_MAX_DIMS - x.dim()))]
    return out


def _format_signature(row: list[int], names: Sequence[str]) -> str:
    parts, width = [], _MAX_DIMS + 2
    for i, name in enumerate(names):
        r = row[i * width : (i + 1) * width]
        dt = _DTYPE_CODES[r[0]] if 0 <= r[0] < len(_DTYPE_CODES) else "other dtype"
        parts.append(f"{name + ' ' if name else ''}{tuple(r[2 : 2 + r[1]])} {dt}")
    return ", ".join(parts)


def check_same_signature(
    tensors: Sequence[torch.Tensor], group: ProcessGroup | None, what: str, names: Sequence[str] = ("input",)
) -> None:
    """Collective check that every rank of ``group`` passes tensors of the same shapes and dtypes.

    All-gathers a small int64 description; on a mismatch every rank raises the same
    ValueError listing each rank's shapes (so no rank is left waiting in a collective
    whose sizes do not match, which gloo answers with SIGABRT).
    """
    tp = group_size(group)
    if tp == 1:
        return
    assert len(names) == len(tensors)
    desc = torch.tensor(_signature(tensors, what), dtype=torch.int64, device=tensors[0].device)
    # Flat output: gloo accepts only the concatenated form, not [tp, len].
    gathered = torch.empty(tp * desc.numel(), dtype=torch.int64, device=desc.device)
    check_collective("all_gather_flat", [desc], [gathered], world_size=tp)
    _all_gather_single(gathered, desc, group=group)
    rows = gathered.view(tp, -1).cpu().tolist()
    if any(r != rows[0] for r in rows):
        listing = "; ".join(f"rank {i}: {_format_signature(r, names)}" for i, r in enumerate(rows))
        raise ValueError(f"{what}: ranks disagree on the input shape/dtype ({listing})")


def check_same_shape(x: torch.Tensor, group: ProcessGroup | None, what: str = "collective") -> None:
    """:func:`check_same_signature` of one tensor (listed without a name)."""
    check_same_signature([x], group, what, ("",))


class ShapeAgreement:
    """Checks, once per shape signature, that all ranks of a group pass the same shapes.

    Each TP communication op owns one. The first call with a new (group, shapes,
    dtypes) signature runs :func:`check_same_signature` (one all-gather of a few
    int64s); later calls with a signature every rank agreed on cost a set lookup.
    Limitation: ranks that agreed on a signature and later diverge, with one rank
    repeating the agreed one, are not caught (its peer checks, it does not); every
    first disagreement is.
    """

    def __init__(self) -> None:
        self._agreed: set[tuple] = set()
        self.checks = 0  # collective checks run (for tests and cost reports)

    def check(self, group: ProcessGroup | None, what: str, tensors: Sequence[torch.Tensor],
              names: Sequence[str] = ("input",)) -> None:
        if group_size(group) == 1:
            return
        key = (getattr(group, "group_name", id(group)), *((tuple(t.shape), t.dtype) for t in tensors))
        if key in self._agreed:
            return
        self.checks += 1
        check_same_signature(tensors, group, what, names)
        self._agreed.add(key)


def _check_before_communicating(
    x: torch.Tensor, group: ProcessGroup | None, out: torch.Tensor | None, shape: tuple[int, ...],
    what: str, check_shapes: bool,
) -> PendingCollective | None:
    """The checks of a dim-0 collective with result ``shape``; for TP size 1 the finished
    result instead (``x`` itself, or ``x`` copied into ``out``): nothing to communicate."""
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(
                f"{what}: out must be {shape} {x.dtype} on {x.device}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{what}: out must be contiguous")
    if group_size(group) == 1:
        if out is None:
            return PendingCollective([], x)
        out.copy_(x)
        return PendingCollective([], out)
    if check_shapes or strict_cuda_enabled():  # strict: ranks must agree, as NCCL needs
        check_same_shape(x, group, what)
    return None


def all_gather_dim0_async(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    out: torch.Tensor | None = None,
    impl: AgImpl = "auto",
    check_shapes: bool = False,
) -> PendingCollective:
    """Start gathering ``x [m, *rest]`` from every rank into ``[tp * m, *rest]`` (rank order)."""
    what = "all_gather_dim0"
    check_wire_tensor(x, what)
    tp = group_size(group)
    impl = resolve_impl(impl, group, "collective", "p2p", ("auto", "collective", "p2p"))
    shape = (tp * x.shape[0], *x.shape[1:])
    single_rank = _check_before_communicating(x, group, out, shape, what, check_shapes)
    if single_rank is not None:
        return single_rank
    x = x.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if impl == "collective":
        check_collective("all_gather_flat", [x], [out], world_size=tp)
        return PendingCollective([_all_gather_single(out, x, group=group, async_op=True)], out)
    rank = group_rank(group)
    blocks = out.view(tp, *x.shape)
    check_collective("p2p", [x], [blocks[r] for r in range(tp) if r != rank], rank=global_rank(group, rank),
                     peers=[global_rank(group, r) for r in range(tp) if r != rank])
    ops = []
    for r in range(tp):
        if r != rank:
            peer = global_rank(group, r)
            ops.append(dist.P2POp(dist.isend, x, peer, group))
            ops.append(dist.P2POp(dist.irecv, blocks[r], peer, group))
    works = dist.batch_isend_irecv(ops)
    blocks[rank].copy_(x)  # runs while the peers' blocks arrive
    return PendingCollective(works, out)


def all_gather_dim0(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    out: torch.Tensor | None = None,
    impl: AgImpl = "auto",
    check_shapes: bool = False,
) -> torch.Tensor:
    """All-gather along dim 0: ``[m, *rest]`` on each rank -> ``[tp * m, *rest]``.

    Blocks of the output are in group-rank order. Identity for TP size 1.
    """
    return all_gather_dim0_async(x, group, out=out, impl=impl, check_shapes=check_shapes).wait()


def reduce_scatter_dim0_async(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    out: torch.Tensor | None = None,
    impl: RsImpl = "auto",
    check_shapes: bool = False,
    pool: UserBufferPool | None = None,
) -> PendingCollective:
    """Start summing ``x [tp * m, *rest]`` over ranks; rank r keeps rows ``[r*m, (r+1)*m)``.

    ``pool``: where the all_to_all implementation keeps its receive buffer (buffer
    ``"reduce_scatter_dim0.recv"``); without one it allocates a fresh buffer per call,
    which on CPU costs page faults on every call for large tensors.
    """
    what = "reduce_scatter_dim0"
    check_wire_tensor(x, what)
    tp = group_size(group)
    impl = resolve_impl(impl, group, "collective", "all_to_all", ("auto", "collective", "all_to_all"))
    m = check_rows_divisible(x.shape[0], tp, what)
    shape = (m, *x.shape[1:])
    single_rank = _check_before_communicating(x, group, out, shape, what, check_shapes)
    if single_rank is not None:
        return single_rank
    x = x.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if impl == "collective":
        check_collective("reduce_scatter_flat", [x], [out], world_size=tp, op=dist.ReduceOp.SUM)
        return PendingCollective([_reduce_scatter_single(out, x, group=group, async_op=True)], out)
    if pool is None:
        recv = torch.empty_like(x)
    else:
        recv = pool.get(group, "reduce_scatter_dim0.recv", tuple(x.shape), x.dtype, x.device)
    check_collective("all_to_all_single", [x], [recv], world_size=tp)
    work = dist.all_to_all_single(recv, x, group=group, async_op=True)
    assert work is not None
    result = out

    def finish() -> None:
        # recv[r] is rank r's partial for my block; sum them in rank order.
        torch.sum(recv.view(tp, *shape), dim=0, out=result)

    return PendingCollective([work], out, finish)


def reduce_scatter_dim0(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    out: torch.Tensor | None = None,
    impl: RsImpl = "auto",
    check_shapes: bool = False,
    pool: UserBufferPool | None = None,
) -> torch.Tensor:
    """Reduce-scatter (sum) along dim 0: ``[tp * m, *rest]`` -> ``[m, *rest]``.

    ValueError (before any communication) if dim 0 is not divisible by the TP size.
    Identity for TP size 1. ``pool``: see :func:`reduce_scatter_dim0_async`.
    """
    return reduce_scatter_dim0_async(
        x, group, out=out, impl=impl, check_shapes=check_shapes, pool=pool
    ).wait()


def all_reduce_async(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    inplace: bool = False,
    check_shapes: bool = False,
) -> PendingCollective:
    """Start an all-reduce of ``x`` (on a copy unless ``inplace``)."""
    what = "all_reduce"
    check_wire_tensor(x, what, min_dim=0)
    if group_size(group) == 1:
        return PendingCollective([], x)
    if check_shapes or strict_cuda_enabled():  # strict: ranks must agree, as NCCL needs
        check_same_shape(x, group, what)
    if inplace and not x.is_contiguous():
        raise ValueError(f"{what}: inplace=True needs a contiguous tensor")
    buf = x if inplace else x.contiguous().clone()
    check_collective("all_reduce", [buf], world_size=group_size(group), op=op)
    work = dist.all_reduce(buf, op=op, group=group, async_op=True)
    assert work is not None
    return PendingCollective([work], buf)


def all_reduce(
    x: torch.Tensor,
    group: ProcessGroup | None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    inplace: bool = False,
    check_shapes: bool = False,
) -> torch.Tensor:
    """All-reduce ``x`` over ``group`` (default SUM). Identity for TP size 1."""
    return all_reduce_async(x, group, op=op, inplace=inplace, check_shapes=check_shapes).wait()

