"""The strict-CUDA switch, ``TP_FUSE_STRICT_CUDA=1``: on CPU, fail where CUDA or NCCL would.

Read by both sides: ``tp_fuse.kernels.cuda_rules`` (what CUDA's ``torch._scaled_mm``
accepts) and ``tp_fuse.comm.nccl_rules`` (what NCCL accepts); neither depends on the other.
The flag is read from the environment at each check (no module state), so a test can
turn it on with ``monkeypatch.setenv``; spawned ranks inherit it.

``TP_FUSE_SIMULATE_CUDA=1`` goes further: CPU tensors take the CUDA branches (Triton
kernels in Triton's interpreter, CUDA's ``torch._scaled_mm``), so that a CPU process
counts the kernels a GPU step launches (``tp_fuse.kernels.launch_count``). It is read
once, when this module is imported (it decides which code paths exist in the process),
needs ``TRITON_INTERPRET=1`` and implies strict mode.
"""

from __future__ import annotations

import os

__all__ = ["CudaConformanceError", "SIMULATE_CUDA_ENV", "STRICT_ENV", "simulating_cuda", "strict_cuda_enabled"]

STRICT_ENV = "TP_FUSE_STRICT_CUDA"
SIMULATE_CUDA_ENV = "TP_FUSE_SIMULATE_CUDA"


class CudaConformanceError(ValueError):
    """A call that works on CPU would be rejected on CUDA (cuBLASLt ``_scaled_mm`` or NCCL)."""


def _read_flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return value == "1"


def _read_simulate() -> bool:
    if not _read_flag(SIMULATE_CUDA_ENV):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{SIMULATE_CUDA_ENV}=1 runs the Triton kernels on CPU: it needs TRITON_INTERPRET=1 set too "
            "(tp_fuse.kernels.launch_count.simulated_cuda_env() lists the environment)"
        )
    return True


_SIMULATED = _read_simulate()


def simulating_cuda() -> bool:
    """Whether this process runs CPU tensors down the CUDA path (``TP_FUSE_SIMULATE_CUDA=1``
    at import)."""
    return _SIMULATED


def strict_cuda_enabled() -> bool:
    """Whether ``TP_FUSE_STRICT_CUDA=1`` is set (read on every call: no cached state), or
    the process simulates CUDA."""
    return _SIMULATED or _read_flag(STRICT_ENV)
