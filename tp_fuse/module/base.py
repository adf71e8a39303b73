"""``transformer_engine.pytorch.module.base``'s userbuffers setup under TE's module path.

``import tp_fuse as te; te.module.base.initialize_ub(...)`` runs TE users' calls as written;
see :mod:`tp_fuse.overlap.userbuffers_setup` for what each argument does here and for the
explicit ``TPOverlap`` objects that remain the primary API.
"""

from ..overlap.userbuffers_setup import (
    UserBufferQuantizationMode,
    destroy_ub,
    get_ub,
    initialize_ub,
    is_ub_initialized,
    using_cublasmp_backend,
)

__all__ = [
    "UserBufferQuantizationMode",
    "destroy_ub",
    "get_ub",
    "initialize_ub",
    "is_ub_initialized",
    "using_cublasmp_backend",
]
