"""Communication/GEMM overlap algorithms (device-agnostic, on torch.distributed).

One algorithm per module. All take the GEMM as a callable ``gemm(chunk, out) -> out`` and
split along dim 0 (the sequence/row dimension); comm knows nothing of FP8 (bytes travel as
uint8). TP size 1 is the identity (no communication) everywhere.
"""

from ._common import GemmFn
from .ag_gemm import ring_exchange_ag_gemm
from .bulk import bulk_overlap
from .collectives import (
    PendingCollective,
    all_gather_dim0,
    all_gather_dim0_async,
    all_reduce,
    all_reduce_async,
    ShapeAgreement,
    check_same_shape,
    check_same_signature,
    reduce_scatter_dim0,
    reduce_scatter_dim0_async,
)
from .gemm_ar_chunked import gemm_all_reduce_chunked
from .gemm_rs_pipelined import gemm_reduce_scatter_pipelined
from .gemm_rs_ring import gemm_reduce_scatter_ring

__all__ = [
    "GemmFn",
    "PendingCollective",
    "all_gather_dim0",
    "all_gather_dim0_async",
    "all_reduce",
    "all_reduce_async",
    "bulk_overlap",
    "ShapeAgreement",
    "check_same_shape",
    "check_same_signature",
    "gemm_all_reduce_chunked",
    "gemm_reduce_scatter_pipelined",
    "gemm_reduce_scatter_ring",
    "reduce_scatter_dim0",
    "reduce_scatter_dim0_async",
    "ring_exchange_ag_gemm",
]
