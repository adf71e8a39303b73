"""The CPU FP8 GEMM (tp_fuse/kernels/fp8_emulation.py): exact emulation of torch._scaled_mm.

On AVX512-FP16/AMX Xeons torch 2.13 runs CPU ``_scaled_mm`` e4m3 x e4m3 through a oneDNN
reference loop (~2000x the fp32 GEMM) and refuses float64 outputs; the emulation is the
CPU path everywhere. These tests pin: the decode is bit-exact for every byte, the GEMM
equals a float64 reference up to fp32 summation order (bound below), both scale forms,
bias, every output dtype and operand layout, NaN/inf propagation, and that training never
calls ``torch._scaled_mm`` on CPU by default (the regression: tests and FP8 runs on such a
CPU took hours).

Summation-order bound: the products are exact, so the only error of the fp32 accumulation
is that of a K-term fp32 sum, ``|err| <= K * 2**-24 * sum_k |a_k b_k| * |scale_a scale_b|``
(standard recursive-summation bound, before the final rounding to the output dtype).
"""

from __future__ import annotations

import pytest
import torch

from tp_fuse import kernels, ops
from tp_fuse.kernels import dispatch
from tp_fuse.kernels.cuda_rules import scaled_mm
from tp_fuse.kernels.fp8_emulation import CPU_FP8_GEMM_ENV, decode_operand, emulated_scaled_mm, fp8_to_float
from tp_fuse.quantization import autocast
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Float8RowwiseScaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]
OUT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}


def _fp8(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _check_against_float64(out, a, b, sa, sb, bias=None):
    """``out`` vs the float64 product within the summation-order bound (module doc)."""
    a64, b64 = a.double(), b.double()
    scale = sa.double() * sb.double()
    expected = (a64 @ b64.t()) * scale
    magnitude = (a64.abs() @ b64.abs().t()) * scale.abs()
    if bias is not None:
        expected = expected + bias.double()
        magnitude = magnitude + bias.double().abs()
    k = a.shape[1]
    acc_eps = 2.0**-53 if out.dtype == torch.float64 else 2.0**-24
    bound = magnitude * (k * acc_eps + OUT_ROUNDOFF[out.dtype]) + 1e-30
    err = (out.double() - expected).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item()} above the bound {bound.max().item()}"


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("repeat", [1, 40], ids=["small", "large"])  # both sides of the table/.to size rule
def test_decode_is_bit_exact_for_every_byte(dtype, repeat):
    codes = torch.arange(256, dtype=torch.uint8).repeat(repeat).view(dtype)
    got, want = fp8_to_float(codes.view(16 * repeat, 16)), codes.to(torch.float32).view(16 * repeat, 16)
    assert got.dtype == torch.float32 and got.shape == (16 * repeat, 16) and got.is_contiguous()
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))  # signed zeros too
    # Non-contiguous views decode to the same values.
    assert torch.equal(fp8_to_float(codes.view(16 * repeat, 16).t()).nan_to_num(), want.t().nan_to_num())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_large_operands_decode_bit_exact_in_their_layout(dtype, acc):
    """decode_operand above the table size rules, row-major and as a transposed view:
    torch's own cast's values (signed zeros included), in the view's strides."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(160).view(dtype).view(256, 160)
    for mat in (codes, codes.t()):
        got, want = decode_operand(mat, acc), mat.to(acc)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "x".join(str(d)[-6:] for d in p) if isinstance(p, tuple) else p)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_tensorwise_gemm_matches_float64_within_summation_order(pair, out_dtype):
    a, b = _fp8((48, 80), pair[0], 1), _fp8((32, 80), pair[1], 2)
    sa, sb = torch.tensor(0.375), torch.tensor(1.75)
    bias = torch.randn(32) if out_dtype != torch.float16 else None
    out = scaled_mm(a, b.t(), sa, sb, out_dtype, bias=bias)
    assert out.dtype == out_dtype and out.shape == (48, 32)
    _check_against_float64(out, a, b, sa, sb, bias)


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_matches_torch_scaled_mm_fallback_up_to_summation_order():
    """Against torch's own CPU fallback (oneDNN off: dequantize + fp32 GEMM), all pairs."""
    for da, db in PAIRS:
        a, b = _fp8((64, 96), da, 3), _fp8((40, 96), db, 4)
        sa, sb = torch.tensor(0.5), torch.tensor(2.0)  # powers of two: torch's operand scaling is exact too
        with torch.backends.mkldnn.flags(enabled=False):
            ref = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        got = emulated_scaled_mm(a, b.t(), sa, sb, torch.float32)
        torch.testing.assert_close(got, ref, rtol=96 * 2.0**-24, atol=1e-6)


def test_rowwise_scales_and_operand_layouts():
    a, b = _fp8((24, 64), E4M3, 5), _fp8((16, 64), E4M3, 6)
    sa = torch.rand(24, 1) + 0.5
    sb = torch.rand(1, 16) + 0.5
    out = emulated_scaled_mm(a, b.t(), sa, sb, torch.float32)
    expected = (a.double() @ b.double().t()) * sa.double() * sb.double()
    torch.testing.assert_close(out.double(), expected, rtol=64 * 2.0**-24, atol=1e-6)
    # mat1 column-major, mat2 row-major (transposed copies): the same values.
    a_cm = a.t().contiguous().t()
    b_rm = b.t().contiguous()
    torch.testing.assert_close(emulated_scaled_mm(a_cm, b_rm, sa, sb, torch.float32), out, rtol=0, atol=0)


def test_nan_and_inf_propagate_like_the_float64_product():
    a = torch.tensor([[1.0, float("nan")], [2.0, 1.0]]).to(E4M3)
    b = torch.tensor([[float("inf"), 1.0], [1.0, 1.0]]).to(E5M2)
    out = emulated_scaled_mm(a, b.t(), torch.tensor(1.0), torch.tensor(1.0), torch.float32)
    expected = a.float() @ b.float().t()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())


def test_float64_output_on_every_path(tp_settings):
    """oneDNN's CPU _scaled_mm refuses float64 ('itensor_view_from_dense expects ...'):
    the emulation accumulates in float64, the scaled_mm path widens its fp32 result."""
    a, b = _fp8((16, 32), E5M2, 7), _fp8((16, 32), E4M3, 8)
    one = torch.tensor(1.0)
    out, _ = kernels.fp8_gemm(a, b, one, one, torch.float64)
    assert out.dtype == torch.float64
    _check_against_float64(out, a, b, one, one)
    tp_settings(**{CPU_FP8_GEMM_ENV: "scaled_mm"})
    widened, _ = kernels.fp8_gemm(a, b, one, one, torch.float64)
    assert widened.dtype == torch.float64
    torch.testing.assert_close(widened, out, rtol=32 * 2.0**-24, atol=1e-6)


def test_choice_is_recorded_and_validated(tp_settings):
    a = _fp8((16, 16), E4M3, 9)
    one = torch.tensor(1.0)
    with kernels.record_kernel_paths() as log:
        kernels.fp8_gemm(a, a, one, one, torch.float32)
    call = log.last("fp8_gemm")
    assert call.variant == "cpu-emulation" and "exact emulation" in call.reason
    tp_settings(**{CPU_FP8_GEMM_ENV: "scaled_mm"})
    with kernels.record_kernel_paths() as log:
        kernels.fp8_gemm(a, a, one, one, torch.float32)
    assert log.last("fp8_gemm").variant == "scaled_mm" and CPU_FP8_GEMM_ENV in log.last("fp8_gemm").reason
    assert "scaled_mm" in dispatch.planned_backend("fp8_gemm", torch.device("cpu")).reason
    with pytest.raises(ValueError, match=f"{CPU_FP8_GEMM_ENV}: expected one of"):
        tp_settings(**{CPU_FP8_GEMM_ENV: "fast"})


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling(), Float8RowwiseScaling()],
                         ids=["delayed", "current", "rowwise"])
def test_training_never_calls_torch_scaled_mm_on_cpu(recipe, monkeypatch):
    """Regression: every FP8 GEMM of a training step (fprop, dgrad, wgrad) went through
    CPU torch._scaled_mm, whose e4m3 x e4m3 kernel is a reference loop on AVX512-FP16/AMX
    Xeons (FP8 tests and runs timed out there). Now none does, on any CPU."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    torch.manual_seed(0)
    seq = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64))
    x = torch.randn(32, 64, requires_grad=True)
    with kernels.record_kernel_paths() as log:
        for _ in range(2):
            with autocast(recipe=recipe):
                y = seq(x)
            y.square().mean().backward()
    assert x.grad is not None and all(p.grad is not None for p in seq.parameters())
    gemm_variants = {c.variant for c in log.calls if c.kernel == "fp8_gemm"}
    assert gemm_variants <= {"cpu-emulation"}
