"""The strict-CUDA switch, ``TP_FUSE_STRICT_CUDA=1``: on CPU, fail where CUDA or NCCL would.

Read by both sides: ``tp_fuse.kernels.cuda_rules`` (what CUDA's ``torch._scaled_mm``
accepts) and ``tp_fuse.comm.nccl_rules`` (what NCCL accepts); neither depends on the other.
The flag is read from the environment at each check (no module state), so a test can
turn it on with ``monkeypatch.setenv``; spawned ranks inherit it.
"""

from __future__ import annotations

import os

__all__ = ["CudaConformanceError", "STRICT_ENV", "strict_cuda_enabled"]

STRICT_ENV = "TP_FUSE_STRICT_CUDA"


class CudaConformanceError(ValueError):
    """A call that works on CPU would be rejected on CUDA (cuBLASLt ``_scaled_mm`` or NCCL)."""


def strict_cuda_enabled() -> bool:
    """Whether ``TP_FUSE_STRICT_CUDA=1`` is set (read on every call: no cached state)."""
    value = os.environ.get(STRICT_ENV, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{STRICT_ENV}: expected 0 or 1, got {value!r}")
    return value == "1"
