"""The CPU FP8 GEMM: an exact emulation of ``torch._scaled_mm`` that is fast on every CPU.

Why not ``torch._scaled_mm`` on CPU: its speed depends on which kernel the CPU gets.
torch 2.13 sends CPU ``_scaled_mm`` to oneDNN where oneDNN supports FP8 (Xeons with
AVX512-FP16 / AMX), and there ``e4m3 x e4m3`` and ``e5m2 x e5m2`` run a reference loop:
``[2048,128] x [512,128]`` takes ~2 s against ~1 ms for the fp32 GEMM, and a float64
output is refused. Elsewhere (or with oneDNN off) torch dequantizes with a slow scalar
cast and runs an fp32 GEMM (~2.4x fp32). ``examples/bench_cpu_fp8.py`` measures both.

The emulation is exact up to fp32 summation order, by construction:

* **decode**: an FP8 byte has 256 possible values, each exactly representable in fp32, so
  ``fp8_to_float`` reads them from a 256-entry table built with torch's own conversion
  (``index_select``: one vectorized gather, NaN/inf/subnormals included). This is the
  step that costs; it is 2-3x faster than ``tensor.float()`` for FP8 on CPU.
* **GEMM**: the product of two FP8 values has at most 2 x 4 significant bits, exact in
  fp32, so ``mm(decode(A), decode(B))`` is the FP8 GEMM with fp32 accumulation -- what
  cuBLASLt computes -- up to the order of the fp32 sums (fp64 accumulation for a float64
  output: more accurate, never less).
* **epilogue**: ``(acc * scale_a) * scale_b (+ bias in fp32)``, rounded once to the output
  dtype: the order of ``_scaled_mm``'s fused epilogue and of the Triton GEMM. Scales are
  tensor-wise (one element) or row-wise (``scale_a [M, 1]``, ``scale_b [1, N]``).

**The GEMM's units.** Every E4M3 and E5M2 value is also exact in bf16, and on a CPU with
AMX-BF16 oneDNN runs an fp32 GEMM on its bf16 units when asked
(``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``): the inputs are rounded to bf16
-- exact here -- and the products accumulate in fp32 into an fp32 output. So the GEMM of
decoded FP8 values runs there, 1.6x-3.7x faster than the fp32 GEMM from 2^22 multiply-adds
(``mm`` of decoded e4m3 values, median of 0.3 s, Xeon with AMX, torch 2.13: [2048,128] x
[128,512] 400 us vs 1369 us; [256,64] x [64,256] 31 us vs 50 us; [128,256] x [256,128]
with the first operand a transposed view, as in a wgrad GEMM, 32 us vs 49 us); at 2^21
they break even, below oneDNN's ~20 us per call costs more than it saves ([16,64] x
[64,256]: 23 us vs 7 us). The flag is process-wide, so it is set only around this one
``torch.mm`` (under a lock: two threads' set and restore never interleave) and only when
nothing else can run a matmul meanwhile: no other Python thread but those declared matmul-free
(:func:`declare_matmul_free_threads`: the launcher declares W&B's), no dispatch or
function mode (which could run Python inside the call), plain tensors, not while
compiling (the compiled graph runs the fp32 GEMM). ``TP_FUSE_CPU_FP8_GEMM_UNITS``:
``auto`` (that rule, the default), ``fp32`` (never the bf16 units) or ``bf16`` (whatever
threads are alive: the user vouches that none runs an fp32 matmul meanwhile). Both units
give fp32 accumulations of exact products: they differ by summation order only.

Choice (``TP_FUSE_CPU_FP8_GEMM``): ``emulate`` (default) or ``scaled_mm`` (torch's CPU
kernel, for comparison or a future CPU with native FP8 GEMMs). The rule: on every CPU
behaviour measured (oneDNN FP8 on an AVX512-FP16/AMX Xeon; torch's own fallback with
oneDNN off, the path of CPUs without oneDNN FP8), the emulation was at least as fast as
``_scaled_mm`` for every dtype pair and shape of the default GPT, and it is the same
code on every CPU. ``record_kernel_paths`` logs the variant that ran
(``cpu-emulation``, ``cpu-emulation-amx-bf16`` / ``scaled_mm``), ``explain`` shows the
choice.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Optional

import torch

from .. import settings
from ..settings import CPU_FP8_GEMM_ENV, CPU_FP8_GEMM_PATHS, CPU_FP8_GEMM_UNITS_ENV

__all__ = [
    "CPU_FP8_GEMM_ENV",
    "CPU_FP8_GEMM_PATHS",
    "CPU_FP8_GEMM_UNITS_ENV",
    "accumulation_dtype",
    "cpu_fp8_gemm_path",
    "cpu_has_amx_bf16",
    "declare_matmul_free_threads",
    "decode_operand",
    "emulated_mm_decoded",
    "emulated_scaled_mm",
    "emulation_units",
    "exact_values_mm",
    "live_units",
    "static_units",
    "fp8_to_float",
]

# Threads their starters declared matmul-free (weak: an ended thread drops out).
# Process-wide, as the flag it guards is.
_MATMUL_FREE_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
# Held while the flag is set (_mm).
_FLAG_LOCK = threading.Lock()
# From this many multiply-adds the bf16 units win in both operand layouts (module doc:
# 0.61x-0.64x the fp32 GEMM's time at 2^22, 0.89x-0.98x at 2^21).
_BF16_UNITS_MIN_MACS = 1 << 22
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Which decode is faster, by dtype and size (median of 2000, 2 threads, Xeon with
# AVX512-FP16/AMX, torch 2.13, 2026-11-26; examples/bench_cpu_speed.py prints the GEMMs
# using it). e5m2 is a truncated fp16 and torch's cast wins at every size (64K elements:
# 18.5 us; 1M: 262 us). e4m3 casts element by element (64K: 116 us; 1M: 1.9 ms): the cast
# wins only up to about 1K elements (4.6 us), where the table's five small ops cost more;
# a 256-entry table of byte values wins up to 16K (4K: 5.1 us vs 15.3 us; 16K: 11 us vs
# 58 us) but index_select slows down past that (64K: 76 us); a 64K-entry table of byte
# *pairs* halves the gathers and wins from there (64K: 25 us; 1M: 418 us).
_NATIVE_E4M3_MAX_NUMEL = 2048
_PAIR_TABLE_MIN_NUMEL = 32768
# The pair table is indexed by two bytes read as one native int16.
_LITTLE_ENDIAN = sys.byteorder == "little"

# (fp8 dtype, device) -> fp32 [256] table of every byte's value. A few KiB; built once.
_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
# (fp8 dtype, device) -> [65536] int64: the two fp32 values of every byte pair (in memory
# order), packed. 512 KiB; built once, on first use by a large e4m3 operand.
_PAIR_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    table = _TABLES.get(key)
    if table is None:
        codes = torch.arange(256, dtype=torch.uint8, device=device)
        with torch.inference_mode(False):
            table = _TABLES[key] = codes.view(dtype).to(torch.float32)
    return table


def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    table = _PAIR_TABLES.get(key)
    if table is None:
        # The byte pair of int16 code k is its first two bytes in memory (little endian).
        pairs = torch.arange(65536, dtype=torch.int32, device=device).view(torch.uint8).view(-1, 4)[:, :2]
        with torch.inference_mode(False):
            table = _PAIR_TABLES[key] = _table(dtype, device)[pairs.long()].contiguous().view(torch.int64).view(-1)
    return table


def fp8_to_float(data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data.to(dtype)`` for float8_e4m3fn / float8_e5m2 ``data`` of any shape, bit-exact.

    torch's cast where it is the fast one, else a table lookup of the byte values (see
    the sizes above); the result is contiguous. Other dtypes are converted with ``.to``.
    """
    if data.dtype not in _FP8_DTYPES:
        return data.to(dtype)
    n = data.numel()
    if data.dtype == torch.float8_e5m2 or n <= _NATIVE_E4M3_MAX_NUMEL:
        # torch's own cast is exact too, and the faster one here (see _NATIVE_E4M3_MAX_NUMEL).
        return data.to(dtype).contiguous()
    codes = data.contiguous().view(torch.uint8).reshape(-1)
    if n >= _PAIR_TABLE_MIN_NUMEL and n % 2 == 0 and codes.storage_offset() % 2 == 0 and _LITTLE_ENDIAN:
        pairs = codes.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)  # the int16 read unsigned
        out = _pair_table(data.dtype, data.device).index_select(0, pairs).view(torch.float32).view(data.shape)
    else:
        out = _table(data.dtype, data.device).index_select(0, codes.to(torch.int32)).view(data.shape)
    return out if dtype == torch.float32 else out.to(dtype)


def cpu_fp8_gemm_path() -> str:
    """The CPU FP8 GEMM ``TP_FUSE_CPU_FP8_GEMM`` asks for ("emulate" when unset), from the
    settings snapshot (:mod:`tp_fuse.settings`)."""
    return settings.current().cpu_fp8_gemm


@functools.lru_cache(maxsize=None)
def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16 tiles and torch's oneDNN can use them for matmuls."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("amx_bf16") and caps.get("amx_tile")) and torch.backends.mkldnn.is_available() \
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def emulation_units(m: int, n: int, k: int, acc_dtype: torch.dtype, *operands: torch.Tensor) -> str:
    """The units the emulation's ``[m, k] x [k, n]`` GEMM of decoded FP8 ``operands`` runs
    on now: ``"amx-bf16"`` or ``"fp32"`` (module doc: the rule and the measurements)."""
    units = static_units(m, n, k, acc_dtype)
    return units if units is not None else live_units(*operands)


def static_units(m: int, n: int, k: int, acc_dtype: torch.dtype) -> Optional[str]:
    """``"fp32"`` when the shape, dtype, settings or CPU alone rule the bf16 units out for
    the ``[m, k] x [k, n]`` GEMM, else None: :func:`live_units` decides per call (the part of
    the rule that depends on the running threads and modes). A GEMM plan decides this once."""
    units = settings.current().cpu_fp8_gemm_units
    if acc_dtype != torch.float32 or m * n * k < _BF16_UNITS_MIN_MACS or units == "fp32" \
            or not cpu_has_amx_bf16():
        return "fp32"
    return None


def live_units(*operands: torch.Tensor) -> str:
    """The per-call half of :func:`emulation_units`, for a GEMM :func:`static_units` left open."""
    if torch.compiler.is_compiling():
        return "fp32"
    units = settings.current().cpu_fp8_gemm_units
    # The precision flag is process-wide: another thread's matmul, or Python that a mode or
    # a tensor subclass runs inside this one, would run on bf16 units too.
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled() \
            or any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in operands):
        return "fp32"
    if units == "auto" and threading.active_count() != 1 and not _other_threads_matmul_free():
        return "fp32"
    return "amx-bf16"


def declare_matmul_free_threads(threads: Iterable[threading.Thread]) -> None:
    """Declare live helper threads (a logger's, a checkpoint writer's) that never run a
    matmul, so that their being alive does not keep the CPU FP8 emulation off the bf16
    units (:func:`emulation_units`). Process-wide; the declaration ends with the thread."""
    for thread in threads:
        if thread is not threading.current_thread():
            _MATMUL_FREE_THREADS.add(thread)


def _other_threads_matmul_free() -> bool:
    current = threading.current_thread()
    return all(t is current or t in _MATMUL_FREE_THREADS for t in threading.enumerate())


def exact_values_mm(mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    """``torch.mm(mat1, mat2)`` of fp32 operands every value of which is exact in bf16 (FP8
    values; FP4 values times FP8 block scales), on the units :func:`emulation_units` picks."""
    return _mm(mat1, mat2, emulation_units(mat1.shape[0], mat2.shape[1], mat1.shape[1], mat1.dtype, mat1, mat2))


def _mm(mat1: torch.Tensor, mat2: torch.Tensor, units: str) -> torch.Tensor:
    """``torch.mm`` on the chosen units (:func:`emulation_units`)."""
    if units == "fp32":
        return torch.mm(mat1, mat2)
    matmul = torch.backends.mkldnn.matmul
    # Without the lock, a thread restoring the flag it saw set by another (units "bf16" with
    # several GEMM threads) would leave it set for good.
    with _FLAG_LOCK:
        previous = matmul.fp32_precision
        matmul.fp32_precision = "bf16"
        try:
            return torch.mm(mat1, mat2)
        finally:
            matmul.fp32_precision = previous


def decode_operand(mat: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """The values of FP8 GEMM operand ``mat`` (unscaled) in ``acc_dtype`` (fp32, or float64
    for a float64 output), in a layout ``torch.mm`` reads without a copy: torch's cast
    keeps ``mat``'s strides; the table decodes in storage order."""
    if mat.dtype == torch.float8_e5m2 or mat.numel() <= _NATIVE_E4M3_MAX_NUMEL:
        # torch's cast (the faster one here, see _NATIVE_E4M3_MAX_NUMEL) keeps the
        # operand's layout, and torch.mm reads either: one op, no transposes.
        return mat.to(acc_dtype)
    # The table decodes contiguous bytes: decode in the operand's storage order. A
    # column-major mat2 [K, N] (the transpose of a row-major [N, K] weight) is decoded as
    # that [N, K] and transposed back as a view, with no transpose copy of the FP8 bytes.
    if not mat.is_contiguous() and mat.t().is_contiguous():
        return fp8_to_float(mat.t(), acc_dtype).t()
    return fp8_to_float(mat, acc_dtype)


def emulated_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    *,
    units: Optional[str] = None,
) -> torch.Tensor:
    """``torch._scaled_mm(mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype)``, emulated.

    Shapes::

        mat1     [M, K]  float8 (any layout; row-major is read without a copy)
        mat2     [K, N]  float8 (any layout; column-major is read without a copy)
        scale_a  [] / [1] tensor-wise, or [M, 1] row-wise   fp32 dequantization scales
        scale_b  [] / [1] tensor-wise, or [1, N] row-wise
        bias     [N]     optional, any float dtype, added in the accumulation dtype
        out      [M, N]  out_dtype (float32 / bfloat16 / float16 / float64)

    ``out = round_out_dtype((decode(mat1) @ decode(mat2)) * scale_a * scale_b + bias)`` with
    fp32 accumulation (fp64 for a float64 output); the products are exact. ``units``: the
    GEMM's (:func:`emulation_units`; chosen here when None).
    """
    acc_dtype = accumulation_dtype(out_dtype)
    return emulated_mm_decoded(decode_operand(mat1, acc_dtype), decode_operand(mat2, acc_dtype),
                               scale_a, scale_b, out_dtype, bias, units=units)


def accumulation_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The emulation's accumulation dtype: float64 for a float64 output, else fp32."""
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def emulated_mm_decoded(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    *,
    units: Optional[str] = None,
) -> torch.Tensor:
    """:func:`emulated_scaled_mm` for operands already decoded (:func:`decode_operand`,
    ``[M, K]`` and ``[K, N]`` in :func:`accumulation_dtype`): callers that use one
    operand in several GEMMs (a weight in fprop and dgrad) decode it once."""
    acc_dtype = mat1.dtype
    out = exact_values_mm(mat1, mat2) if units is None else _mm(mat1, mat2, units)
    out.mul_(scale_a if scale_a.dtype == acc_dtype else scale_a.to(acc_dtype))
    out.mul_(scale_b if scale_b.dtype == acc_dtype else scale_b.to(acc_dtype))
    if bias is not None:
        out.add_(bias if bias.dtype == acc_dtype else bias.to(acc_dtype))
    return out if out_dtype == acc_dtype else out.to(out_dtype)
