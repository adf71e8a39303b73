"""comm: communication for tp-fuse (topology, backend start-up, userbuffers, overlap).

Depends only on torch. FP8 data travels as raw bytes (uint8 views); scales are the
caller's business. Process groups and buffer pools are passed explicitly; nothing here
keeps them in module globals.
"""

from tp_fuse._floors import floor_path

# This package's modules are in the folder comm/ (a checkout's top level, or beside this file
# installed); the folder has no __init__.py so that it never shadows an installed `comm`.
__path__ = floor_path(__file__, "comm")

from tp_fuse.comm.backend import (
    DistributedContext,
    backend_for_device,
    device_for_local_rank,
    device_type_for_backend,
    init_distributed,
)
from tp_fuse.comm.nccl_rules import check_collective, collective_violations
from tp_fuse.strict import CudaConformanceError, strict_cuda_enabled
from tp_fuse.comm.overlap import (
    GemmFn,
    PendingCollective,
    all_gather_dim0,
    all_gather_dim0_async,
    all_reduce,
    all_reduce_async,
    bulk_overlap,
    ShapeAgreement,
    check_same_shape,
    check_same_signature,
    gemm_all_reduce_chunked,
    gemm_reduce_scatter_pipelined,
    gemm_reduce_scatter_ring,
    reduce_scatter_dim0,
    reduce_scatter_dim0_async,
    ring_exchange_ag_gemm,
)
from tp_fuse.comm.topology import FP8_GROUP_KINDS, ParallelTopology, resolve_parallel_sizes
from tp_fuse.comm.userbuffers import UserBufferPool, symmetric_memory_available

__all__ = [
    "CudaConformanceError",
    "GemmFn",
    "DistributedContext",
    "FP8_GROUP_KINDS",
    "ParallelTopology",
    "PendingCollective",
    "UserBufferPool",
    "all_gather_dim0",
    "all_gather_dim0_async",
    "all_reduce",
    "all_reduce_async",
    "backend_for_device",
    "bulk_overlap",
    "ShapeAgreement",
    "check_collective",
    "check_same_shape",
    "check_same_signature",
    "collective_violations",
    "device_for_local_rank",
    "device_type_for_backend",
    "gemm_all_reduce_chunked",
    "gemm_reduce_scatter_pipelined",
    "gemm_reduce_scatter_ring",
    "init_distributed",
    "reduce_scatter_dim0",
    "reduce_scatter_dim0_async",
    "resolve_parallel_sizes",
    "strict_cuda_enabled",
    "ring_exchange_ag_gemm",
    "symmetric_memory_available",
]
