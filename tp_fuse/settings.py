"""tp_fuse's environment switches, read and validated once: one frozen :class:`Settings`.

The switches (all optional)::

    TP_FUSE_STRICT_CUDA=0|1          on CPU, fail where CUDA or NCCL would (tp_fuse.strict)
    TP_FUSE_SIMULATE_CUDA=0|1        CPU tensors take the CUDA branches, to count launches
                                     (needs TRITON_INTERPRET=1; implies strict mode)
    TP_FUSE_FP8_GEMM=torch|triton    the FP8 GEMM of auto calls on CUDA (kernels.dispatch)
    TP_FUSE_CPU_FP8_GEMM=emulate|scaled_mm        the CPU FP8 GEMM (kernels.fp8_emulation)
    TP_FUSE_CPU_FP8_GEMM_UNITS=auto|fp32|bf16     the CPU emulation's GEMM units

They are read when this module is first imported, so spawned ranks, which inherit the
environment, see the parent's settings. Nothing on the hot path reads the environment: the
kernels read :func:`current`, an attribute look-up. The one way to change them in a running
process is :func:`override`, a context manager that sets the variables (so processes started
inside it inherit them), takes a new snapshot, and restores both on exit::

    with tp_fuse.settings.override(TP_FUSE_STRICT_CUDA="1"):
        ...

Code that caches a decision derived from the settings (the FP8 GEMM's plans) keys it on the
snapshot object: a new snapshot is a new object.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

__all__ = [
    "CPU_FP8_GEMM_ENV",
    "CPU_FP8_GEMM_PATHS",
    "CPU_FP8_GEMM_UNITS",
    "CPU_FP8_GEMM_UNITS_ENV",
    "FP8_GEMM_ENV",
    "SIMULATE_CUDA_ENV",
    "STRICT_ENV",
    "Settings",
    "current",
    "override",
]

STRICT_ENV = "TP_FUSE_STRICT_CUDA"
SIMULATE_CUDA_ENV = "TP_FUSE_SIMULATE_CUDA"
#: "torch" (default) or "triton": the FP8 GEMM of auto calls on CUDA.
FP8_GEMM_ENV = "TP_FUSE_FP8_GEMM"
#: "emulate" (default) or "scaled_mm": the CPU FP8 GEMM.
CPU_FP8_GEMM_ENV = "TP_FUSE_CPU_FP8_GEMM"
CPU_FP8_GEMM_PATHS = ("emulate", "scaled_mm")
#: "auto" (default), "fp32" or "bf16": the units of the CPU emulation's GEMM.
CPU_FP8_GEMM_UNITS_ENV = "TP_FUSE_CPU_FP8_GEMM_UNITS"
CPU_FP8_GEMM_UNITS = ("auto", "fp32", "bf16")
_FP8_GEMMS = ("torch", "triton")
_NAMES = (STRICT_ENV, SIMULATE_CUDA_ENV, FP8_GEMM_ENV, CPU_FP8_GEMM_ENV, CPU_FP8_GEMM_UNITS_ENV)


@dataclass(frozen=True, eq=False)
class Settings:
    """One snapshot of tp_fuse's environment switches (module doc), validated.

    ``fp8_gemm`` is ``""`` when ``TP_FUSE_FP8_GEMM`` is unset (the default choice, which
    ``explain`` words differently from an explicit ``torch``). Compared and hashed by
    identity (a new snapshot is a new key for the caches derived from it)."""

    strict_cuda: bool
    simulate_cuda: bool
    fp8_gemm: str
    cpu_fp8_gemm: str
    cpu_fp8_gemm_units: str

    @staticmethod
    def from_environment() -> "Settings":
        """Read and check every switch; ``ValueError`` names the variable and its choices."""
        simulate = _flag(SIMULATE_CUDA_ENV)
        if simulate and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"{SIMULATE_CUDA_ENV}=1 runs the Triton kernels on CPU: it needs TRITON_INTERPRET=1 set too "
                "(tp_fuse.kernels.launch_count.simulated_cuda_env() lists the environment)"
            )
        return Settings(
            # Simulating CUDA implies strict mode: the simulated GPU must refuse what a real one would.
            strict_cuda=_flag(STRICT_ENV) or simulate,
            simulate_cuda=simulate,
            fp8_gemm=_choice(FP8_GEMM_ENV, _FP8_GEMMS, ""),
            cpu_fp8_gemm=_choice(CPU_FP8_GEMM_ENV, CPU_FP8_GEMM_PATHS, "emulate"),
            cpu_fp8_gemm_units=_choice(CPU_FP8_GEMM_UNITS_ENV, CPU_FP8_GEMM_UNITS, "auto"),
        )


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return value == "1"


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


_current = Settings.from_environment()


def current() -> Settings:
    """The settings in force (read at import, or by the innermost :func:`override`)."""
    return _current


@contextlib.contextmanager
def override(**variables: Optional[str]) -> Iterator[Settings]:
    """Set tp_fuse's environment variables (``None`` unsets one) and use the settings they
    give until the block ends; then the previous environment and settings return.

    Raises ``ValueError`` for a name that is not a tp_fuse switch, for an invalid value
    (with the environment left as it was), and for ``TP_FUSE_SIMULATE_CUDA``, which decides
    at import which code paths exist in the process and cannot change afterwards.
    """
    global _current
    unknown = sorted(set(variables) - set(_NAMES))
    if unknown:
        raise ValueError(f"override: {unknown} are not tp_fuse switches; expected names among {_NAMES}")
    if SIMULATE_CUDA_ENV in variables:
        raise ValueError(f"override: {SIMULATE_CUDA_ENV} is fixed when tp_fuse is imported (set it before)")
    saved_env = {name: os.environ.get(name) for name in variables}
    saved = _current
    _set_environment(variables)
    try:
        _current = Settings.from_environment()
    except ValueError:
        _set_environment(saved_env)
        raise
    try:
        yield _current
    finally:
        _set_environment(saved_env)
        _current = saved


def _set_environment(variables: dict[str, Optional[str]]) -> None:
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
