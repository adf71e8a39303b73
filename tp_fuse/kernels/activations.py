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

The Triton kernels evaluate sigmoid and 1 - sigmoid from ``exp(-|z|)``
(``_triton_common.sigmoid_parts``): no overflow, no cancellation. The torch path is
written for CPU speed (on CPU a fresh full-size temporary costs more than a pass over a
warm one): ``gelu_fwd`` is one allocation and in-place passes of the sigmoid form with
``torch.sigmoid`` (accurate in both tails); ``dgelu_dbias`` is aten's fused ``gelu_backward``
where it is accurate and the sigmoid form, with ``1 - s`` as ``torch.sigmoid(-z)``, for
the negative tail where aten's ``1 + tanh(u)`` cancels (``_common.dgelu_grad_torch``); SwiGLU uses
``F.silu`` and ``torch.sigmoid(-a)`` for ``1 - s``. Results agree with Triton within
rounding.

``with_amax=False`` (every function): the amax is not wanted (no FP8 consumer) and comes
back as None; the torch path then skips a full read of the output.

Dtypes: fp32 / bf16 / fp16 everywhere, float64 on the torch path (computed in float64).
Bias gradient (``dgelu_dbias``): the torch path sums the ``dx`` it returns (in grad's
dtype) exactly as ``tp_fuse.ops.Bias`` does, so the fused backward op is bit-identical
to the basic ops; the Triton kernel sums the fp32 ``dx`` before rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch
from ._common import (
    as_dtype,
    as_shape,
    abs_max,
    check_float,
    check_fold_outputs,
    check_quant_args,
    compute_dtype,
    dgelu_grad_torch,
    finish_output,
    fold_outputs,
    gelu_torch,
    rows_2d,
    triton_dtype_issue,
    upcast,
)

__all__ = ["dgelu_dbias", "dswiglu", "gelu_fwd", "swiglu_fwd"]


def gelu_fwd(
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Tanh-approximate GELU. ``x [...]`` -> ``y [...]`` in x.dtype, or fp8_dtype when
    quantizing (``clamp(y32 * scale)``, RTNE). Returns ``(y, amax)``, amax = max |y32|
    (None with ``with_amax=False``: see the module doc). ``amax_out`` / ``scale_inv_out``:
    as ``quantize``'s, in the same launch."""
    check_float("x", x)
    quant = check_quant_args(scale, fp8_dtype, x.device)
    check_fold_outputs(x.device, scale, amax_out, scale_inv_out)
    choice = dispatch.select_backend("gelu_fwd", x.device, backend, triton_unsupported=triton_dtype_issue(x.dtype))
    if choice.backend == "torch":
        y, amax = finish_output(gelu_torch(upcast(x)), x.dtype, scale, fp8_dtype, with_amax or amax_out is not None)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        variant = "reference"
    else:
        from . import activations_triton as kt  # triton only when a Triton path is taken

        y, amax, variant = kt.gelu_fwd_triton(x, scale if quant else None, fp8_dtype, with_amax, amax_out,
                                              scale_inv_out)
    dispatch.log_call("gelu_fwd", choice, variant, x.device)
    return y, amax


def swiglu_fwd(
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """SwiGLU: ``x [..., 2n]`` -> ``y [..., n] = silu(x[..., :n]) * x[..., n:]``.

    ``y`` in x.dtype, or fp8_dtype when quantizing. Returns ``(y, amax)``."""
    _check_glu_input("x", x)
    quant = check_quant_args(scale, fp8_dtype, x.device)
    check_fold_outputs(x.device, scale, amax_out, scale_inv_out)
    choice = dispatch.select_backend("swiglu_fwd", x.device, backend, triton_unsupported=triton_dtype_issue(x.dtype))
    if choice.backend == "torch":
        x1, x2 = upcast(rows_2d(x)).chunk(2, dim=-1)  # [rows, n] each, views
        # silu(a) = a / (1 + exp(-a)): accurate in both tails.
        y32 = F.silu(x1).mul_(x2)
        y, amax = finish_output(y32, x.dtype, scale, fp8_dtype, with_amax or amax_out is not None)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        y = y.reshape(*x.shape[:-1], x.shape[-1] // 2)
        variant = "reference"
    else:
        from . import activations_triton as kt  # triton only when a Triton path is taken

        y, amax, variant = kt.swiglu_fwd_triton(x, scale if quant else None, fp8_dtype, with_amax, amax_out,
                                                scale_inv_out)
    dispatch.log_call("swiglu_fwd", choice, variant, x.device)
    return y, amax


def dgelu_dbias(
    grad: torch.Tensor,
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    with_amax: bool = True,
    with_dbias: bool = True,
    overwrite_grad: bool = False,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """GELU backward fused with the bias gradient of the GEMM that produced ``x``.

    Shapes (``n = x.shape[-1]``)::

        grad, x  [..., n]   any float dtypes, same shape
        dx       [..., n]   grad.dtype, or fp8_dtype when quantizing
        dbias    [n]        grad.dtype; sum of dx over all leading dims, accumulated in
                            fp32 (float64 for float64 grad), before any quantization.
                            torch path: the sum of dx rounded to grad.dtype, computed
                            like ``tp_fuse.ops.Bias``'s backward (bit-identical to it);
                            Triton: the sum of the fp32 dx (equal within rounding).
        amax     []         fp32, max |dx32|

    ``dx32 = grad * gelu'(x)``. Returns ``(dx, dbias, amax)``; ``dbias`` is None with
    ``with_dbias=False`` (a GELU without a bias before it: the torch path skips the sum).
    ``overwrite_grad=True``: ``grad`` is the caller's to lose; the torch path may write
    ``dx`` into its buffer (saving a full-size allocation) and return it.
    """
    check_float("grad", grad)
    check_float("x", x)
    _check_same_shape(grad, x)
    quant = check_quant_args(scale, fp8_dtype, x.device)
    check_fold_outputs(x.device, scale, amax_out, scale_inv_out)
    want_amax = with_amax or amax_out is not None
    choice = dispatch.select_backend(
        "dgelu_dbias", x.device, backend, triton_unsupported=triton_dtype_issue(grad.dtype, x.dtype)
    )
    if choice.backend == "torch":
        cdtype = compute_dtype(grad.dtype)
        # float64 if either is (torch.promote_types is an op call)
        wide = torch.float64 if torch.float64 in (cdtype, x.dtype) else torch.float32
        g_rows, xw = rows_2d(grad), as_dtype(rows_2d(x), wide)
        g = as_dtype(g_rows, wide)  # a copy when converted: then ours to overwrite
        dx32 = dgelu_grad_torch(g, xw, overwrite_grad=_may_overwrite(g, g is not g_rows or overwrite_grad, xw))
        if dx32.dtype != cdtype:
            dx32 = as_dtype(dx32, cdtype)
        # dbias as Bias.bias_grad computes it from the dx it would receive: the
        # high-precision dx (rounded to grad.dtype), summed in the compute dtype.
        dx_hp = as_dtype(dx32, grad.dtype)
        dbias = as_dtype(dx_hp.sum(dim=0, dtype=cdtype), grad.dtype) if with_dbias else None
        if fp8_dtype is None:
            dx, amax = dx_hp.contiguous(), abs_max(dx32) if want_amax else None
        else:
            dx, amax = finish_output(dx32, grad.dtype, scale, fp8_dtype, want_amax)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        dx = as_shape(dx, x.shape)
        variant = "reference"
    else:
        from . import activations_triton as kt  # triton only when a Triton path is taken

        dx, dbias, amax, variant = kt.dgelu_dbias_triton(grad, x, scale if quant else None, fp8_dtype, with_amax,
                                                         amax_out, scale_inv_out, with_dbias)
    dispatch.log_call("dgelu_dbias", choice, variant, x.device)
    return dx, dbias, amax


def _may_overwrite(grad: torch.Tensor, ours: bool, x: torch.Tensor) -> bool:
    """Whether the GELU backward may write into ``grad``: it is ours to lose (a
    conversion copy, or the caller said so), contiguous, apart from ``x``, and the write
    is invisible to autograd (no graph is being recorded through it)."""
    if not ours or not grad.is_contiguous() or grad.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return False
    return not (torch.is_grad_enabled() and (grad.requires_grad or x.requires_grad))


def dswiglu(
    grad: torch.Tensor,
    x: torch.Tensor,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
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
    check_fold_outputs(x.device, scale, amax_out, scale_inv_out)
    choice = dispatch.select_backend(
        "dswiglu", x.device, backend, triton_unsupported=triton_dtype_issue(grad.dtype, x.dtype)
    )
    if choice.backend == "torch":
        g = upcast(rows_2d(grad))  # [rows, n]
        x1, x2 = upcast(rows_2d(x)).chunk(2, dim=-1)  # [rows, n] each, views
        s = torch.sigmoid(x1)
        one_minus_s = torch.neg(x1).sigmoid_()  # 1 - s without cancellation
        dx32 = torch.empty((g.shape[0], 2 * g.shape[1]), dtype=torch.promote_types(g.dtype, x1.dtype), device=x.device)
        d1, d2 = dx32.chunk(2, dim=-1)  # halves of the output, written in place
        torch.mul(x1, one_minus_s, out=d1).add_(1.0).mul_(s).mul_(x2).mul_(g)  # g x2 s (1 + x1 (1 - s))
        torch.mul(x1, s, out=d2).mul_(g)  # g silu(x1)
        dx, amax = finish_output(dx32, grad.dtype, scale, fp8_dtype, with_amax or amax_out is not None)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        dx = as_shape(dx, x.shape)
        variant = "reference"
    else:
        from . import activations_triton as kt  # triton only when a Triton path is taken

        dx, amax, variant = kt.dswiglu_triton(grad, x, scale if quant else None, fp8_dtype, with_amax, amax_out,
                                              scale_inv_out)
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
