"""LayerNorm / RMSNorm forward that write what the next GEMM reads.

With ``fp8_dtype`` given, the normalized output is quantized inside the norm (no
separate cast kernel, no high-precision round trip through memory), and the amax of
the high-precision normalized output comes out of the same pass for the quantizer.
Math is fp32 whatever the input dtype (float64 for float64 inputs, torch path only);
conventions follow Transformer Engine:

    LayerNorm:  mean = E[x],  var = E[(x - mean)^2] (biased),  rstd = 1 / sqrt(var + eps)
                y = (x - mean) * rstd * weight + bias
    RMSNorm:    var = E[x^2],  rstd = 1 / sqrt(var + eps),  y = x * rstd * weight

The torch path is aten's fused CPU/CUDA kernels, ``torch.native_layer_norm`` and
``aten._fused_rms_norm`` (same definitions, one pass over the rows), run in the compute
dtype so that the amax and the FP8 cast see the unrounded result.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from ._common import (
    as_shape,
    check_float,
    check_fold_outputs,
    check_quant_args,
    check_vector,
    compute_dtype,
    finish_output,
    fold_outputs,
    rows_2d,
    triton_dtype_issue,
    upcast,
)

__all__ = ["layernorm_fwd", "rmsnorm_fwd", "MAX_TRITON_NORM_COLS"]

# The Triton kernel keeps whole rows in registers; wider rows would spill heavily.
MAX_TRITON_NORM_COLS = 32768


def layernorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """LayerNorm over the last dimension.

    Shapes (``n = x.shape[-1]``)::

        x            [..., n]  fp32 / bf16 / fp16, any strides
        weight, bias [n]       any float dtype (used in fp32)
        scale        []        fp32, only with fp8_dtype
        y            [..., n]  x.dtype, or fp8_dtype (= clamp(y32 * scale) cast, RTNE)
        mean, rstd   [...]     fp32
        amax         []        fp32, max |y32| of the fp32 output before any cast/scale

    Returns ``(y, mean, rstd, amax)``; amax is None with ``with_amax=False`` (no FP8
    consumer: the torch path then skips a read of y and, for bf16/fp16 x, lets aten
    write x.dtype directly from its fp32 math). ``amax_out`` / ``scale_inv_out``: as
    ``quantize``'s (the amax maxed into a quantizer's slot, ``1 / scale`` written), in the
    norm's one launch on CUDA.
    """
    _check_norm_args(x, weight, eps, scale, fp8_dtype, amax_out, scale_inv_out)
    check_vector("bias", bias, x.shape[-1], x.device)
    choice = _select("layernorm_fwd", x, backend, triton_dtype_issue(x.dtype, weight.dtype, bias.dtype))
    if choice.backend == "torch":
        y, mean, rstd, amax = _norm_torch(x, weight, bias, eps, scale, fp8_dtype, with_amax or amax_out is not None,
                                          rms=False)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        variant = "reference"
    else:
        from . import norms_triton  # triton only when a Triton path is taken

        y, mean, rstd, amax, variant = norms_triton.norm_fwd_triton(
            x, weight, bias, eps, scale, fp8_dtype, rms=False, with_amax=with_amax, amax_out=amax_out,
            scale_inv_out=scale_inv_out,
        )
    dispatch.log_call("layernorm_fwd", choice, variant, x.device)
    return y, mean, rstd, amax


def rmsnorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm over the last dimension: ``y = x * rstd * weight``.

    Shapes as ``layernorm_fwd`` without ``bias`` and ``mean``. Returns ``(y, rstd, amax)``.
    """
    _check_norm_args(x, weight, eps, scale, fp8_dtype, amax_out, scale_inv_out)
    choice = _select("rmsnorm_fwd", x, backend, triton_dtype_issue(x.dtype, weight.dtype))
    if choice.backend == "torch":
        y, _, rstd, amax = _norm_torch(x, weight, None, eps, scale, fp8_dtype, with_amax or amax_out is not None,
                                       rms=True)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        variant = "reference"
    else:
        from . import norms_triton  # triton only when a Triton path is taken

        y, _, rstd, amax, variant = norms_triton.norm_fwd_triton(
            x, weight, None, eps, scale, fp8_dtype, rms=True, with_amax=with_amax, amax_out=amax_out,
            scale_inv_out=scale_inv_out,
        )
    dispatch.log_call("rmsnorm_fwd", choice, variant, x.device)
    return y, rstd, amax


def _check_norm_args(x, weight, eps, scale, fp8_dtype, amax_out=None, scale_inv_out=None) -> None:
    check_float("x", x)
    check_fold_outputs(x.device, scale, amax_out, scale_inv_out)
    check_vector("weight", weight, x.shape[-1], x.device)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    check_quant_args(scale, fp8_dtype, x.device)


def _select(
    kernel: str, x: torch.Tensor, backend: Optional[str], dtype_issue: Optional[str] = None
) -> dispatch.BackendChoice:
    n = x.shape[-1]
    unsupported = dtype_issue
    if n > MAX_TRITON_NORM_COLS:
        unsupported = f"rows of {n} elements exceed the Triton norm kernel's limit of {MAX_TRITON_NORM_COLS}"
    return dispatch.select_backend(kernel, x.device, backend, triton_unsupported=unsupported)


def _norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    scale: Optional[torch.Tensor],
    fp8_dtype: Optional[torch.dtype],
    with_amax: bool,
    *,
    rms: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    n = x.shape[-1]
    cdtype = compute_dtype(x.dtype)
    # Parameters always in the compute dtype: with bf16 parameters aten would round
    # mean/rstd to bf16. The input too when the amax or the FP8 cast must see the
    # unrounded result; otherwise aten's mixed mode (bf16 x, fp32 math and statistics)
    # writes y in x.dtype directly.
    x2 = rows_2d(x)  # [rows, n]
    mixed = fp8_dtype is None and not with_amax
    if not mixed:
        x2 = upcast(x2)
    w = weight if weight.dtype == cdtype else weight.to(cdtype)
    if rms:
        y32, rstd = torch.ops.aten._fused_rms_norm(x2, [n], w, eps)  # [rows, n], [rows, 1]
        mean = None
    else:
        b = bias if bias.dtype == cdtype else bias.to(cdtype)
        y32, mean, rstd = torch.native_layer_norm(x2, [n], w, b, eps)  # [rows, n], [rows, 1] x2
    y, amax = finish_output(y32, x.dtype, scale, fp8_dtype, with_amax)
    lead = x.shape[:-1]
    return as_shape(y, x.shape), None if mean is None else as_shape(mean, lead), as_shape(rstd, lead), amax
