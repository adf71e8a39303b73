"""FP8 quantization with a fused amax and an optional transposed copy.

``quantize`` is the cast every FP8 GEMM input goes through: one read of ``x`` produces
the FP8 bytes for the forward GEMM, the transposed FP8 bytes for the wgrad GEMM (which
contracts over the token dimension, so it wants tokens innermost), and ``max(|x|)`` for
the next scale update.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tp_fuse import settings

from . import dispatch
from ._common import (
    FP8_MAX,
    abs_max,
    as_shape,
    check_float,
    check_fold_outputs,
    check_fp8_dtype,
    check_scale,
    current_scale_torch,
    fold_outputs,
    fp8_cast,
    rows_2d,
    triton_dtype_issue,
)

__all__ = ["amax_of", "quantize", "quantize_current_scaling"]

# quantize's signature -> its backend choice, checks passed (_quantize_choice). Bounded.
_CHOICES: dict[tuple, dispatch.BackendChoice] = {}
_MAX_CHOICES = 4096


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool = False,
    backend: Optional[str] = None,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Quantize ``x`` to FP8 and compute its amax in the same pass.

    Shapes (``x`` viewed as 2-D ``[rows, cols]``, ``cols = x.shape[-1]``)::

        x      [..., cols]   fp32 / bf16 / fp16 (float64: torch path), any strides
        scale  []            fp32 (quantization scale: fp8 = x * scale)
        data   [..., cols]   fp8_dtype, contiguous
        data_t [cols, rows]  fp8_dtype, contiguous (only with ``transpose=True``)
        amax   []            fp32

    Semantics: ``data = clamp(x.float() * scale, -fp8_max, fp8_max).to(fp8_dtype)``
    (the product in float64 for float64 ``x``)
    with round-to-nearest-even; saturating (inf -> +-fp8_max), NaN stays NaN.
    ``data_t = data.reshape(rows, cols).T``. ``amax = max(|x|)`` (NaN if ``x`` has a
    NaN, 0 if ``x`` is empty), of ``x`` itself, not of the scaled values.

    Args:
        backend: None (auto), "torch" or "triton"; see ``tp_fuse.kernels.dispatch``.
        with_amax: False when the caller already has the amax (current scaling computes
            it first to derive the scale): amax comes back as None, and the torch path
            skips a full read of ``x``.
        amax_out: a one-element fp32 tensor (a delayed quantizer's history slot, >= 0 or
            NaN) into which ``max(|x|)`` is maxed in place, and which is returned as the
            amax: on CUDA the cast kernel's atomic max goes there directly (no fill, no
            ``maximum``).
        scale_inv_out: a one-element fp32 tensor that receives ``1 / scale`` (the
            dequantization scale of the result), written by the cast kernel on CUDA.

    On CUDA this is one kernel launch, plus one fill for a fresh amax (``with_amax``
    without ``amax_out``).
    """
    try:
        key = (x.dtype, x.dim(), x.device, scale.dtype, scale.shape, scale.device, fp8_dtype, transpose, backend,
               None if amax_out is None else (amax_out.dtype, amax_out.shape, amax_out.device),
               None if scale_inv_out is None else (scale_inv_out.dtype, scale_inv_out.shape, scale_inv_out.device),
               settings.current())
    except AttributeError:  # not tensors: the checks name the argument
        key = None
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _quantize_choice(x, scale, fp8_dtype, transpose, backend, amax_out, scale_inv_out, key)
    if choice.backend == "torch":
        data, data_t, amax = _quantize_torch(x, scale, fp8_dtype, transpose, with_amax or amax_out is not None)
        amax = fold_outputs(amax, scale, amax_out, scale_inv_out)
        variant = "reference"
    else:
        from . import cast_triton  # triton only when a Triton path is taken

        data, data_t, amax, variant = cast_triton.quantize_triton(
            x, scale, fp8_dtype, transpose, with_amax, amax_out, scale_inv_out
        )
        if x.numel() == 0 and scale_inv_out is not None:  # no program ran to write it
            torch.reciprocal(scale, out=scale_inv_out)
    dispatch.log_call("quantize", choice, variant, x.device)
    return data, data_t, amax if (with_amax or amax_out is not None) else None


def _quantize_choice(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    backend: Optional[str],
    amax_out: Optional[torch.Tensor],
    scale_inv_out: Optional[torch.Tensor],
    key: Optional[tuple],
) -> dispatch.BackendChoice:
    """:func:`quantize`'s checks and backend choice for a new signature (its dtypes, ranks,
    devices, scalars' shapes, options and the settings), kept for the next calls: they
    depend on nothing else, and a failing signature is not kept (it raises every time)."""
    check_float("x", x)
    check_fp8_dtype("fp8_dtype", fp8_dtype)
    check_scale("scale", scale, x.device)
    check_fold_outputs(x.device, scale, amax_out, scale_inv_out)
    choice = dispatch.select_backend("quantize", x.device, backend,
                                     triton_unsupported=triton_quantize_issue(x.dtype, x.device, transpose))
    if key is not None:
        if len(_CHOICES) >= _MAX_CHOICES:
            _CHOICES.clear()
        _CHOICES[key] = choice
    return choice


def quantize_current_scaling(
    x: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale_out: torch.Tensor,
    scale_inv_out: torch.Tensor,
    last_amax_out: torch.Tensor,
    nonfinite_count: torch.Tensor,
    zero_count: torch.Tensor,
    power_2_scale: bool = False,
    transpose: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Current scaling's cast: the scale comes from ``amax`` (``max |x|``, already reduced
    over the amax group) inside the cast, and the quantizer's state is written in place.

    Shapes as :func:`quantize`; ``amax``, ``scale_out``, ``scale_inv_out``,
    ``last_amax_out``: one-element fp32; ``nonfinite_count``, ``zero_count``: one-element
    int64; ``amax`` of any float dtype (an amax of bf16 values is exact in bf16: one
    reduction kernel, ``amax_of``). Semantics (``current_scale_and_checks``)::

        scale = fp8_max / amax   (float64, clamped to the fp32 range, [rounded down to a
                                  power of two], rounded to fp32); 1.0 if amax is 0 or NaN/inf
        data = cast(x * scale); scale_out = scale; scale_inv_out = 1 / scale
        last_amax_out = amax; nonfinite_count += amax is NaN/inf; zero_count += amax == 0

    Returns ``(data, data_t)``. On CUDA one kernel launch (Transformer Engine computes the
    scale in its cast kernel the same way), after the one that computed ``amax``.
    """
    check_float("x", x)
    check_fp8_dtype("fp8_dtype", fp8_dtype)
    if not isinstance(amax, torch.Tensor) or not amax.dtype.is_floating_point or amax.numel() != 1 \
            or amax.device != x.device:
        raise ValueError(f"amax: expected a floating-point tensor with one element on {x.device}")
    for name, t in (("scale_out", scale_out), ("scale_inv_out", scale_inv_out), ("last_amax_out", last_amax_out)):
        check_scale(name, t, x.device)
    for name, t in (("nonfinite_count", nonfinite_count), ("zero_count", zero_count)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.numel() != 1 or t.device != x.device:
            raise ValueError(f"{name}: expected an int64 tensor with one element on {x.device}")
    issue = triton_quantize_issue(x.dtype, x.device, transpose)
    if issue is None and x.numel() == 0:
        issue = "empty input: no program would write the scale"
    choice = dispatch.select_backend("quantize", x.device, backend, triton_unsupported=issue)
    if choice.backend == "torch":
        scale, nonfinite, zero = current_scale_torch(amax, FP8_MAX[fp8_dtype], power_2_scale)
        scale_out.copy_(scale)
        data, data_t, _ = _quantize_torch(x, scale, fp8_dtype, transpose, False)
        torch.reciprocal(scale, out=scale_inv_out)
        last_amax_out.copy_(amax)
        nonfinite_count.add_(nonfinite)
        zero_count.add_(zero)
        variant = "reference"
    else:
        from . import cast_triton  # triton only when a Triton path is taken

        data, data_t, _, variant = cast_triton.quantize_triton(
            x, scale_out, fp8_dtype, transpose, False, None, scale_inv_out,
            current=(amax, last_amax_out, nonfinite_count, zero_count, power_2_scale),
        )
    dispatch.log_call("quantize", choice, variant, x.device)
    return data, data_t


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a one-element tensor of ``x``'s dtype (exact: it is one of the
    values), NaN-propagating, 0 for an empty tensor: one reduction kernel on CUDA
    (``abs`` + ``amax`` would be two)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.linalg.vector_norm(x, math.inf)


def triton_quantize_issue(dtype: torch.dtype, device: torch.device, transpose: bool) -> Optional[str]:
    """Why the Triton quantize kernel must not take this call (None: it may).

    Besides float64, fp32 input with ``transpose=True`` on CUDA: on an H200 (Triton
    3.6, torch 2.11) the kernel's transposed bytes differed from torch's for a
    4096x4096 fp32 input, while its row-major bytes, bf16 inputs and small fp32 inputs
    matched (``tests/test_kernels.py::test_triton_fp32_transpose_on_cuda``). Until a
    GPU run shows that case right, the torch path computes it: right by construction.
    The interpreter (CPU) runs the same kernel correctly.
    """
    issue = triton_dtype_issue(dtype)
    if issue is None and transpose and dtype == torch.float32 and device.type == "cuda":
        issue = ("fp32 input with transpose=True on CUDA: the Triton kernel wrote wrong transposed bytes "
                 "for a 4096x4096 fp32 input on an H200 (Triton 3.6), so the torch path runs")
    return issue


def _quantize_torch(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool, with_amax: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    x2 = rows_2d(x)  # [rows, cols]
    data = fp8_cast(x2, scale, fp8_dtype).contiguous()  # elementwise ops keep x's strides
    data_t = data.t().contiguous() if transpose else None  # [cols, rows]
    return as_shape(data, x.shape), data_t, abs_max(x) if with_amax else None
