"""The strict-CUDA switch, ``TP_FUSE_STRICT_CUDA=1``: on CPU, fail where CUDA or NCCL would.

Read by both sides: ``tp_fuse.kernels.cuda_rules`` (what CUDA's ``torch._scaled_mm``
accepts) and ``tp_fuse.comm.nccl_rules`` (what NCCL accepts); neither depends on the other.
The flag is part of :mod:`tp_fuse.settings`' snapshot, read once at import (spawned ranks
inherit it through the environment); a test turns it on with
``tp_fuse.settings.override(TP_FUSE_STRICT_CUDA="1")``.

``TP_FUSE_SIMULATE_CUDA=1`` goes further: CPU tensors take the CUDA branches (Triton
kernels in Triton's interpreter, CUDA's ``torch._scaled_mm``), so that a CPU process
counts the kernels a GPU step launches (``tp_fuse.kernels.launch_count``). It decides
which code paths exist in the process, so it cannot be overridden after import; it needs
``TRITON_INTERPRET=1`` and implies strict mode.
"""

from __future__ import annotations

from . import settings
from .settings import SIMULATE_CUDA_ENV, STRICT_ENV

__all__ = ["CudaConformanceError", "SIMULATE_CUDA_ENV", "STRICT_ENV", "simulating_cuda", "strict_cuda_enabled"]


class CudaConformanceError(ValueError):
    """A call that works on CPU would be rejected on CUDA (cuBLASLt ``_scaled_mm`` or NCCL)."""


def simulating_cuda() -> bool:
    """Whether this process runs CPU tensors down the CUDA path (``TP_FUSE_SIMULATE_CUDA=1``
    at import)."""
    return settings.current().simulate_cuda


def strict_cuda_enabled() -> bool:
    """Whether strict-CUDA mode is on (``TP_FUSE_STRICT_CUDA=1``, or the process simulates
    CUDA): the settings snapshot's flag, no environment read."""
    return settings.current().strict_cuda
