"""Triton FP8 GEMM ``a [M, K] @ b[N, K].T`` with a scale/bias/GELU epilogue.

Semantics are documented in ``gemm.fp8_gemm``. Two kernels share the MMA step and the
epilogue and differ only in how tiles reach shared memory:

* pointer: ``tl.load`` of masked pointer tiles (any strides, any K; Ampera-style
  ``cp.async`` on GPUs);
* tma: Hopper's Tensor Memory Accelerator via host-built tensor descriptors
  (``triton.tools.tensor_descriptor.TensorDescriptor``, passed by value as kernel
  arguments). One thread issues each bulk copy, out-of-bounds boxes are zero-filled by
  the hardware (no masks), and address arithmetic leaves the registers (PyTorch blog
  "Deep Dive on the Hopper TMA Unit for FP8 GEMMs"). Needs sm_90+, 16-byte aligned
  bases and row strides (K % 16 == 0 for FP8) and a contiguous last dim.
  Host-built rather than ``tl.make_tensor_descriptor`` (device-built) because the
  latter needs a process-global ``triton.set_allocator`` for its scratch memory. The
  older ``tl._experimental_descriptor_load`` API (descriptors copied to the device by
  extra H2D kernels, the launch overhead the blog measures) is not used: with a triton
  that lacks TensorDescriptor this module takes the pointer path, and the recorded
  variant says why.

Accumulation: on sm_90, fp8 ``tl.dot`` accumulates in a reduced-precision register by
default (``max_num_imprecise_acc = 2**30``); we pass ``max_num_imprecise_acc=BLOCK_K`` so
that partial sums are promoted to fp32 after every K tile, like cuBLAS's default
(``torch._scaled_mm(use_fast_accum=False)``).

With emulated conversions (interpreter, or GPUs without FP8 MMA) the FP8 bytes are
decoded exactly in integer arithmetic and multiplied as fp16 (every e4m3/e5m2 value is
an fp16 value), since the interpreter's own fp8 decode is wrong for e5m2 subnormals and
NaN/inf (see ``_triton_common``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._triton_common import INTERPRETED, emulate_conversions, fp8_bits_to_fp32, gelu_parts, round_to
from .dispatch import cuda_capability

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # triton from before the tensor-descriptor API
    TensorDescriptor = None


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles sweep the N tiles together (L2 reuse of b)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, EMULATE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a [BM, BK] @ b [BN, BK].T, fp32 accumulate."""
    if EMULATE:
        a16 = fp8_bits_to_fp32(a.to(tl.uint8, bitcast=True), A_E4M3).to(tl.float16)
        b16 = fp8_bits_to_fp32(b.to(tl.uint8, bitcast=True), B_E4M3).to(tl.float16)
        return tl.dot(a16, tl.trans(b16), acc)
    else:
        return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def _epilogue(
    acc, offs_m, offs_n, M, N, out_ptr, pre_ptr, stride_om, stride_on, bias_ptr, sa_ptr, sb_ptr,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EMULATE: tl.constexpr,
):
    pre = acc * tl.load(sa_ptr) * tl.load(sb_ptr)  # same order as torch._scaled_mm on CPU
    if HAS_BIAS:
        pre = pre + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    pre_out = round_to(pre, out_ptr.dtype.element_ty, EMULATE)
    if GELU:
        tl.store(pre_ptr + offs, pre_out, mask=mask)
        p = pre_out.to(tl.float32)
        s, _ = gelu_parts(p)
        tl.store(out_ptr + offs, round_to(p * s, out_ptr.dtype.element_ty, EMULATE), mask=mask)
    else:
        tl.store(out_ptr + offs, pre_out, mask=mask)


@triton.jit
def _fp8_gemm_ptr_kernel(
    a_ptr, b_ptr, out_ptr, pre_ptr, bias_ptr, sa_ptr, sb_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k[None, :] < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok, other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[:, None] < N) & k_ok, other=0.0)
        acc = _mma(a, b, acc, A_E4M3, B_E4M3, EMULATE, BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _epilogue(acc, offs_m, offs_n, M, N, out_ptr, pre_ptr, stride_om, stride_on, bias_ptr, sa_ptr, sb_ptr,
              HAS_BIAS, GELU, EMULATE)


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, b_desc, out_ptr, pre_ptr, bias_ptr, sa_ptr, sb_ptr, M, N, K, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
    EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, k0 * BLOCK_K])  # [BM, BK], zero-filled past M/K
        b = b_desc.load([pid_n * BLOCK_N, k0 * BLOCK_K])  # [BN, BK]
        acc = _mma(a, b, acc, A_E4M3, B_E4M3, EMULATE, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _epilogue(acc, offs_m, offs_n, M, N, out_ptr, pre_ptr, stride_om, stride_on, bias_ptr, sa_ptr, sb_ptr,
              HAS_BIAS, GELU, EMULATE)


# GPU tile configurations, autotuned per (M, N, K): small-M (decode / small batches)
# tiles first, then the large square and wide tiles that saturate Hopper tensor cores.
_GPU_CONFIGS = [
    (64, 64, 128, 8, 5, 4),
    (64, 128, 128, 8, 4, 4),
    (128, 64, 128, 8, 4, 4),
    (128, 128, 128, 8, 4, 8),
    (128, 256, 128, 8, 3, 8),
]
# In the interpreter every program is a Python loop iteration: tiny tiles make the test
# shapes multi-tile in M, N and K.
_INTERPRETER_META = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2)


def _set_tma_block_shapes(nargs: dict) -> None:
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


_tuned: dict[str, object] = {}


def _autotuned(kind: str):
    """Autotuned wrapper of the pointer or TMA kernel (built on first GPU use)."""
    if kind not in _tuned:
        hook = _set_tma_block_shapes if kind == "tma" else None
        configs = [
            triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g), num_stages=s, num_warps=w, pre_hook=hook)
            for bm, bn, bk, g, s, w in _GPU_CONFIGS
        ]
        kernel = _fp8_gemm_tma_kernel if kind == "tma" else _fp8_gemm_ptr_kernel
        _tuned[kind] = triton.autotune(configs, key=["M", "N", "K"])(kernel)
    return _tuned[kind]


def tma_unsupported(a: torch.Tensor, b: torch.Tensor, *, check_device: bool = True) -> Optional[str]:
    """Why the TMA kernel cannot run these operands, or None when it can."""
    if TensorDescriptor is None:
        return "installed triton has no TensorDescriptor"
    if check_device:
        if a.device.type != "cuda" or INTERPRETED:
            return "not a CUDA device"
        if cuda_capability(a.device) < (9, 0):  # cached per device: no query per GEMM
            return "TMA needs sm_90+"
        if emulate_conversions(a.device):
            return "emulated conversions"
    for name, t in (("a", a), ("b", b)):
        if t.shape[0] == 0 or t.shape[1] == 0:
            return f"{name} is empty"
        if t.stride(1) != 1 or t.stride(0) % 16 != 0:
            return f"{name} rows not contiguous and 16-byte aligned (strides {t.stride()})"
        if t.data_ptr() % 16 != 0:
            return f"{name} base not 16-byte aligned"
    return None


def fp8_gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    gelu: bool,
    *,
    tma: Optional[bool] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], str]:
    """Returns ``(out, pre_gelu_out | None, variant)``; arguments validated by caller.

    ``tma``: None picks TMA when ``tma_unsupported`` allows; True forces it (ValueError
    when the operands do not allow it; the device check is skipped so that tests can run
    the TMA kernel in the interpreter); False forces the pointer kernel.
    """
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    pre = torch.empty((M, N), dtype=out_dtype, device=a.device) if gelu else None
    if tma is None:
        why_not = tma_unsupported(a, b)
        use_tma = why_not is None
    elif tma:
        why_not = tma_unsupported(a, b, check_device=False)
        if why_not is not None:
            raise ValueError(f"a/b: TMA kernel requested but {why_not}")
        use_tma = True
    else:
        why_not, use_tma = "pointer kernel requested", False
    emulated = emulate_conversions(a.device)
    name = "tma" if use_tma else f"pointer[no TMA: {why_not}]"
    name += "+emulated-casts" if emulated else ""
    if M == 0 or N == 0:
        return out, pre, name
    flags = dict(
        HAS_BIAS=bias is not None,
        GELU=gelu,
        A_E4M3=a.dtype == torch.float8_e4m3fn,
        B_E4M3=b.dtype == torch.float8_e4m3fn,
        EMULATE=emulated,
    )
    common = (out, pre if gelu else out, bias if bias is not None else scale_a, scale_a, scale_b, M, N, K)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    if use_tma:
        if INTERPRETED:
            block_m, block_n, block_k = (_INTERPRETER_META[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        else:  # placeholders: the autotuner's pre-hook sets the block shapes per config
            block_m, block_n, block_k = _GPU_CONFIGS[0][:3]
        a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
        b_desc = TensorDescriptor.from_tensor(b, [block_n, block_k])
        args = (a_desc, b_desc, *common, out.stride(0), out.stride(1))
        kernel = _fp8_gemm_tma_kernel if INTERPRETED else _autotuned("tma")
    else:
        args = (a, b, *common, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1))
        kernel = _fp8_gemm_ptr_kernel if INTERPRETED else _autotuned("pointer")
    if INTERPRETED:
        kernel[grid](*args, **flags, **_INTERPRETER_META)
    else:
        kernel[grid](*args, **flags)
    return out, pre, name
