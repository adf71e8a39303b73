"""Input checks and dtype helpers shared by the elementwise/normalization basic ops.

Every check raises ``ValueError`` whose message starts with the op's name, so a
user who fed the wrong tensor knows which op in a long ``Sequential`` refused it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from ...quantization import is_quantized_tensor


def maybe_dequantize(x: torch.Tensor) -> torch.Tensor:
    """High-precision view of ``x``: a ``Float8Tensor`` (after a ``Quantize`` op) is dequantized.

    Plain tensors take the fast path without importing the quantization package.
    """
    if type(x) is torch.Tensor:
        return x

    if is_quantized_tensor(x):
        return x.dequantize()
    return x


# The checks below run on every call of every op: their messages are formatted only on
# failure (an f-string with devices and shapes costs a few microseconds per call).


def check_tensor(op_name: str, x: object, what: str = "input") -> None:
    """``x`` must be a floating-point tensor (integer math has no gradient here)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op_name}: expected a torch.Tensor {what}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{op_name}: expected a floating-point {what}, got dtype {x.dtype}")


def check_matches_param(op_name: str, x: torch.Tensor, param: torch.Tensor, param_name: str) -> None:
    """Input and parameter must share the device: no silent copies. (Dtypes may differ:
    the fuser casts inputs to ``op.input_dtype`` and kernels read parameters in fp32.)"""
    if x.device != param.device:
        raise ValueError(f"{op_name}: input on {x.device}, {param_name} on {param.device}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for internal math: float64 stays float64, everything narrower runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def param_dtype(op_name: str, dtype: Optional[torch.dtype]) -> torch.dtype:
    """Parameter dtype for a constructor argument (``None``: torch's default dtype)."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{op_name}: expected a floating-point torch.dtype for parameters, got {dtype!r}")
    return dtype


def normalized_shape_tuple(op_name: str, normalized_shape: int | Iterable[int]) -> tuple[int, ...]:
    """``64`` or ``(8, 64)`` -> a tuple of positive ints (the trailing dims a norm acts on)."""
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        shape: tuple[Any, ...] = (normalized_shape,)
    elif isinstance(normalized_shape, Iterable) and not isinstance(normalized_shape, (str, bytes)):
        shape = tuple(normalized_shape)
    else:
        raise ValueError(
            f"{op_name}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise ValueError(
            f"{op_name}: normalized_shape must hold positive ints, got {normalized_shape!r}"
        )
    return shape


def check_trailing_shape(op_name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """``x``'s last ``len(shape)`` dims must equal ``shape``."""
    n = len(shape)
    if x.dim() >= n and tuple(x.shape[x.dim() - n :]) == shape:
        return
    if n == 1:
        expected = f"last dimension {shape[0]}"
    else:
        expected = f"trailing dimensions {shape}"
    raise ValueError(f"{op_name}: expected {expected}, got input of shape {tuple(x.shape)}")


def check_eps(op_name: str, eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op_name}: eps must be a non-negative float, got {eps!r}")
    return float(eps)
