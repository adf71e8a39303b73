"""Fused memory-bound kernels around FP8 GEMMs, plus the FP8 GEMM itself.

Every function has a torch reference and a Triton implementation with identical
semantics; ``backend=None`` picks Triton for CUDA inputs when triton is importable and
torch otherwise (see ``dispatch``), except the FP8 GEMM, which takes
``torch._scaled_mm`` on CUDA unless the Triton GEMM is chosen. Importing this package
does not import triton.

Block-scaled quantization (kernel name ``block_quantize``) has its Triton kernels in
``block_cast_triton``; its torch reference is the block quantizers' own math, so its entry
point -- same dispatch rules -- is ``tp_fuse.quantization.block.cast.quantize_layouts``.
NVFP4 quantization (``nvfp4_quantize``) likewise: Triton kernel in ``nvfp4_cast_triton``,
entry point ``tp_fuse.quantization.nvfp4.cast.quantize_nvfp4_layout``.
"""

from .activations import dgelu_dbias, dswiglu, gelu_fwd, swiglu_fwd
from .cast import amax_of, quantize, quantize_current_scaling
from .dispatch import (
    BackendChoice,
    KernelCall,
    KernelPathLog,
    planned_backend,
    record_kernel_paths,
    select_backend,
    triton_interpreted,
    triton_status,
)
from .gemm import fp8_gemm, fp8_gemm_reads_views
from .norms import layernorm_fwd, rmsnorm_fwd
from .scale_update import delayed_scale_update

__all__ = [
    "BackendChoice",
    "KernelCall",
    "KernelPathLog",
    "amax_of",
    "delayed_scale_update",
    "dgelu_dbias",
    "dswiglu",
    "fp8_gemm",
    "fp8_gemm_reads_views",
    "gelu_fwd",
    "layernorm_fwd",
    "planned_backend",
    "quantize",
    "quantize_current_scaling",
    "rmsnorm_fwd",
    "record_kernel_paths",
    "select_backend",
    "swiglu_fwd",
    "triton_interpreted",
    "triton_status",
]
