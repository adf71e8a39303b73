"""The one table from an overlap method to its algorithm, per kind of window.

A *window* is a collective next to a GEMM. Its fused op (``tp_fuse.ops.fused.userbuffers_*``)
prepares the operands once -- the ``[rows, K]`` tensor the collective moves (FP8 bytes as
uint8), the GEMM callable ``gemm(chunk, out) -> out`` and, on CUDA, PyTorch's fused-op call
-- as :class:`WindowOperands`, and :func:`run_algorithm` runs the
:class:`~tp_fuse.overlap.method.OverlapMethod` the plan fixed or the auto-tuner chose:

=========================  =================  ====================================================
window                     method             algorithm
=========================  =================  ====================================================
``ALL_GATHER_GEMM``        ``ring_exchange``  ``tp_fuse.comm.ring_exchange_ag_gemm``
(AG(x) W^T; AG(dy) W)      ``symm_mem``       ``torch.ops.symm_mem.fused_all_gather_(scaled_)matmul``
                           ``unfused``        ``all_gather_dim0``, then one GEMM
``GEMM_REDUCE_SCATTER``    ``pipeline``       ``tp_fuse.comm.gemm_reduce_scatter_pipelined``
(RS(x W^T); RS(dy W))      ``ring_exchange``  ``tp_fuse.comm.gemm_reduce_scatter_ring``
                           ``symm_mem``       ``torch.ops.symm_mem.fused_(scaled_)matmul_reduce_scatter``
                           ``unfused``        one GEMM, then ``reduce_scatter_dim0``
``GEMM_ALL_REDUCE``        ``pipeline``       ``tp_fuse.comm.gemm_all_reduce_chunked``
(AR(x W^T))                ``unfused``        one GEMM, then ``all_reduce``
``DGRAD_REDUCE_SCATTER``   ``pipeline``       as ``GEMM_REDUCE_SCATTER``
(column-parallel           ``ring_exchange``  as ``GEMM_REDUCE_SCATTER``
backward, dx = RS(dy W))   ``bulk``           the whole dgrad GEMM; the fused op reduce-scatters dx
                                              behind the wgrad GEMM (``tp_fuse.comm.bulk_overlap``)
                           ``unfused``        the whole dgrad GEMM; the fused op reduce-scatters dx
=========================  =================  ====================================================

A :class:`Window` is the data flow of one direction, not the basic ops of the window (the
fused ops' ``mode``, ``"all_gather"`` / ``"reduce_scatter"`` / ``"all_reduce"``): the
backward of ``[BasicLinear, ReduceScatter]`` all-gathers dy (``ALL_GATHER_GEMM``), the
backward of ``[AllGather, BasicLinear]`` reduce-scatters dx (``DGRAD_REDUCE_SCATTER``).

A method missing from a window's row cannot apply to it: the fusion matcher rejects such
a config entry with the reason (``tp_fuse/ops/fused/userbuffers_matcher.py``), so the
lookup here never misses. ``symm_mem`` runs only where the fused op built a call
(``WindowOperands.symm``): ``method: auto`` offers it as a candidate nowhere else.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse import comm
from tp_fuse.comm import GemmFn

from .method import Method, OverlapMethod
from .symm_mem import WindowCall

__all__ = ["ALGORITHMS", "Window", "WindowOperands", "run_algorithm"]

class Window(enum.StrEnum):
    """The kinds of collective-next-to-GEMM windows (rows of :data:`ALGORITHMS`)."""

    ALL_GATHER_GEMM = "all_gather_gemm"
    GEMM_REDUCE_SCATTER = "gemm_reduce_scatter"
    GEMM_ALL_REDUCE = "gemm_all_reduce"
    DGRAD_REDUCE_SCATTER = "dgrad_reduce_scatter"


@dataclasses.dataclass
class WindowOperands:
    """What every algorithm of a window reads, prepared once by the fused op.

    ``wire [rows, K]``: this rank's rows as the collective moves them (uint8 for FP8
    bytes); ``gemm(chunk [r, K], out [r, N]) -> out``; ``out_features`` N; ``name``: the
    workspace name in ``pool`` (the GEMM stage key, ``"fc1_fprop"``); ``return_gathered``
    (all-gather windows): also return the gathered wire; ``symm``: PyTorch's fused-op
    call on the same operands, where the window can run it.
    """

    wire: torch.Tensor
    gemm: GemmFn
    group: Optional[dist.ProcessGroup]
    pool: Any
    out_features: int
    out_dtype: torch.dtype
    name: str
    check_shapes: bool = False
    return_gathered: bool = False
    symm: Optional[WindowCall] = None

    def empty_out(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.out_features, dtype=self.out_dtype, device=self.wire.device)


Algorithm = Callable[[WindowOperands, OverlapMethod], Any]


# ---- all-gather, then GEMM -----------------------------------------------------------


def _ag_ring(o: WindowOperands, m: OverlapMethod) -> Any:
    return comm.ring_exchange_ag_gemm(
        o.wire, o.gemm, o.group, o.pool, out_features=o.out_features, out_dtype=o.out_dtype,
        return_gathered=o.return_gathered, name=o.name, check_shapes=o.check_shapes,
    )


def _ag_unfused(o: WindowOperands, m: OverlapMethod) -> Any:
    gathered = comm.all_gather_dim0(o.wire, o.group)
    out = o.gemm(gathered, o.empty_out(gathered.shape[0]))
    return (out, gathered) if o.return_gathered else out


def _ag_symm(o: WindowOperands, m: OverlapMethod) -> Any:
    assert o.symm is not None, "symm_mem is a candidate only where the window built its call"
    gathered, out = o.symm.run()  # FP8: gathered float8 data, re-wrapped by the fused op
    return (out, gathered) if o.return_gathered else out


# ---- GEMM, then reduce-scatter / all-reduce --------------------------------------------


def _rs_pipelined(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    return comm.gemm_reduce_scatter_pipelined(
        o.wire, o.gemm, o.group, o.pool, num_splits=m.splits, out_features=o.out_features,
        out_dtype=o.out_dtype, name=o.name, check_shapes=o.check_shapes,
    )


def _rs_ring(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    return comm.gemm_reduce_scatter_ring(
        o.wire, o.gemm, o.group, o.pool, out_features=o.out_features, out_dtype=o.out_dtype,
        name=o.name, check_shapes=o.check_shapes,
    )


def _rs_unfused(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    return comm.reduce_scatter_dim0(o.gemm(o.wire, o.empty_out(o.wire.shape[0])), o.group, pool=o.pool)


def _rs_symm(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    assert o.symm is not None, "symm_mem is a candidate only where the window built its call"
    return o.symm.run()[1]


def _ar_chunked(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    return comm.gemm_all_reduce_chunked(
        o.wire, o.gemm, o.group, num_splits=m.splits, out_features=o.out_features, out_dtype=o.out_dtype,
        check_shapes=o.check_shapes,
    )


def _ar_unfused(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    return comm.all_reduce(o.gemm(o.wire, o.empty_out(o.wire.shape[0])), o.group, inplace=True)


def _whole_gemm(o: WindowOperands, m: OverlapMethod) -> torch.Tensor:
    """The GEMM alone: the caller reduce-scatters its output (bulk: behind the wgrad GEMM)."""
    return o.gemm(o.wire, o.empty_out(o.wire.shape[0]))


#: Method -> algorithm, per window: the one place a method meets its implementation.
ALGORITHMS: Mapping[Window, Mapping[Method, Algorithm]] = {
    Window.ALL_GATHER_GEMM: {
        Method.RING_EXCHANGE: _ag_ring, Method.SYMM_MEM: _ag_symm, Method.UNFUSED: _ag_unfused,
    },
    Window.GEMM_REDUCE_SCATTER: {
        Method.PIPELINE: _rs_pipelined, Method.RING_EXCHANGE: _rs_ring, Method.SYMM_MEM: _rs_symm,
        Method.UNFUSED: _rs_unfused,
    },
    Window.GEMM_ALL_REDUCE: {Method.PIPELINE: _ar_chunked, Method.UNFUSED: _ar_unfused},
    Window.DGRAD_REDUCE_SCATTER: {
        Method.PIPELINE: _rs_pipelined, Method.RING_EXCHANGE: _rs_ring, Method.BULK: _whole_gemm,
        Method.UNFUSED: _whole_gemm,
    },
}


def run_algorithm(window: Window, method: OverlapMethod, operands: WindowOperands) -> Any:
    """Run ``method``'s algorithm for ``window`` on ``operands`` (see the table above)."""
    algorithm = ALGORITHMS[window].get(method.method)
    assert algorithm is not None, f"{method.label} has no algorithm for {window} (the matcher rejects it)"
    return algorithm(operands, method)
