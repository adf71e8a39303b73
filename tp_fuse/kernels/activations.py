"""GELU / SwiGLU forward and backward with fused FP8 output quantization and amax.

In an FP8 MLP the activation sits between two GEMMs: its forward output is the input of
FC2 (quantized with FC2's input scale) and its backward output is FC1's grad_output
(quantized with FC1's grad scale, plus FC1's bias gradient). Fusing the cast, the amax
and the bias gradient into the activation kernel saves whole passes over the
[tokens, ffn] tensor.

Definitions (fp32 math; ``s(z) = 1 / (1 + exp(-z))``):

    gelu(x)   = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)   (TE's tanh GELU)
              = x s(2u)           (evaluated in this form: no cancellation in 1 + tanh)
    gelu'(x)  = s(2u) + 2 x s(2u) (1 - s(2u)) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    swiglu(x) = silu(x1) * x2,  x = [x1 | x2] split in halves along the last dim,
                silu(a) = a s(a),  silu'(a) = s(a) (1 + a (1 - s(a)))

sigmoid and 1 - sigmoid are evaluated by ``_common.sigmoid_parts`` (no overflow, no
cancellation); both backends evaluate the same formulas in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from ._common import (
    check_float,
    check_quant_args,
    dgelu_fp32,
    finish_output,
    gelu_fp32,
    rows_2d,
    sigmoid_parts,
)

__all__ = ["dgelu_dbias", "dswiglu", "gelu_fwd", "swiglu_fwd"]


def gelu_fwd(
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tanh-approximate GELU. ``x [...]`` -> ``y [...]`` in x.dtype, or fp8_dtype when
    quantizing (``clamp(y32 * scale)``, RTNE). Returns ``(y, amax)``, amax = max |y32|."""
    check_float("x", x)
    quant = check_quant_args(scale, fp8_dtype, x.device)
    choice = dispatch.select_backend("gelu_fwd", x.device, backend)
    if choice.backend == "torch":
        y, amax = finish_output(gelu_fp32(x.float()), x.dtype, scale, fp8_dtype)
        variant = "reference"
    else:
        from . import activations_triton as kt

        y, amax, variant = kt.gelu_fwd_triton(x, scale if quant else None, fp8_dtype)
    dispatch.log_call("gelu_fwd", choice, variant, x.device)
    return y, amax


def swiglu_fwd(
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU: ``x [..., 2n]`` -> ``y [..., n] = silu(x[..., :n]) * x[..., n:]``.

    ``y`` in x.dtype, or fp8_dtype when quantizing. Returns ``(y, amax)``."""
    _check_glu_input("x", x)
    quant = check_quant_args(scale, fp8_dtype, x.device)
    choice = dispatch.select_backend("swiglu_fwd", x.device, backend)
    if choice.backend == "torch":
        x1, x2 = rows_2d(x).float().chunk(2, dim=-1)  # [rows, n] each
        s, _ = sigmoid_parts(x1)
        y32 = x1 * s * x2
        y, amax = finish_output(y32, x.dtype, scale, fp8_dtype)
        y = y.reshape(*x.shape[:-1], x.shape[-1] // 2)
        variant = "reference"
    else:
        from . import activations_triton as kt

        y, amax, variant = kt.swiglu_fwd_triton(x, scale if quant else None, fp8_dtype)
    dispatch.log_call("swiglu_fwd", choice, variant, x.device)
    return y, amax


def dgelu_dbias(
    grad: torch.Tensor,
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GELU backward fused with the bias gradient of the GEMM that produced ``x``.

    Shapes (``n = x.shape[-1]``)::

        grad, x  [..., n]   any float dtypes, same shape
        dx       [..., n]   grad.dtype, or fp8_dtype when quantizing
        dbias    [n]        grad.dtype; sum of the fp32 dx over all leading dims,
                            accumulated in fp32 (before any quantization)
        amax     []         fp32, max |dx32|

    ``dx32 = grad * gelu'(x)``. Returns ``(dx, dbias, amax)``.
    """
    check_float("grad", grad)
    check_float("x", x)
    _check_same_shape(grad, x)
    quant = check_quant_args(scale, fp8_dtype, x.device)
    choice = dispatch.select_backend("dgelu_dbias", x.device, backend)
    if choice.backend == "torch":
        dx32 = rows_2d(grad).float() * dgelu_fp32(rows_2d(x).float())  # [rows, n]
        dbias = dx32.sum(0).to(grad.dtype)
        dx, amax = finish_output(dx32, grad.dtype, scale, fp8_dtype)
        dx = dx.reshape(x.shape)
        variant = "reference"
    else:
        from . import activations_triton as kt

        dx, dbias, amax, variant = kt.dgelu_dbias_triton(grad, x, scale if quant else None, fp8_dtype)
    dispatch.log_call("dgelu_dbias", choice, variant, x.device)
    return dx, dbias, amax


def dswiglu(
    grad: torch.Tensor,
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU backward.

    Shapes::

        grad [..., n]    gradient of y
        x    [..., 2n]   forward input [x1 | x2]
        dx   [..., 2n]   grad.dtype, or fp8_dtype when quantizing:
                         [grad * x2 * silu'(x1) | grad * silu(x1)]
        amax []          fp32, max |dx32| over both halves

    Returns ``(dx, amax)``.
    """
    check_float("grad", grad)
    _check_glu_input("x", x)
    expected = (*x.shape[:-1], x.shape[-1] // 2)
    if tuple(grad.shape) != expected:
        raise ValueError(f"grad: expected shape {expected} (x.shape with the last dim halved), got {tuple(grad.shape)}")
    if grad.device != x.device:
        raise ValueError(f"grad: expected a tensor on {x.device}, got one on {grad.device}")
    quant = check_quant_args(scale, fp8_dtype, x.device)
    choice = dispatch.select_backend("dswiglu", x.device, backend)
    if choice.backend == "torch":
        g = rows_2d(grad).float()  # [rows, n]
        x1, x2 = rows_2d(x).float().chunk(2, dim=-1)
        s, one_minus_s = sigmoid_parts(x1)
        dx32 = torch.cat([g * x2 * (s * (1.0 + x1 * one_minus_s)), g * (x1 * s)], dim=-1)
        dx, amax = finish_output(dx32, grad.dtype, scale, fp8_dtype)
        dx = dx.reshape(x.shape)
        variant = "reference"
    else:
        from . import activations_triton as kt

        dx, amax, variant = kt.dswiglu_triton(grad, x, scale if quant else None, fp8_dtype)
    dispatch.log_call("dswiglu", choice, variant, x.device)
    return dx, amax


def _check_glu_input(name: str, x: torch.Tensor) -> None:
    check_float(name, x)
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"{name}: expected an even last dimension [..., 2n], got shape {tuple(x.shape)}")


def _check_same_shape(grad: torch.Tensor, x: torch.Tensor) -> None:
    if grad.shape != x.shape:
        raise ValueError(f"grad: expected the shape of x {tuple(x.shape)}, got {tuple(grad.shape)}")
    if grad.device != x.device:
        raise ValueError(f"grad: expected a tensor on {x.device}, got one on {grad.device}")
