"""CUDA's ``torch._scaled_mm`` rules, checked on any device: the GEMM half of
``TP_FUSE_STRICT_CUDA=1`` (the collective half is :mod:`tp_fuse.comm.nccl_rules`).

On CPU, torch 2.13's ``_scaled_mm`` takes any shapes, layouts, bias dtype and output
dtype. On CUDA (``aten/src/ATen/native/cuda/ScaledBlas.cpp``, ``_scaled_mm_out_cuda``
and the row-wise CUTLASS kernel's ``check_inputs`` in ``RowwiseScaledMM.cu``) it
rejects, for ``out = mat1 [M, K] @ mat2 [K, N]``:

* operands: 2-D float8 (``float8_e4m3fn`` / ``float8_e5m2``); not both e5m2
  (cuBLASLt has no e5m2 x e5m2 kernel).
* sizes: ``K % 16 == 0`` and ``N % 16 == 0`` (``mat1.size(1)``, ``mat2.size(0)``,
  ``mat2.size(1)``); M is free.
* layout (the strictest GPU, Hopper sm_90: "Only multiplication of row-major and
  column-major matrices is supported by cuBLASLt"): mat1 row-major
  (``stride(1) == 1``, ``stride(0) >= K``), mat2 column-major (``stride(0) == 1``,
  ``stride(1) >= K``): both operands K-major. A transposed FP8 view cannot be fed to
  the GEMM; the transpose has to exist as its own bytes (``Float8Tensor.transpose_fp8``).
* scales, tensor-wise: both fp32 with one element. Row-wise: ``scale_a`` fp32
  ``[M, 1]``, ``scale_b`` fp32 ``[1, N]``, both contiguous; and (CUTLASS row-wise
  kernel, used before cuBLAS 12.9 and on sm_89) mat2 must be e4m3.
* output: bf16, fp16 or fp32 (no float64).
* bias: ``N`` elements, bf16 or fp16, not with an fp32 output; bf16 for a bf16 output,
  fp16 for an fp16 output.

``scaled_mm`` is the one place tp_fuse calls ``torch._scaled_mm``: in strict mode it
checks these rules first and raises :class:`~tp_fuse.strict.CudaConformanceError`
naming every broken rule. On CPU it runs the exact emulation of :mod:`.fp8_emulation`
(strict mode included: the rules are checked, then the CPU computes) unless
``TP_FUSE_CPU_FP8_GEMM=scaled_mm`` asks for torch's CPU kernel. ``cuda_semantics(device)`` tells the callers to take their
CUDA branches (e.g. bias handling) also on CPU in strict mode, so that those branches are
what the checks see.
"""

from __future__ import annotations

from typing import Optional

import torch

from tp_fuse.strict import STRICT_ENV, CudaConformanceError, strict_cuda_enabled

from .fp8_emulation import cpu_fp8_gemm_path, emulated_scaled_mm
from .launch_count import one_launch

__all__ = ["SCALED_MM_OUT_DTYPES", "check_scaled_mm", "cuda_epilogue", "cuda_semantics", "scaled_mm", "scaled_mm_violations"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Output dtypes CUDA's ``_scaled_mm`` writes (besides float8 outputs, which tp_fuse does not use).
SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cuda_semantics(device: torch.device) -> bool:
    """Whether code on ``device`` must follow CUDA's rules: on CUDA, or in strict mode."""
    return device.type == "cuda" or strict_cuda_enabled()


def cuda_epilogue(out_dtype: torch.dtype, has_bias: bool) -> tuple[torch.dtype, bool]:
    """``(the GEMM's output dtype, whether the bias fuses)`` of CUDA's ``_scaled_mm`` for a
    result in ``out_dtype``: cuBLASLt writes no float64 (the fp32 GEMM, then widened) and
    fuses a bias only for 16-bit outputs, in the output dtype (fp32 outputs add it after)."""
    gemm_dtype = torch.float32 if out_dtype == torch.float64 else out_dtype
    return gemm_dtype, has_bias and out_dtype in (torch.bfloat16, torch.float16)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0])


def _scale_kind(scale: torch.Tensor, rows: int, row_major_shape: bool) -> Optional[str]:
    """"tensorwise", "rowwise" or None for a scale of an operand with ``rows`` outer rows."""
    if scale.dtype != torch.float32:
        return None
    if scale.numel() == 1:
        return "tensorwise"
    want = (rows, 1) if row_major_shape else (1, rows)
    if tuple(scale.shape) == want and scale.is_contiguous():
        return "rowwise"
    return None


def scaled_mm_violations(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> list[str]:
    """Every CUDA ``_scaled_mm`` rule the call ``_scaled_mm(mat1, mat2, ...)`` breaks (see
    module doc); an empty list means CUDA accepts it."""
    issues: list[str] = []
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        if t.dim() != 2 or t.dtype not in _FP8:
            issues.append(f"{name}: needs a 2-D float8_e4m3fn/float8_e5m2 matrix, got {t.dtype} {tuple(t.shape)}")
    if issues:
        return issues
    (m, k), (k2, n) = mat1.shape, mat2.shape
    if k != k2:
        issues.append(f"shapes cannot be multiplied: mat1 {tuple(mat1.shape)}, mat2 {tuple(mat2.shape)}")
    if mat1.dtype == torch.float8_e5m2 and mat2.dtype == torch.float8_e5m2:
        issues.append("e5m2 x e5m2: cuBLASLt has no kernel for two float8_e5m2 operands")
    if k % 16 or n % 16:
        issues.append(f"sizes: K ({k}) and N ({n}) must be multiples of 16 (M = {m} is free)")
    if not _row_major(mat1):
        issues.append(f"layout: mat1 {tuple(mat1.shape)} must be row-major (K-major), got strides {mat1.stride()}")
    if not _col_major(mat2):
        issues.append(
            f"layout: mat2 {tuple(mat2.shape)} must be column-major (K-major; Hopper takes no transposed "
            f"FP8 operand), got strides {mat2.stride()}"
        )
    kind_a = _scale_kind(scale_a, m, True)
    kind_b = _scale_kind(scale_b, n, False)
    if kind_a is None or kind_a != kind_b:
        issues.append(
            f"scales: need both tensor-wise (fp32, one element) or both row-wise (fp32 [{m}, 1] and "
            f"[1, {n}], contiguous), got scale_a {scale_a.dtype} {tuple(scale_a.shape)}, "
            f"scale_b {scale_b.dtype} {tuple(scale_b.shape)}"
        )
    elif kind_a == "rowwise" and mat2.dtype != torch.float8_e4m3fn:
        issues.append(f"row-wise scaling: mat2 must be float8_e4m3fn (CUTLASS row-wise kernel), got {mat2.dtype}")
    if out_dtype not in SCALED_MM_OUT_DTYPES:
        issues.append(f"out_dtype: must be one of {SCALED_MM_OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        if bias.numel() != n:
            issues.append(f"bias: must have N = {n} elements, got {bias.numel()}")
        if out_dtype == torch.float32:
            issues.append("bias: not supported with an fp32 output (add it after the GEMM)")
        elif bias.dtype not in (torch.bfloat16, torch.float16):
            issues.append(f"bias: must be bf16 or fp16, got {bias.dtype}")
        elif out_dtype in (torch.bfloat16, torch.float16) and bias.dtype != out_dtype:
            issues.append(f"bias: must be {out_dtype} for a {out_dtype} output, got {bias.dtype}")
    devices = {t.device for t in (mat1, mat2, scale_a, scale_b) + ((bias,) if bias is not None else ())}
    if len(devices) > 1:
        issues.append(f"devices: all tensors must be on one device, got {sorted(map(str, devices))}")
    return issues


def check_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> None:
    """Raise :class:`~tp_fuse.strict.CudaConformanceError` naming every CUDA ``_scaled_mm``
    rule the call breaks (:func:`scaled_mm_violations`); the FP8 GEMM's plan calls it once
    per signature in strict mode."""
    issues = scaled_mm_violations(mat1, mat2, scale_a, scale_b, out_dtype, bias)
    if issues:
        raise CudaConformanceError(f"{STRICT_ENV}=1: CUDA's torch._scaled_mm would reject this call: "
                                   + "; ".join(issues))


def scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    *,
    cpu_path: Optional[str] = None,
    cpu_units: Optional[str] = None,
    checked: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm(mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype)``,
    after checking CUDA's rules in strict mode (``TP_FUSE_STRICT_CUDA=1``) unless the caller
    has (``checked``: the FP8 GEMM's plan checks a signature once); on CPU the exact
    emulation (``fp8_emulation.emulated_scaled_mm``) unless ``TP_FUSE_CPU_FP8_GEMM=scaled_mm``,
    which then writes a float64 output as the fp32 GEMM widened (oneDNN's CPU kernel refuses
    float64). ``cpu_path``: that setting when the caller holds it (``cpu_fp8_gemm_path()``);
    ``cpu_units``: the emulation's GEMM units (``fp8_emulation.emulation_units``)
    when the caller has chosen them.

    Shapes: ``mat1 [M, K]`` row-major, ``mat2 [K, N]`` column-major, ``out [M, N]``.
    """
    if not checked and strict_cuda_enabled():
        check_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype, bias)
    if mat1.device.type == "cpu":
        if (cpu_path or cpu_fp8_gemm_path()) == "emulate":
            # Counted as the one cuBLASLt launch it stands for (launch_count).
            with one_launch("cuda._scaled_mm"):
                return emulated_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype, bias, units=cpu_units)
        if out_dtype == torch.float64:
            out = torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=torch.float32)
            return out.to(torch.float64)
    return torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
