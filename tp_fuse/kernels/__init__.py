"""Fused memory-bound kernels around FP8 GEMMs, plus the FP8 GEMM itself.

Every function has a torch reference and a Triton implementation with identical
semantics; ``backend=None`` picks Triton for CUDA inputs when triton is importable and
torch otherwise (see ``dispatch``). Importing this package does not import triton.
"""

from .cast import quantize
from .dispatch import (
    BackendChoice,
    KernelCall,
    KernelPathLog,
    record_kernel_paths,
    select_backend,
    triton_interpreted,
    triton_status,
)

__all__ = [
    "BackendChoice",
    "KernelCall",
    "KernelPathLog",
    "quantize",
    "record_kernel_paths",
    "select_backend",
    "triton_interpreted",
    "triton_status",
]
