"""Transformer Engine's ``transformer_engine.pytorch.utils`` device queries, for this build.

Only the device questions TE users and TE's tests ask before choosing a code path:

* :func:`get_device_compute_capability` -- the current CUDA device's ``(major, minor)``
  (TE's answer), or ``(0, 0)`` without a CUDA device (TE raises there; ``(0, 0)`` makes
  every ``>= (9, 0)``-style requirement read False, which is the truth on a CPU).
* :func:`is_non_tn_fp8_gemm_supported` -- always False here: per-tensor FP8 GEMMs run
  through ``torch._scaled_mm`` (or its exact CPU emulation) in the TN layout, reading the
  cached FP8 transposes (``Float8Tensor.transpose_fp8``) for dgrad and wgrad, on every
  device. TE answers True on Blackwell, where its cuBLAS GEMMs take other layouts.
"""

from __future__ import annotations

import torch

__all__ = ["get_device_compute_capability", "is_non_tn_fp8_gemm_supported"]


def get_device_compute_capability() -> tuple[int, int]:
    """CUDA compute capability ``(major, minor)`` of the current GPU; ``(0, 0)`` without one."""
    if not torch.cuda.is_available():
        return (0, 0)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (props.major, props.minor)


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether FP8 GEMMs take non-TN layouts, so FP8 transposes are not needed: never here.

    TE's name; tp_fuse's FP8 GEMMs always read a column-major second operand made from
    the cached FP8 transpose (the layout ``torch._scaled_mm`` requires), on CPU and GPU.
    """
    return False
