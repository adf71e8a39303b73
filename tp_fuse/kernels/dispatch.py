"""Backend selection for tp_fuse kernels, and a record of which path ran.

Every public kernel (``quantize``, ``layernorm_fwd``, ``fp8_gemm`` ...) has two
implementations with identical semantics: a torch reference (any device) and a Triton
kernel (CUDA tensors, or any tensors when ``TRITON_INTERPRET=1`` was set before triton
was first imported). Each public function takes ``backend="torch" | "triton" | None``:

* ``None`` (auto): Triton for CUDA tensors when triton imports and the shape is
  supported by the Triton kernel, otherwise torch. The reason is recorded.
  Exception: the FP8 GEMM (``select_fp8_gemm_backend``). Its auto choice on CUDA is
  ``torch._scaled_mm`` (cuBLASLt); the Triton GEMM has not been benchmarked on a GPU
  yet and runs only when chosen: ``backend="triton"``, or ``TP_FUSE_FP8_GEMM=triton``
  in the environment (:mod:`tp_fuse.settings`) for every auto call on CUDA. On CPU it is the exact emulation of
  ``kernels.fp8_emulation`` (``TP_FUSE_CPU_FP8_GEMM``).
* ``"triton"``: Triton or an exception. Never a silent fallback.
* ``"torch"``: the reference implementation.

Which path ran is observable without global switches::

    with record_kernel_paths() as log:
        y, rstd, amax = rmsnorm_fwd(x, w, 1e-5)
    log.last("rmsnorm_fwd").backend   # "torch" on CPU

``select_backend`` answers the same question without running anything (used by the
fuser's ``explain``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from tp_fuse import settings
from tp_fuse.settings import CPU_FP8_GEMM_ENV, CPU_FP8_GEMM_UNITS_ENV, FP8_GEMM_ENV
from tp_fuse.strict import simulating_cuda

from .fp8_emulation import cpu_has_amx_bf16
from ._common import triton_dtype_issue

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "FP8_GEMM_ENV",
    "cuda_capability",
    "select_fp8_gemm_backend",
    "KernelCall",
    "KernelPathLog",
    "planned_backend",
    "record_kernel_paths",
    "select_backend",
    "triton_interpreted",
    "takes_cuda_path",
    "triton_status",
]

BACKENDS = ("torch", "triton")
#: Oldest compute capability with FP8 tensor cores, which ``torch._scaled_mm`` needs on CUDA.
SCALED_MM_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class BackendChoice:
    """Outcome of backend selection: ``backend`` in BACKENDS and a human-readable why.

    ``runnable`` is False when the chosen path cannot run on this device (the reason says
    what to do instead); a call raises with the reason, ``explain`` shows it.
    """

    backend: str
    reason: str
    runnable: bool = True


@dataclass(frozen=True)
class KernelCall:
    """One executed kernel call.

    ``variant`` names the implementation detail that ran, e.g. ``"reference"`` for torch,
    ``"pointer"``/``"tma"`` for the Triton GEMM, with ``"+emulated-casts"`` appended when
    the Triton kernel converted floats in integer arithmetic (see ``_triton_common``).
    """

    kernel: str
    backend: str
    variant: str
    device: str
    reason: str


class KernelPathLog:
    """Ordered list of ``KernelCall`` records captured by ``record_kernel_paths``."""

    def __init__(self) -> None:
        self.calls: list[KernelCall] = []

    def record(self, call: KernelCall) -> None:
        self.calls.append(call)

    def counts(self) -> Counter:
        """``Counter`` keyed by ``(kernel, backend)``."""
        return Counter((c.kernel, c.backend) for c in self.calls)

    def backends(self, kernel: Optional[str] = None) -> list[str]:
        return [c.backend for c in self.calls if kernel is None or c.kernel == kernel]

    def last(self, kernel: Optional[str] = None) -> KernelCall:
        for call in reversed(self.calls):
            if kernel is None or call.kernel == kernel:
                return call
        raise LookupError(f"no kernel call recorded for kernel={kernel!r}")

    def clear(self) -> None:
        self.calls.clear()

    def __len__(self) -> int:
        return len(self.calls)

    def __repr__(self) -> str:
        return f"KernelPathLog({dict(self.counts())})"


# Active logs are process-wide, not per thread: on CUDA, autograd runs the backward on
# its own device thread, so a per-thread log saw no backward kernel on a GPU (while on
# CPU, where the backward runs in the calling thread, it saw them all). Logs nest: an
# inner ``record_kernel_paths`` also feeds the outer ones.
_active_logs: list[KernelPathLog] = []
_active_lock = threading.Lock()


def _stack() -> list[KernelPathLog]:
    with _active_lock:
        return list(_active_logs)


@contextlib.contextmanager
def record_kernel_paths(log: Optional[KernelPathLog] = None) -> Iterator[KernelPathLog]:
    """Capture every kernel call made inside the ``with`` block, by any thread of the
    process (autograd's CUDA backward thread included)."""
    log = KernelPathLog() if log is None else log
    with _active_lock:
        _active_logs.append(log)
    try:
        yield log
    finally:
        with _active_lock:
            _active_logs.remove(log)


_SIMULATED_CUDA = simulating_cuda()


def takes_cuda_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take tp_fuse's CUDA branches: CUDA tensors, and CPU
    tensors in a process that simulates CUDA to count its launches
    (``TP_FUSE_SIMULATE_CUDA=1``, :mod:`tp_fuse.kernels.launch_count`)."""
    return device.type == "cuda" or (_SIMULATED_CUDA and device.type == "cpu")


def logging_active() -> bool:
    """Whether a ``record_kernel_paths`` block is open (callers skip building a log entry
    otherwise)."""
    return bool(_active_logs)


def log_call(kernel: str, choice: BackendChoice, variant: str, device: torch.device) -> None:
    """Record one executed call in every active log (no-op when none is active)."""
    if not _active_logs:  # the common case, without taking the lock
        return
    stack = _stack()
    call = KernelCall(kernel, choice.backend, variant, str(device), choice.reason)
    for log in stack:
        log.record(call)


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """``(importable, detail)``; cached because a failed import is slow to retry."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, f"triton {triton.__version__}"


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1).

    Triton decides this when a ``@triton.jit`` function is decorated, i.e. when
    ``tp_fuse.kernels._triton_common`` is first imported; we report that decision once
    it is made, and the environment variable before.
    """
    import sys

    mod = sys.modules.get("tp_fuse.kernels._triton_common")
    if mod is not None:
        return bool(mod.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(
    kernel: str,
    device: torch.device,
    backend: Optional[str] = None,
    *,
    triton_unsupported: Optional[str] = None,
) -> BackendChoice:
    """Choose the implementation for ``kernel`` on ``device``.

    Args:
        kernel: public kernel name (for messages).
        device: device of the kernel's inputs.
        backend: ``None`` (auto), ``"torch"`` or ``"triton"``.
        triton_unsupported: why the Triton kernel cannot handle these inputs (shape or
            dtype limits), or ``None`` when it can.

    Raises:
        ValueError: ``backend`` is not one of None/"torch"/"triton", or Triton was
            requested for inputs it does not support.
        RuntimeError: Triton was requested but cannot run here.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected None, 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return BackendChoice("torch", "torch requested")
    # Auto on CPU: the Triton kernels exist for GPUs; the torch reference is the fast CPU
    # path even with the interpreter on (a testing tool). Decided before triton_status()
    # so that CPU-only use never pays for importing triton.
    if backend is None:
        if not takes_cuda_path(device):
            return _non_cuda_choice(device.type)
        return _auto_cuda_choice(triton_status(), triton_unsupported)
    ok, detail = triton_status()
    runnable = device.type == "cuda" or triton_interpreted()
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"{kernel}: backend='triton' requested but {detail}")
        if not runnable:
            raise RuntimeError(
                f"{kernel}: backend='triton' requested for {device.type} tensors; Triton runs "
                "CUDA tensors, or any tensors with TRITON_INTERPRET=1 set before triton is imported"
            )
        if triton_unsupported is not None:
            raise ValueError(f"{kernel}: backend='triton' requested but {triton_unsupported}")
        return BackendChoice("triton", f"triton requested ({detail})")
    raise AssertionError(f"unreachable: backend {backend!r}")


@functools.lru_cache(maxsize=None)
def _auto_cuda_choice(status: tuple[bool, str], triton_unsupported: Optional[str]) -> BackendChoice:
    # Decided once per (triton status, reason): built per kernel call, the choice and its
    # f-string cost more Python than the launch's own bookkeeping.
    ok, detail = status
    if not ok:
        return BackendChoice("torch", detail)
    if triton_unsupported is not None:
        return BackendChoice("torch", triton_unsupported)
    return BackendChoice("triton", f"CUDA inputs and {detail}")


@functools.lru_cache(maxsize=None)
def _non_cuda_choice(device_type: str) -> BackendChoice:
    # One immutable choice per device type: made per kernel call, it cost ~2 us per call.
    return BackendChoice("torch", f"inputs on {device_type}; Triton kernels are for CUDA")


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device (tests replace this function
    to decide for a GPU they do not have; a simulated CUDA device is an H100/H200, sm_90)."""
    if device.type != "cuda":
        assert _SIMULATED_CUDA, f"cuda_capability of a {device.type} device"
        return (9, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    # A device's capability never changes: queried once per device, not per kernel call.
    return tuple(torch.cuda.get_device_capability(index))


def select_fp8_gemm_backend(
    device: torch.device,
    backend: Optional[str] = None,
    *,
    triton_unsupported: Optional[str] = None,
) -> BackendChoice:
    """Choose the FP8 GEMM implementation.

    Auto on CUDA: ``torch._scaled_mm`` (cuBLASLt, the fast and proven path) unless
    ``TP_FUSE_FP8_GEMM=triton`` asks for the Triton GEMM. On GPUs below compute
    capability 8.9 ``_scaled_mm`` has no FP8 kernel: the choice is marked not runnable and
    its reason names the way out (the Triton GEMM, which emulates FP8 there). Explicit
    ``backend`` and non-CUDA devices follow :func:`select_backend`.
    """
    if backend is not None or not takes_cuda_path(device):
        choice = select_backend("fp8_gemm", device, backend, triton_unsupported=triton_unsupported)
        if choice.backend == "torch" and backend is None:
            if device.type == "cpu":
                return BackendChoice("torch", _cpu_fp8_gemm_reason())
            return BackendChoice("torch", f"torch._scaled_mm ({choice.reason})")
        return choice
    requested = settings.current().fp8_gemm
    if requested == "triton":
        choice = select_backend("fp8_gemm", device, "triton", triton_unsupported=triton_unsupported)
        return BackendChoice("triton", f"{FP8_GEMM_ENV}=triton: the Triton FP8 GEMM was chosen ({choice.reason})")
    cap = cuda_capability(device)
    sm = f"sm_{cap[0]}{cap[1]}"
    if cap < SCALED_MM_MIN_CAPABILITY:
        return BackendChoice(
            "torch",
            f"torch._scaled_mm needs FP8 tensor cores (sm_89+), this GPU is {sm}: run without FP8, or set "
            f"{FP8_GEMM_ENV}=triton for the Triton GEMM (FP8 emulated in fp16 MMAs)",
            runnable=False,
        )
    why = "chosen" if requested == "torch" else "default on CUDA"
    return BackendChoice(
        "torch",
        f"torch._scaled_mm (cuBLASLt) on {sm}: {why}; the Triton GEMM runs only when chosen "
        f"(backend='triton' or {FP8_GEMM_ENV}=triton) until a GPU benchmark shows it at least as fast",
    )


def _cpu_fp8_gemm_reason() -> str:
    now = settings.current()
    return _cpu_fp8_gemm_reason_for(now.cpu_fp8_gemm, now.cpu_fp8_gemm_units)


@functools.lru_cache(maxsize=None)
def _cpu_fp8_gemm_reason_for(path: str, units: str) -> str:
    if path == "emulate":
        if units == "fp32" or not cpu_has_amx_bf16():
            gemm = "fp32 GEMM"
        else:
            gemm = (f"fp32-accumulating GEMM on the CPU's AMX-BF16 units from 2^22 multiply-adds while no "
                    f"other Python thread could run a matmul (FP8 values are exact in bf16; "
                    f"{CPU_FP8_GEMM_UNITS_ENV}=fp32 keeps the fp32 units)")
        return (
            f"inputs on cpu: exact emulation of torch._scaled_mm (FP8 decoded by table, {gemm}, scales in "
            f"the epilogue), fast on every CPU (cuBLASLt and Triton run on CUDA); {CPU_FP8_GEMM_ENV}=scaled_mm "
            "runs torch's CPU kernel instead"
        )
    return (f"inputs on cpu: torch._scaled_mm ({CPU_FP8_GEMM_ENV}=scaled_mm; its speed depends on the CPU's "
            "oneDNN kernel; cuBLASLt and Triton run on CUDA)")


def planned_backend(kernel: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> BackendChoice:
    """The backend an auto (``backend=None``) call of ``kernel`` would take for tensors
    of ``dtype`` on ``device``, without running anything (``explain`` uses it).

    Applies the device and dtype rules (float64 runs on torch); per-call shape limits,
    such as the Triton norm kernels' row width, are not known here.
    """

    if kernel == "fp8_gemm":
        return select_fp8_gemm_backend(device, None, triton_unsupported=triton_dtype_issue(dtype))
    return select_backend(kernel, device, None, triton_unsupported=triton_dtype_issue(dtype))
