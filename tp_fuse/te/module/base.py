"""``transformer_engine.pytorch.module.base``'s userbuffers setup under TE's module path.

``import tp_fuse as te; te.module.base.initialize_ub(...)`` runs TE users' calls as written;
see :mod:`tp_fuse.overlap.userbuffers_setup` for what each argument does here and for the
explicit ``TPOverlap`` objects that remain the primary API.
"""

from tp_fuse.overlap.userbuffers_setup import (
    UserBufferQuantizationMode,
    destroy_ub,
    get_ub,
    initialize_ub,
    is_ub_initialized,
    using_cublasmp_backend,
)

#: TE's FP8 GEMM accumulation choices per GEMM (``use_split_accumulator`` of
#: ``cpp_extensions.general_gemm``): TE's values. tp_fuse's FP8 GEMMs accumulate in FP32
#: either way (see ``tp_fuse.cpp_extensions.general_gemm``).
_2X_ACC_FPROP = False
_2X_ACC_DGRAD = True
_2X_ACC_WGRAD = True

__all__ = [
    "UserBufferQuantizationMode",
    "destroy_ub",
    "get_ub",
    "initialize_ub",
    "is_ub_initialized",
    "using_cublasmp_backend",
]
