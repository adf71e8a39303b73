"""The FP8 GEMM, with a fused dequantization / bias / GELU epilogue, planned once per signature.

``fp8_gemm`` computes ``a @ b.T`` for FP8 operands in the layout every Linear uses
(``a`` = activations ``[tokens, in]``, ``b`` = weight ``[out, in]``, both K-major), and
applies the epilogue that otherwise costs extra passes over the output:

    pre = (a.float() @ b.float().T) * scale_a * scale_b (+ bias)      fp32 accumulate
    out = pre                          rounded to out_dtype           (gelu=False)
    out = gelu(pre rounded to out_dtype), pre_gelu_out = that rounded pre  (gelu=True)

GELU is applied to the *stored* pre-activation so that the backward pass, which reads
``pre_gelu_out``, differentiates exactly the function the forward applied.

**One plan per signature.** The argument checks, the backend choice, the CPU path, the
emulation's units where the shape decides them, the CUDA epilogue's form and (strict-CUDA
mode) the ``_scaled_mm`` conformance check depend only on the operands' shapes, strides,
dtypes and devices, the output dtype, the bias's signature, ``gelu``, ``backend`` and the
settings snapshot (:mod:`tp_fuse.settings`). They are decided by the first call with a new
signature -- which raises exactly as a check per call would -- and kept in an
:class:`Fp8GemmPlan`; later calls look the plan up and run it. A failing signature is not
kept, so every call with it raises. ``tp_fuse.quantization.fp8_gemm`` (quantized tensors,
transposed operands, decoded CPU operands) runs the same plans.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from tp_fuse import settings
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
from .cuda_rules import check_scaled_mm, cuda_epilogue, cuda_semantics, scaled_mm
from .fp8_emulation import (
    accumulation_dtype,
    cpu_fp8_gemm_path,
    emulated_mm_decoded,
    live_units,
    static_units,
)

__all__ = ["Fp8GemmPlan", "fp8_gemm", "fp8_gemm_plan", "fp8_gemm_reads_views", "remember_plan"]

# signature -> plan. Bounded: a run with ever new shapes (variable sequence lengths without
# padding) starts over rather than growing without end.
_PLANS: dict[tuple, "Fp8GemmPlan"] = {}
_MAX_PLANS = 4096


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
    return fp8_gemm_plan(a, b, scale_a, scale_b, out_dtype, bias, gelu, backend).run(a, b, scale_a, scale_b, bias)


def fp8_gemm_plan(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    gelu: bool = False,
    backend: Optional[str] = None,
) -> "Fp8GemmPlan":
    """The plan :func:`fp8_gemm` runs for these arguments: looked up, or made (and checked)
    by the first call with their signature (module doc)."""
    try:
        key = (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device,
               scale_a.shape, scale_a.dtype, scale_a.device, scale_b.shape, scale_b.dtype, scale_b.device,
               None if bias is None else (bias.shape, bias.dtype, bias.device),
               out_dtype, gelu, backend, settings.current())
    except (AttributeError, TypeError):  # not tensors: the checks below name the argument
        key = None
    plan = _PLANS.get(key)
    if plan is None:
        plan = Fp8GemmPlan(a, b, scale_a, scale_b, out_dtype, bias, gelu, backend)
        remember_plan(_PLANS, key, plan)
    return plan


def remember_plan(plans: dict, key: Optional[tuple], plan: object) -> None:
    """Keep ``plan`` for ``key`` (``None``: arguments that are not tensors, never kept) in a
    signature cache bounded at ``_MAX_PLANS``: a run with ever new shapes (variable sequence
    lengths without padding) starts over rather than growing without end."""
    if key is None:
        return
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan


class Fp8GemmPlan:
    """What one FP8 GEMM signature runs, decided once: made from a first call's arguments,
    whose checks it runs (``ValueError`` / ``RuntimeError`` / ``CudaConformanceError`` as a
    per-call check would raise), then :meth:`run` for every call with that signature.

    ``reads_views``: the GEMM is the CPU emulation outside strict mode, which reads any
    operand layout and also takes decoded operands (:meth:`run_decoded`).
    """

    __slots__ = ("choice", "out_dtype", "acc_dtype", "gelu", "cpu_path", "units", "variant", "gemm_dtype",
                 "fused_bias", "bias_to_out", "contiguous", "reads_views", "triton")

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        out_dtype: torch.dtype,
        bias: Optional[torch.Tensor],
        gelu: bool,
        backend: Optional[str],
    ) -> None:
        _check_fp8_gemm_args(a, b, scale_a, scale_b, out_dtype, bias)
        dtype_issue = triton_dtype_issue(out_dtype, None if bias is None else bias.dtype)
        choice = dispatch.select_fp8_gemm_backend(a.device, backend, triton_unsupported=dtype_issue)
        if not choice.runnable:
            raise RuntimeError(f"fp8_gemm: {choice.reason}")
        self.choice, self.out_dtype, self.gelu = choice, out_dtype, gelu
        self.acc_dtype = accumulation_dtype(out_dtype)  # of the CPU emulation (run_decoded's operands)
        self.cpu_path = cpu_fp8_gemm_path() if a.device.type == "cpu" else None
        strict = strict_cuda_enabled()
        self.reads_views = self.cpu_path == "emulate" and not strict and choice.backend == "torch"
        self.triton: Optional[Callable[..., Any]] = None
        self.units: Optional[str] = None
        self.variant: Optional[str] = "scaled_mm"
        if choice.backend == "triton":
            from . import gemm_triton  # Triton is imported only where its kernel runs

            self.triton = gemm_triton.fp8_gemm_triton
            return
        # CPU's _scaled_mm adds a bias of any dtype in its fp32 epilogue and writes float64;
        # cuBLASLt fuses a bias only for 16-bit outputs and in the output dtype (fp32 outputs
        # add it after) and writes no float64 (fp32 GEMM, then widened).
        cuda = cuda_semantics(a.device)
        self.gemm_dtype, self.fused_bias = (cuda_epilogue(out_dtype, bias is not None) if cuda
                                            else (out_dtype, bias is not None))
        self.bias_to_out = cuda
        # Make the operands K-major as the GEMM wants (a copy if they are not). Strict mode
        # skips this so that its layout check sees what callers pass: a transposed FP8 view
        # here costs a full transpose copy on every call on a GPU. The CPU emulation reads
        # any layout (its decode keeps the operand's strides; torch.mm takes either).
        self.contiguous = self.cpu_path != "emulate" and not strict
        if self.cpu_path == "emulate":
            self.units = static_units(a.shape[0], b.shape[0], a.shape[1], self.acc_dtype)
            self.variant = None if self.units is None else emulation_variant(self.units)
        if strict:
            gemm_bias = None if bias is None or not self.fused_bias else (
                bias.to(out_dtype) if self.bias_to_out else bias)
            check_scaled_mm(a, b.t(), scale_a if scale_a.dim() == 0 else scale_a.reshape(()),
                            scale_b if scale_b.dim() == 0 else scale_b.reshape(()), self.gemm_dtype, gemm_bias)

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        bias: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(out, pre_gelu_out)`` of FP8 ``a [M, K]``, ``b [N, K]`` of this signature."""
        if self.triton is not None:
            out, pre, variant = self.triton(a, b, scale_a, scale_b, self.out_dtype, bias, self.gelu)
            dispatch.log_call("fp8_gemm", self.choice, variant, a.device)
            return out, pre
        units = self.units
        if units is None and self.cpu_path == "emulate":
            units = live_units(a, b)
        if self.contiguous:
            a, b = a.contiguous(), b.contiguous()
        out_dtype = self.out_dtype
        # (written out rather than helpers: this runs per GEMM, and every Python call is host time)
        gemm_bias = None if bias is None or not self.fused_bias else (bias.to(out_dtype) if self.bias_to_out else bias)
        pre = scaled_mm(a, b.t(), scale_a if scale_a.dim() == 0 else scale_a.reshape(()),
                        scale_b if scale_b.dim() == 0 else scale_b.reshape(()), self.gemm_dtype, bias=gemm_bias,
                        cpu_path=self.cpu_path, cpu_units=units, checked=True)
        if self.gemm_dtype != out_dtype:
            pre = pre.to(out_dtype)
        if bias is not None and not self.fused_bias:
            pre = pre + bias.to(out_dtype)
        dispatch.log_call("fp8_gemm", self.choice, self.variant or emulation_variant(units), a.device)
        if not self.gelu:
            return pre, None
        return gelu_torch(pre.to(compute_dtype(out_dtype))).to(out_dtype), pre

    def run_decoded(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """:meth:`run` (no GELU) for a :attr:`reads_views` plan, with the operands already
        decoded (``fp8_emulation.decode_operand``: ``a [M, K]``, ``b [N, K]``, any layout, in
        ``accumulation_dtype(out_dtype)``): a weight decoded once serves its fprop and dgrad
        GEMMs. The same result and kernel log as :meth:`run` with the FP8 bytes."""
        units = self.units if self.units is not None else live_units(a, b)
        out = emulated_mm_decoded(a, b.t(), scale_a, scale_b, self.out_dtype, bias, units=units)
        dispatch.log_call("fp8_gemm", self.choice, self.variant or emulation_variant(units), a.device)
        return out


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


def emulation_variant(units: str) -> str:
    """The kernel-log variant of the CPU emulation on ``units`` (``emulation_units``)."""
    return "cpu-emulation" if units == "fp32" else "cpu-emulation-" + units


def fp8_gemm_reads_views(device: torch.device) -> bool:
    """Whether :func:`fp8_gemm` on ``device`` reads transposed operands (column-major
    views of row-major FP8 bytes) as fast as K-major ones: the CPU emulation, outside
    strict-CUDA mode. Callers then pass ``t()`` views where a GPU needs transposed FP8
    bytes (``Float8Tensor.transpose_fp8``), and the quantizers need not write them."""
    return device.type == "cpu" and not strict_cuda_enabled() and cpu_fp8_gemm_path() == "emulate"
