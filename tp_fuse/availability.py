"""``is_fp8_available()`` and siblings (Transformer Engine's names).

Answers for this build of tp_fuse on this machine. FP8 per-tensor GEMMs use
``torch._scaled_mm`` on CUDA and its exact emulation on CPU
(``kernels.fp8_emulation``); the probe runs one tiny FP8 GEMM on the current device
through that same call site. Formats tp_fuse does not implement report
False with the reason.
"""

from __future__ import annotations

import functools
from typing import Union

import torch

from .kernels.cuda_rules import scaled_mm

__all__ = [
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
]

Answer = Union[bool, tuple[bool, str]]


def _answer(ok: bool, reason: str, return_reason: bool) -> Answer:
    return (ok, reason) if return_reason else ok


@functools.lru_cache(maxsize=None)
def _probe_scaled_mm(device: str) -> tuple[bool, str]:
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        scaled_mm(a, a.t(), one, one, torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        return False, f"the FP8 GEMM does not run on {device}: {e}"
    return True, ""


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_fp8_available(return_reason: bool = False) -> Answer:
    """Whether per-tensor FP8 (delayed and current scaling) runs here."""
    ok, reason = _probe_scaled_mm(_device())
    return _answer(ok, reason, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Answer:
    """MXFP8 (``MXFP8BlockScaling``): an exact emulation on CPU; on CUDA the MX GEMM needs sm100+."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 10:
        cap = torch.cuda.get_device_capability()
        return _answer(False, f"the MXFP8 GEMM needs an sm100+ GPU (Blackwell), this one is sm{cap[0]}{cap[1]}",
                       return_reason)
    return _answer(True, "", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Answer:
    """NVFP4 (``NVFP4BlockScaling``): an exact emulation on CPU; on CUDA the FP4 GEMM needs sm100+."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 10:
        cap = torch.cuda.get_device_capability()
        return _answer(False, f"the NVFP4 GEMM needs an sm100+ GPU (Blackwell), this one is sm{cap[0]}{cap[1]}",
                       return_reason)
    return _answer(True, "", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Answer:
    """FP8 block scaling (``Float8BlockScaling``, 1x128 / 128x128): an exact emulation on CPU;
    on CUDA torch's blockwise scaled_mm needs sm90 (Hopper)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        cap = torch.cuda.get_device_capability()
        return _answer(False, f"the FP8 block-scaling GEMM needs an sm90 GPU (Hopper), this one is "
                              f"sm{cap[0]}{cap[1]}", return_reason)
    return _answer(True, "", return_reason)


def is_bf16_available(return_reason: bool = False) -> Answer:
    """bf16 compute: torch supports it on CPU; on CUDA it needs compute capability 8.0."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return _answer(False, "bf16 needs compute capability >= 8.0", return_reason)
    return _answer(True, "", return_reason)
