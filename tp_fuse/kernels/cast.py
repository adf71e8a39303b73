"""FP8 quantization with a fused amax and an optional transposed copy.

``quantize`` is the cast every FP8 GEMM input goes through: one read of ``x`` produces
the FP8 bytes for the forward GEMM, the transposed FP8 bytes for the wgrad GEMM (which
contracts over the token dimension, so it wants tokens innermost), and ``max(|x|)`` for
the next scale update.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from ._common import abs_max, as_shape, check_float, check_fp8_dtype, check_scale, fp8_cast, rows_2d, triton_dtype_issue

__all__ = ["quantize"]


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool = False,
    backend: Optional[str] = None,
    with_amax: bool = True,
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
    """
    check_float("x", x)
    check_fp8_dtype("fp8_dtype", fp8_dtype)
    check_scale("scale", scale, x.device)
    choice = dispatch.select_backend("quantize", x.device, backend,
                                     triton_unsupported=triton_quantize_issue(x.dtype, x.device, transpose))
    if choice.backend == "torch":
        out = _quantize_torch(x, scale, fp8_dtype, transpose, with_amax)
        variant = "reference"
    else:
        from . import cast_triton

        *out, variant = cast_triton.quantize_triton(x, scale, fp8_dtype, transpose)
    dispatch.log_call("quantize", choice, variant, x.device)
    data, data_t, amax = out
    return data, data_t, amax if with_amax else None


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
