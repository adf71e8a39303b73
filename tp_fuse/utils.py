"""Transformer Engine's ``transformer_engine.pytorch.utils``: device queries for this build, and
TE's small init / mask helpers.

The device questions TE users and TE's tests ask before choosing a code path:

* :func:`get_device_compute_capability` -- the current CUDA device's ``(major, minor)``
  (TE's answer), or ``(0, 0)`` without a CUDA device (TE raises there; ``(0, 0)`` makes
  every ``>= (9, 0)``-style requirement read False, which is the truth on a CPU).
* :func:`is_non_tn_fp8_gemm_supported` -- always False here: per-tensor FP8 GEMMs run
  through ``torch._scaled_mm`` (or its exact CPU emulation) in the TN layout, reading the
  cached FP8 transposes (``Float8Tensor.transpose_fp8``) for dgrad and wgrad, on every
  device. TE answers True on Blackwell, where its cuBLAS GEMMs take other layouts.

TE's helpers, with TE's semantics: :func:`init_method_normal` / :func:`scaled_init_method_normal`
(the ``init_method`` callables TE's modules take) and :func:`attention_mask_func`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "attention_mask_func",
    "get_device_compute_capability",
    "init_method_normal",
    "is_non_tn_fp8_gemm_supported",
    "scaled_init_method_normal",
]


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


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """TE's ``init_method_normal``: an ``init_method`` drawing N(0, sigma^2) in place."""
    if not sigma > 0:
        raise ValueError(f"init_method_normal: sigma must be > 0, got {sigma!r}")

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """TE's ``scaled_init_method_normal``: N(0, (sigma / sqrt(2 * num_layers))^2) (output layers)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"scaled_init_method_normal: num_layers must be a positive int, got {num_layers!r}")
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """TE's ``attention_mask_func``: scores where ``attention_mask`` is True become -10000 (in place)."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores
