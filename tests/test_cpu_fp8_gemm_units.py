"""The CPU FP8 emulation's GEMM on the CPU's AMX-BF16 units (tp_fuse/kernels/fp8_emulation.py).

Every FP8 value is exact in bf16, so oneDNN's fp32 GEMM run on bf16 units
(``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``) is still an fp32 accumulation
of exact products: the result must meet the same summation-order bound as the fp32 GEMM
(``test_cpu_fp8_gemm._check_against_float64``); the same for NVFP4's e2m1 x E4M3-scale
values. The flag is process-wide, so these tests
also pin when it must NOT be used (another Python thread not declared matmul-free, a
dispatch mode, float64, small GEMMs, ``TP_FUSE_CPU_FP8_GEMM_UNITS=fp32``) and that it is
always restored. The threads already alive in a test process (pytest-xdist's) are declared
matmul-free by the ``helpers_declared`` fixture, for that test only.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_cpu_fp8_gemm import PAIRS, _check_against_float64, _fp8
from tp_fuse import kernels, settings
from tp_fuse.kernels import fp8_emulation
from tp_fuse.kernels.fp8_emulation import (
    CPU_FP8_GEMM_UNITS_ENV,
    cpu_has_amx_bf16,
    declare_matmul_free_threads,
    emulated_scaled_mm,
    emulation_units,
)
from tp_fuse.quantization import NVFP4Quantizer
from tp_fuse.quantization.block.gemm import emulated_block_gemm
from tp_fuse.quantization.nvfp4.scaling import block_decode_values, gemm_alpha

needs_amx = pytest.mark.skipif(not cpu_has_amx_bf16(), reason="needs a CPU with AMX-BF16 (lscpu: amx_bf16)")
BIG = (256, 128, 256)  # M, K, N: 2^23 multiply-adds, twice the smallest GEMM the bf16 units take
FLAG = torch.backends.mkldnn.matmul


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _operands(pair, seed=0):
    m, k, n = BIG
    return _fp8((m, k), pair[0], seed), _fp8((n, k), pair[1], seed + 1)


@pytest.fixture(autouse=True)
def helpers_declared(monkeypatch):
    """This process's other threads (the test runner's) declared matmul-free, in a
    declaration set of this test's own."""
    monkeypatch.setattr(fp8_emulation, "_MATMUL_FREE_THREADS", weakref.WeakSet())
    declare_matmul_free_threads(threading.enumerate())


@pytest.fixture
def mm_precision(monkeypatch):
    """The mkldnn fp32 precision in force at each ``torch.mm`` call."""
    seen: list[str] = []
    original = torch.mm

    def spy(*args, **kwargs):
        seen.append(FLAG.fp32_precision)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", spy)
    return seen


@needs_amx
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace("torch.float8_", ""))
def test_bf16_units_meet_the_fp32_summation_bound(pair, mm_precision):
    a, b = _operands(pair)
    sa, sb = torch.tensor(0.375), torch.tensor(3.0)
    before = FLAG.fp32_precision
    out = emulated_scaled_mm(a, b.t(), sa, sb, torch.float32)
    assert mm_precision == ["bf16"] and FLAG.fp32_precision == before
    _check_against_float64(out, a, b, sa, sb)
    fp32 = emulated_scaled_mm(a, b.t(), sa, sb, torch.float32, units="fp32")
    assert mm_precision[-1] == before
    _check_against_float64(fp32, a, b, sa, sb)


@needs_amx
def test_the_choice_is_logged_and_the_environment_keeps_fp32(tp_settings):
    a, b = _operands(PAIRS[0])
    one = torch.tensor(1.0)
    with kernels.record_kernel_paths() as log:
        kernels.fp8_gemm(a, b, one, one, torch.float32)
    call = log.last("fp8_gemm")
    assert call.variant == "cpu-emulation-amx-bf16" and "AMX-BF16" in call.reason
    tp_settings(**{CPU_FP8_GEMM_UNITS_ENV: "fp32"})
    with kernels.record_kernel_paths() as log:
        kernels.fp8_gemm(a, b, one, one, torch.float32)
    assert log.last("fp8_gemm").variant == "cpu-emulation" and "fp32 GEMM" in log.last("fp8_gemm").reason
    with pytest.raises(ValueError, match=f"{CPU_FP8_GEMM_UNITS_ENV}: expected one of"):
        tp_settings(**{CPU_FP8_GEMM_UNITS_ENV: "amx"})


@needs_amx
def test_units_stay_fp32_where_the_process_wide_flag_could_leak():
    m, k, n = BIG
    a, b = torch.zeros(m, k), torch.zeros(k, n)
    assert emulation_units(m, n, k, torch.float32, a, b) == "amx-bf16"
    # Below the size rule, for a float64 output, for tensor subclasses, inside a mode.
    assert emulation_units(16, 256, 64, torch.float32, a, b) == "fp32"
    assert emulation_units(m, n, k, torch.float64, a, b) == "fp32"
    assert emulation_units(m, n, k, torch.float32, torch.nn.Parameter(a), b) == "fp32"
    with _Passthrough():
        assert emulation_units(m, n, k, torch.float32, a, b) == "fp32"
    # While an undeclared Python thread is alive: it could run a matmul during ours.
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert emulation_units(m, n, k, torch.float32, a, b) == "fp32"
        with settings.override(**{CPU_FP8_GEMM_UNITS_ENV: "bf16"}):  # the user vouches for every thread
            assert emulation_units(m, n, k, torch.float32, a, b) == "amx-bf16"
        with settings.override(**{CPU_FP8_GEMM_UNITS_ENV: "fp32"}):
            assert emulation_units(m, n, k, torch.float32, a, b) == "fp32"
        declare_matmul_free_threads([other])
        assert emulation_units(m, n, k, torch.float32, a, b) == "amx-bf16"
    finally:
        release.set()
        other.join()
    assert emulation_units(m, n, k, torch.float32, a, b) == "amx-bf16"


@needs_amx
def test_flag_is_restored_when_the_gemm_raises():
    before = FLAG.fp32_precision
    m, k, n = BIG
    bad = torch.zeros(k + 1, n)
    with pytest.raises(RuntimeError):
        kernels.fp8_emulation.emulated_mm_decoded(torch.zeros(m, k), bad, torch.tensor(1.0), torch.tensor(1.0),
                                                  torch.float32, units="amx-bf16")
    assert FLAG.fp32_precision == before


def test_cpus_without_amx_use_the_fp32_units(monkeypatch):
    monkeypatch.setattr(kernels.fp8_emulation, "cpu_has_amx_bf16", lambda: False)
    m, k, n = BIG
    assert emulation_units(m, n, k, torch.float32, torch.zeros(m, k), torch.zeros(k, n)) == "fp32"


@needs_amx
def test_nvfp4_gemm_on_bf16_units_meets_the_fp32_summation_bound(mm_precision):
    """NVFP4's emulated GEMM multiplies e2m1 x E4M3-block-scale values: exact in bf16 too."""
    g = torch.Generator().manual_seed(3)
    m, k, n = BIG
    a = NVFP4Quantizer()(torch.randn(m, k, generator=g))._rowwise
    b = NVFP4Quantizer()(torch.randn(n, k, generator=g))._rowwise
    out = emulated_block_gemm(a, b, torch.float32)
    assert mm_precision == ["bf16"]
    va = block_decode_values(a.data, a.scale_inv, a.spec).double()
    vb = block_decode_values(b.data, b.scale_inv, b.spec).double()
    alpha = gemm_alpha(a.amax, b.amax).double()
    expected = (va @ vb.t()) * alpha
    bound = (va.abs() @ vb.abs().t()) * alpha * (k * 2.0**-24 + 2.0**-24) + 1e-30
    assert bool(((out.double() - expected).abs() <= bound).all())


@needs_amx
def test_concurrent_gemms_leave_the_flag_as_they_found_it():
    """With TP_FUSE_CPU_FP8_GEMM_UNITS=bf16 several threads may run FP8 GEMMs at once: a
    thread restoring the flag it saw another set would leave it set for every later fp32
    matmul of the process. The set/restore pairs must not interleave."""
    before = FLAG.fp32_precision
    a, b = torch.randn(512, 256), torch.randn(256, 512)

    def gemms():
        for _ in range(40):
            fp8_emulation._mm(a, b, "amx-bf16")

    threads = [threading.Thread(target=gemms) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert FLAG.fp32_precision == before
