"""Transformer Engine's ``DType`` enum, below every tensor and quantizer module.

Its own module so that the quantized tensor classes (``Float8Tensor._fp8_dtype``,
``NVFP4Tensor._fp4_dtype``) and the quantizers can both import it without a cycle.
"""

from __future__ import annotations

import enum
from typing import Union

import torch

__all__ = ["DType", "as_torch_dtype", "te_dtype_of"]


class DType(enum.Enum):
    """Transformer Engine's dtype enum; ``.torch_dtype`` is the torch equivalent."""

    kByte = torch.uint8
    kInt32 = torch.int32
    kInt64 = torch.int64
    kFloat32 = torch.float32
    kFloat16 = torch.float16
    kBFloat16 = torch.bfloat16
    kFloat8E4M3 = torch.float8_e4m3fn
    kFloat8E5M2 = torch.float8_e5m2
    kFloat4E2M1 = torch.float4_e2m1fn_x2  # NVFP4 data: two E2M1 values per byte

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.value


def as_torch_dtype(dtype: Union[DType, torch.dtype], what: str) -> torch.dtype:
    """``dtype`` as a torch dtype (a :class:`DType` or a torch dtype)."""
    if isinstance(dtype, DType):
        return dtype.value
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"{what}: expected a tp_fuse.DType or torch.dtype, got {dtype!r}")


def te_dtype_of(dtype: torch.dtype) -> DType:
    """The :class:`DType` of a torch dtype (``DType(dtype)``, with a clear error)."""
    try:
        return DType(dtype)
    except ValueError:
        raise ValueError(f"te_dtype_of: no Transformer Engine DType for {dtype}") from None
