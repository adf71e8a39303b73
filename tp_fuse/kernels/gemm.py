"""FP8 GEMM with a fused dequantization / bias / GELU epilogue.

``fp8_gemm`` computes ``a @ b.T`` for FP8 operands in the layout every Linear uses
(``a`` = activations ``[tokens, in]``, ``b`` = weight ``[out, in]``, both K-major), and
applies the epilogue that otherwise costs extra passes over the output:

    pre = (a.float() @ b.float().T) * scale_a * scale_b (+ bias)      fp32 accumulate
    out = pre                          rounded to out_dtype           (gelu=False)
    out = gelu(pre rounded to out_dtype), pre_gelu_out = that rounded pre  (gelu=True)

GELU is applied to the *stored* pre-activation so that the backward pass, which reads
``pre_gelu_out``, differentiates exactly the function the forward applied.
"""

from __future__ import annotations

from typing import Optional

import torch

from tp_fuse.strict import strict_cuda_enabled

from . import dispatch
from ._common import (
    FP8_MAX,
    TORCH_FLOAT_DTYPES,
    check_scale,
    check_vector,
    compute_dtype,
    gelu_torch,
    triton_dtype_issue,
)
from .cuda_rules import cuda_epilogue, cuda_semantics, scaled_mm
from .fp8_emulation import accumulation_dtype, cpu_fp8_gemm_path, emulated_mm_decoded, emulation_units

__all__ = ["fp8_gemm", "fp8_gemm_checked", "fp8_gemm_emulated", "fp8_gemm_reads_views"]


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Optional[torch.Tensor] = None,
    gelu: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``out = epilogue(a @ b.T)`` for FP8 ``a``, ``b`` (see module doc).

    Shapes::

        a        [M, K]  float8_e4m3fn or float8_e5m2 (any pair of the two)
        b        [N, K]  float8_e4m3fn or float8_e5m2
        scale_a  []      fp32 dequantization scale of a (scale_inv: real = fp8 * scale_a)
        scale_b  []      fp32 dequantization scale of b
        bias     [N]     optional, any float dtype, added in fp32
        out      [M, N]  out_dtype (fp32 / bf16 / fp16; float64 on the torch path)
        pre_gelu_out [M, N]  out_dtype when gelu=True, else None

    The torch backend is ``torch._scaled_mm`` (on CPU its exact emulation, see
    ``fp8_emulation``; on CUDA cuBLASLt requires
    K and N multiples of 16, fuses a bias only for 16-bit outputs, in the output
    dtype: there the bias is rounded to out_dtype first, and for fp32 outputs it is
    added after the GEMM; it has no float64 output, so a float64 result is the fp32
    GEMM widened) followed by the GELU. It is the auto choice on CUDA too (see
    ``dispatch.select_fp8_gemm_backend``). With ``TP_FUSE_STRICT_CUDA=1`` the CUDA
    branches run on every device and the ``_scaled_mm`` call is checked against CUDA's
    rules (``cuda_rules``): then ``a`` and ``b`` must arrive K-major (contiguous), as
    on a GPU any other layout is a hidden transpose copy of FP8 data on every call. The
    Triton backend is a tiled kernel: TMA tensor-descriptor loads on Hopper when the
    installed triton has them, pointer loads otherwise; ``record_kernel_paths`` shows
    which ("tma" / "pointer[...reason...]").

    Returns ``(out, pre_gelu_out)``.
    """
    _check_fp8_gemm_args(a, b, scale_a, scale_b, out_dtype, bias)
    return fp8_gemm_checked(a, b, scale_a, scale_b, out_dtype, bias=bias, gelu=gelu, backend=backend)


def _check_fp8_gemm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FP8_MAX or t.dim() != 2:
            got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 2-D float8_e4m3fn/float8_e5m2 tensor, got {got}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: expected [N, K] with K = a.shape[1] = {a.shape[1]}, got shape {tuple(b.shape)}")
    if b.device != a.device:
        raise ValueError(f"b: expected a tensor on {a.device}, got one on {b.device}")
    check_scale("scale_a", scale_a, a.device)
    check_scale("scale_b", scale_b, a.device)
    if out_dtype not in TORCH_FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {TORCH_FLOAT_DTYPES}, got {out_dtype}")
    if bias is not None:
        check_vector("bias", bias, b.shape[0], a.device)


def fp8_gemm_checked(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Optional[torch.Tensor] = None,
    gelu: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`fp8_gemm` for callers that have validated its arguments already (the
    Float8Tensor GEMM, whose operands are FP8 bytes with 0-d fp32 scales by
    construction): the same dispatch, kernels and logging, without checking twice on
    the hot path."""
    dtype_issue = triton_dtype_issue(out_dtype, None if bias is None else bias.dtype)
    choice = dispatch.select_fp8_gemm_backend(a.device, backend, triton_unsupported=dtype_issue)
    if not choice.runnable:
        raise RuntimeError(f"fp8_gemm: {choice.reason}")
    if choice.backend == "torch":
        cpu_path = cpu_fp8_gemm_path() if a.device.type == "cpu" else None  # one environment read per call
        units = None
        if cpu_path == "emulate":
            units = emulation_units(a.shape[0], b.shape[0], a.shape[1], accumulation_dtype(out_dtype), a, b)
        out, pre = _fp8_gemm_torch(a, b, scale_a, scale_b, out_dtype, bias, gelu, cpu_path, units)
        variant = emulation_variant(units) if cpu_path == "emulate" else "scaled_mm"
    else:
        from . import gemm_triton

        out, pre, variant = gemm_triton.fp8_gemm_triton(a, b, scale_a, scale_b, out_dtype, bias, gelu)
    dispatch.log_call("fp8_gemm", choice, variant, a.device)
    return out, pre


def fp8_gemm_emulated(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`fp8_gemm`'s CPU emulation (``fp8_gemm_reads_views``) for callers holding the
    operands decoded (``fp8_emulation.decode_operand``; ``a [M, K]``, ``b [N, K]``, any
    layout, in ``accumulation_dtype(out_dtype)``): the Float8Tensor GEMM, which decodes a
    weight once for its fprop and dgrad GEMMs. Same result and kernel log as
    :func:`fp8_gemm` with the FP8 operands (variant ``cpu-emulation`` or
    ``cpu-emulation-amx-bf16``), no GELU epilogue."""
    units = emulation_units(a.shape[0], b.shape[0], a.shape[1], a.dtype, a, b)
    out = emulated_mm_decoded(a, b.t(), scale_a, scale_b, out_dtype, bias, units=units)
    if dispatch.logging_active():
        dispatch.log_call("fp8_gemm", dispatch.select_fp8_gemm_backend(a.device), emulation_variant(units), a.device)
    return out


def emulation_variant(units: str) -> str:
    """The kernel-log variant of the CPU emulation on ``units`` (``emulation_units``)."""
    return "cpu-emulation" if units == "fp32" else "cpu-emulation-" + units


def fp8_gemm_reads_views(device: torch.device) -> bool:
    """Whether :func:`fp8_gemm` on ``device`` reads transposed operands (column-major
    views of row-major FP8 bytes) as fast as K-major ones: the CPU emulation, outside
    strict-CUDA mode. Callers then pass ``t()`` views where a GPU needs transposed FP8
    bytes (``Float8Tensor.transpose_fp8``), and the quantizers need not write them."""
    return device.type == "cpu" and not strict_cuda_enabled() and cpu_fp8_gemm_path() == "emulate"


def _fp8_gemm_torch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    gelu: bool,
    cpu_path: Optional[str] = None,
    cpu_units: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # _scaled_mm wants a row-major and the second operand column-major: b [N, K]
    # row-major viewed as b.T [K, N] is exactly that.
    # CPU's _scaled_mm adds a bias of any dtype in its fp32 epilogue and writes float64;
    # cuBLASLt fuses a bias only for 16-bit outputs and in the output dtype (fp32 outputs
    # add it after) and writes no float64 (fp32 GEMM, then widened).
    cuda = cuda_semantics(a.device)
    gemm_dtype, fused_bias = cuda_epilogue(out_dtype, bias is not None) if cuda else (out_dtype, bias is not None)
    if cpu_path != "emulate" and not strict_cuda_enabled():
        # Make the operands K-major as the GEMM wants (a copy if they are not). Strict mode
        # skips this so that its layout check sees what callers pass: a transposed FP8 view
        # here costs a full transpose copy on every call on a GPU. The CPU emulation reads
        # any layout (its decode keeps the operand's strides; torch.mm takes either).
        a, b = a.contiguous(), b.contiguous()
    pre = scaled_mm(
        a,
        b.t(),
        scale_a if scale_a.dim() == 0 else scale_a.reshape(()),
        scale_b if scale_b.dim() == 0 else scale_b.reshape(()),
        gemm_dtype,
        bias=(bias if not cuda else bias.to(out_dtype)) if fused_bias else None,
        cpu_path=cpu_path,
        cpu_units=cpu_units,
    )
    if gemm_dtype != out_dtype:
        pre = pre.to(out_dtype)
    if bias is not None and not fused_bias:
        pre = pre + bias.to(out_dtype)
    if not gelu:
        return pre, None
    return gelu_torch(pre.to(compute_dtype(out_dtype))).to(out_dtype), pre
