"""Argument checks and the torch-side FP8 cast shared by all kernels.

The torch functions here define the semantics that the Triton kernels reproduce:

* ``fp8_cast(v, scale, fp8_dtype)``: ``clamp(v * scale, -fp8_max, fp8_max)`` in fp32,
  then torch's round-to-nearest-even ``.to(fp8_dtype)``. Saturating: +-inf map to
  +-fp8_max; NaN stays NaN (byte ``0x7F | sign``, which is what torch emits).
* ``abs_max(v)``: ``max(|v|)`` as an fp32 0-d tensor, NaN if any element is NaN, 0 for
  an empty tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(name: str, t: torch.Tensor, *, min_dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype in {FLOAT_DTYPES}, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}")


def check_fp8_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_MAX:
        raise ValueError(f"{name}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def check_scale(name: str, scale: torch.Tensor, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        if isinstance(scale, torch.Tensor):
            got = f"{scale.dtype} tensor of shape {tuple(scale.shape)}"
        else:
            got = type(scale).__name__
        raise ValueError(f"{name}: expected a float32 tensor with one element, got {got}")
    if scale.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {scale.device}")


def check_quant_args(scale: Optional[torch.Tensor], fp8_dtype: Optional[torch.dtype], device: torch.device) -> bool:
    """Validate the optional ``scale``/``fp8_dtype`` pair; returns whether to quantize."""
    if (scale is None) != (fp8_dtype is None):
        raise ValueError(
            f"scale/fp8_dtype: pass both to quantize the output or neither, got scale="
            f"{'None' if scale is None else 'tensor'} and fp8_dtype={fp8_dtype}"
        )
    if fp8_dtype is None:
        return False
    check_fp8_dtype("fp8_dtype", fp8_dtype)
    check_scale("scale", scale, device)
    return True


def check_vector(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    check_float(name, t)
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``[..., n] -> [rows, n]`` view when strides allow (a copy otherwise)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def fp8_cast(v: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating RTNE cast of fp32 ``v * scale`` to ``fp8_dtype`` (see module doc)."""
    fp8_max = FP8_MAX[fp8_dtype]
    # torch's .to(float8) is not saturating (e4m3: >= 464 becomes NaN; e5m2: overflow
    # becomes inf), hence the clamp; torch.clamp keeps NaN as NaN.
    return torch.clamp(v.float() * scale.reshape(()), -fp8_max, fp8_max).to(fp8_dtype)


def abs_max(v: torch.Tensor) -> torch.Tensor:
    """fp32 0-d ``max(|v|)``; NaN-propagating; 0 for an empty tensor."""
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=v.device)
    return v.abs().amax().float()


def finish_output(
    v: torch.Tensor, out_dtype: torch.dtype, scale: Optional[torch.Tensor], fp8_dtype: Optional[torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 result -> (contiguous output in ``out_dtype`` or FP8, amax of the fp32 result)."""
    amax = abs_max(v)
    # Elementwise ops keep the input's strides; outputs are contiguous like Triton's.
    if fp8_dtype is not None:
        return fp8_cast(v, scale, fp8_dtype).contiguous(), amax
    return v.to(out_dtype).contiguous(), amax


# GELU (tanh approximation) in the form both backends evaluate. Transformer Engine's
# 0.5*x*(1 + tanh(u)) equals x * sigmoid(2u) exactly; the sigmoid form avoids the
# cancellation in 1 + tanh(u) for negative x (where fp32 tanh(u) ~ -1 loses all digits).
GELU_K = 0.7978845608028654  # sqrt(2 / pi)
GELU_C = 0.044715


def sigmoid_parts(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(sigmoid(z), 1 - sigmoid(z))``, both without cancellation or overflow.

    With ``e = exp(-|z|)`` (never overflows) and ``r = 1 / (1 + e)``: for z >= 0,
    ``s = r`` and ``1 - s = e r``; for z < 0 the two swap. Written out (not
    torch.sigmoid) so that the torch and Triton backends evaluate the same formula.
    """
    e = torch.exp(-z.abs())
    r = 1.0 / (1.0 + e)
    er = e * r
    pos = z >= 0
    return torch.where(pos, r, er), torch.where(pos, er, r)


def gelu_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(s, 1 - s)`` with ``s = sigmoid(2u)``, ``u = k (x + c x^3)``."""
    return sigmoid_parts((2.0 * GELU_K) * (x + GELU_C * (x * x * x)))


def gelu_fp32(x: torch.Tensor) -> torch.Tensor:
    s, _ = gelu_parts(x)
    return x * s


def dgelu_fp32(x: torch.Tensor) -> torch.Tensor:
    """d/dx gelu_tanh(x) = s + 2 x s (1 - s) k (1 + 3 c x^2), s = sigmoid(2u)."""
    s, one_minus_s = gelu_parts(x)
    return s + 2.0 * x * s * one_minus_s * GELU_K * (1.0 + (3.0 * GELU_C) * x * x)
