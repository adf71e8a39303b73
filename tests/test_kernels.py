"""tp_fuse.kernels: torch reference vs float64 math, backend dispatch, and (on CUDA) the
Triton kernels vs the torch reference.

The Triton kernels are also tested on CPU in the Triton interpreter, in a subprocess:
see test_kernels_interpret.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import types

import pytest
import torch
import torch.nn.functional as F

from tolerances import tols
from tp_fuse.kernels import (
    dgelu_dbias,
    dswiglu,
    fp8_gemm,
    gelu_fwd,
    layernorm_fwd,
    quantize,
    record_kernel_paths,
    rmsnorm_fwd,
    select_backend,
    swiglu_fwd,
)
from tp_fuse.kernels import dispatch
from tp_fuse.kernels.cast import triton_quantize_issue
from tp_fuse.kernels.norms import MAX_TRITON_NORM_COLS
from tp_fuse.kernels.testing import fp8_round_reference, make_input, max_fp8_ulp_distance

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(1, 1), (7, 13), (33, 65), (2, 3, 17)]
CASES = [(s, "contiguous") for s in SHAPES] + [((33, 65), "transposed"), ((7, 13), "strided")]
F32 = tols(torch.float32)  # rtol = atol = 1e-5: fp32 math vs float64


def _bytes(t):
    return t.view(torch.uint8)


def _close_f64(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **tols(dtype))


# ----------------------------------------------------------------------------------
# quantize: torch reference vs an independent float64 rounding
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_reference(shape, layout, dtype, fp8_dtype):
    x = make_input(shape, dtype, layout, std=60.0)
    scale = torch.tensor(3.5)  # saturates the tails of e4m3
    data, data_t, amax = quantize(x, scale, fp8_dtype, transpose=True)
    expected = fp8_round_reference(x.float() * scale, fp8_dtype)  # fp32 product, exact rounding
    assert data.shape == x.shape and data.is_contiguous()
    assert torch.equal(_bytes(data), _bytes(expected))
    rows = math.prod(shape[:-1])
    assert data_t.shape == (shape[-1], rows) and data_t.is_contiguous()
    assert torch.equal(_bytes(data_t), _bytes(expected.reshape(rows, -1).t()))
    assert amax.dtype == torch.float32 and amax.dim() == 0
    assert amax.item() == x.double().abs().max().item()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_quantize_special_values(fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e30, -1e30, 1e-40, -1e-40, float("nan")])
    data, data_t, amax = quantize(x, torch.tensor(1.0), fp8_dtype)
    got = data.float()
    assert data_t is None
    assert got[:8].tolist() == [0.0, -0.0, fmax, -fmax, fmax, -fmax, 0.0, -0.0]
    assert torch.signbit(got[:8]).tolist() == [False, True, False, True, False, True, False, True]
    assert got[8].isnan() and amax.isnan()
    assert torch.equal(_bytes(data), _bytes(fp8_round_reference(x, fp8_dtype)))


def test_quantize_empty():
    data, data_t, amax = quantize(torch.empty(0, 8), torch.tensor(1.0), E4M3, transpose=True)
    assert data.shape == (0, 8) and data_t.shape == (8, 0) and amax.item() == 0.0


# ----------------------------------------------------------------------------------
# norms
# ----------------------------------------------------------------------------------


def _norm_f64(x, w, b, eps, rms):
    x64 = x.double()
    if rms:
        mean = None
        xc = x64
    else:
        mean = x64.mean(-1)
        xc = x64 - mean[..., None]
    rstd = 1.0 / torch.sqrt((xc * xc).mean(-1) + eps)
    y = xc * rstd[..., None] * w.double()
    return (y if b is None else y + b.double()), mean, rstd


def _check_fp8_out(y, y64, scale, fp8_dtype):
    # The fp32 result differs from float64 by ~1e-7 relative, which can move a value
    # across an fp8 rounding boundary: at most one step apart.
    assert y.dtype == fp8_dtype
    assert max_fp8_ulp_distance(y, fp8_round_reference(y64 * scale.double(), fp8_dtype)) <= 1


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [None, E4M3])
def test_norm_reference(rms, shape, layout, dtype, fp8_dtype):
    x = make_input(shape, dtype, layout, std=2.0) + 0.5
    n = shape[-1]
    w = make_input((n,), torch.float32, seed=1, std=1.0)
    b = make_input((n,), torch.bfloat16, seed=2, std=1.0)
    scale = torch.tensor(30.0) if fp8_dtype else None
    if rms:
        y, rstd, amax = rmsnorm_fwd(x, w, 1e-5, scale=scale, fp8_dtype=fp8_dtype)
        mean = None
    else:
        y, mean, rstd, amax = layernorm_fwd(x, w, b, 1e-5, scale=scale, fp8_dtype=fp8_dtype)
    y64, mean64, rstd64 = _norm_f64(x, w, None if rms else b, 1e-5, rms)
    assert y.shape == x.shape and y.is_contiguous()
    assert rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32
    if fp8_dtype is None:
        _close_f64(y, y64, dtype)
    else:
        _check_fp8_out(y, y64, scale, fp8_dtype)
    torch.testing.assert_close(rstd.double(), rstd64, **F32)
    if not rms:
        torch.testing.assert_close(mean.double(), mean64, **F32)
    torch.testing.assert_close(amax.double(), y64.abs().max(), **F32)


def test_norm_argument_errors():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_fwd(x, torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="scale/fp8_dtype"):
        rmsnorm_fwd(x, w, 1e-5, fp8_dtype=E4M3)
    with pytest.raises(ValueError, match="scale"):
        rmsnorm_fwd(x, w, 1e-5, scale=torch.tensor(1.0, dtype=torch.float64), fp8_dtype=E4M3)
    with pytest.raises(ValueError, match="fp8_dtype"):
        layernorm_fwd(x, w, w, 1e-5, scale=torch.tensor(1.0), fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="eps"):
        layernorm_fwd(x, w, w, -1.0)
    with pytest.raises(ValueError, match="x"):
        rmsnorm_fwd(x.to(torch.int32), w, 1e-5)


# ----------------------------------------------------------------------------------
# activations
# ----------------------------------------------------------------------------------


def _gelu_te_f64(x64):
    return 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)))


def _grad_f64(fn, x, grad):
    x64 = x.double().requires_grad_(True)
    (dx,) = torch.autograd.grad(fn(x64), x64, grad.double())
    return dx


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [None, E4M3])
def test_gelu_reference(shape, layout, dtype, fp8_dtype):
    x = make_input(shape, dtype, layout)
    scale = torch.tensor(50.0) if fp8_dtype else None
    y, amax = gelu_fwd(x, scale=scale, fp8_dtype=fp8_dtype)
    y64 = _gelu_te_f64(x.double())
    assert y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y64, F.gelu(x.double(), approximate="tanh"))  # formula sanity
    if fp8_dtype is None:
        _close_f64(y, y64, dtype)
    else:
        _check_fp8_out(y, y64, scale, fp8_dtype)
    torch.testing.assert_close(amax.double(), y64.abs().max(), **F32)

    grad = make_input(shape, dtype, layout, seed=5, std=1.0)
    gscale = torch.tensor(1000.0) if fp8_dtype else None
    dx, dbias, damax = dgelu_dbias(grad, x, scale=gscale, fp8_dtype=fp8_dtype and E5M2)
    dx64 = _grad_f64(_gelu_te_f64, x, grad)
    if fp8_dtype is None:
        _close_f64(dx, dx64, dtype)
    else:
        _check_fp8_out(dx, dx64, gscale, E5M2)
    assert dbias.dtype == dtype and dbias.shape == (shape[-1],)
    _close_f64(dbias, dx64.reshape(-1, shape[-1]).sum(0), dtype)
    torch.testing.assert_close(damax.double(), dx64.abs().max(), **F32)


def test_gelu_extreme_inputs():
    x = torch.tensor([-1e4, -30.0, -10.0, -5.0, 0.0, 5.0, 30.0, 1e4])
    y, _ = gelu_fwd(x)
    # The sigmoid form x * sigmoid(2u) == 0.5 x (1 + tanh(u)) keeps full relative
    # accuracy in the negative tail, where 1 + tanh(u) cancels (even in float64:
    # F.gelu(-10.0) is 0 there, the true value -1.2e-37).
    x64 = x.double()
    u = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)
    torch.testing.assert_close(y.double(), x64 * torch.sigmoid(2.0 * u), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(y.double(), F.gelu(x64, approximate="tanh"), rtol=1e-5, atol=1e-30)
    assert y[2].item() < 0.0  # gelu(-10) = -1.2e-37: not rounded to 0


@pytest.mark.parametrize("shape,layout", [((1, 2), "contiguous"), ((7, 14), "contiguous"), ((33, 66), "transposed"),
                                          ((2, 3, 18), "contiguous"), ((7, 14), "strided")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [None, E4M3])
def test_swiglu_reference(shape, layout, dtype, fp8_dtype):
    x = make_input(shape, dtype, layout)
    scale = torch.tensor(20.0) if fp8_dtype else None

    def swiglu64(t):
        t1, t2 = t.chunk(2, dim=-1)
        return F.silu(t1) * t2

    y, amax = swiglu_fwd(x, scale=scale, fp8_dtype=fp8_dtype)
    y64 = swiglu64(x.double())
    assert y.shape == (*shape[:-1], shape[-1] // 2)
    if fp8_dtype is None:
        _close_f64(y, y64, dtype)
    else:
        _check_fp8_out(y, y64, scale, fp8_dtype)
    torch.testing.assert_close(amax.double(), y64.abs().max(), **F32)

    grad = make_input((*shape[:-1], shape[-1] // 2), dtype, seed=7, std=1.0)
    dx, damax = dswiglu(grad, x, scale=scale, fp8_dtype=fp8_dtype)
    dx64 = _grad_f64(swiglu64, x, grad)
    assert dx.shape == x.shape and dx.is_contiguous()
    if fp8_dtype is None:
        _close_f64(dx, dx64, dtype)
    else:
        _check_fp8_out(dx, dx64, scale, fp8_dtype)
    torch.testing.assert_close(damax.double(), dx64.abs().max(), **F32)


def test_activation_argument_errors():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu_fwd(torch.randn(3, 5))
    with pytest.raises(ValueError, match="grad"):
        dswiglu(torch.randn(3, 3), torch.randn(3, 4))
    with pytest.raises(ValueError, match="grad"):
        dgelu_dbias(torch.randn(3, 4), torch.randn(4, 3))


# ----------------------------------------------------------------------------------
# FP8 GEMM
# ----------------------------------------------------------------------------------


def gemm_check(out, pre, a, b, sa, sb, bias, gelu, out_dtype, mma_rel=0.0):
    """Check an fp8_gemm result against float64 math on the dequantized operands.

    The operands are exact fp8 values, so the only errors are fp32 accumulation
    (bounded by K * 2^-24 * sum|a_k b_k|, scaled) and the final rounding to out_dtype.
    ``mma_rel`` adds ``mma_rel * sum|a_k b_k|`` for GPU FP8 tensor cores, whose
    internal accumulator keeps fewer mantissa bits than fp32 within each K block.
    """
    K = a.shape[1]
    ab = a.double() @ b.double().t() * sa.double() * sb.double()
    mag = a.double().abs() @ b.double().abs().t() * sa.double() * sb.double()
    ref = ab + (bias.double() if bias is not None else 0.0)
    eps_out = torch.finfo(out_dtype).eps
    acc_err = (K * 2.0**-24 + mma_rel) * mag + 1e-30
    stored = pre if gelu else out
    assert stored.dtype == out_dtype and stored.shape == ab.shape
    assert ((stored.double() - ref).abs() <= acc_err + eps_out * ref.abs()).all()
    if gelu:
        # GELU is applied to the stored (rounded) pre-activation.
        g = F.gelu(pre.double(), approximate="tanh")
        torch.testing.assert_close(out.double(), g, rtol=eps_out + 1e-5, atol=1e-6)
    else:
        assert pre is None


GEMM_SHAPES = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (16, 48, 64)]
FP8_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]


def gemm_operands(M, N, K, fa, fb, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 8).to(fa).to(device)
    b = (torch.randn(N, K, generator=g) * 8).to(fb).to(device)
    bias = torch.randn(N, generator=g).to(device)
    return a, b, torch.tensor(0.37, device=device), torch.tensor(1.9, device=device), bias


@pytest.mark.parametrize("M,N,K", GEMM_SHAPES)
@pytest.mark.parametrize("fa,fb", FP8_PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["none", "bias", "bias+gelu"])
def test_fp8_gemm_reference(M, N, K, fa, fb, out_dtype, epilogue):
    a, b, sa, sb, bias = gemm_operands(M, N, K, fa, fb)
    bias = bias.to(out_dtype) if "bias" in epilogue else None
    gelu = "gelu" in epilogue
    out, pre = fp8_gemm(a, b, sa, sb, out_dtype, bias=bias, gelu=gelu)
    gemm_check(out, pre, a, b, sa, sb, bias, gelu, out_dtype)


def test_fp8_gemm_argument_errors():
    a, b, sa, sb, _ = gemm_operands(4, 5, 16, E4M3, E4M3)
    with pytest.raises(ValueError, match="b: expected"):
        fp8_gemm(a, b[:, :8], sa, sb, torch.float32)
    with pytest.raises(ValueError, match="a: expected"):
        fp8_gemm(a.float(), b, sa, sb, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm(a, b, sa, sb, E4M3)
    with pytest.raises(ValueError, match="bias"):
        fp8_gemm(a, b, sa, sb, torch.float32, bias=torch.randn(4))
    with pytest.raises(ValueError, match="scale_b"):
        fp8_gemm(a, b, sa, torch.ones(2), torch.float32)


# ----------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------


def _all_kernels(backend=None, device="cpu"):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    s = torch.tensor(1.0, device=device)
    # N = K = 16: CUDA's _scaled_mm takes only multiples of 16 (N = 8 failed on an H200).
    a, b, sa, sb, _ = gemm_operands(4, 16, 16, E4M3, E4M3, device=device)
    quantize(x, s, E4M3, backend=backend)
    layernorm_fwd(x, w, w, 1e-5, backend=backend)
    rmsnorm_fwd(x, w, 1e-5, backend=backend)
    gelu_fwd(x, backend=backend)
    swiglu_fwd(x, backend=backend)
    dgelu_dbias(x, x, backend=backend)
    dswiglu(x[:, :4], x, backend=backend)
    fp8_gemm(a, b, sa, sb, torch.bfloat16, backend=backend)


ALL_KERNELS = {"quantize", "layernorm_fwd", "rmsnorm_fwd", "gelu_fwd", "swiglu_fwd", "dgelu_dbias", "dswiglu",
               "fp8_gemm"}


def test_cpu_defaults_to_torch_and_records_paths():
    with record_kernel_paths() as outer:
        with record_kernel_paths() as inner:
            _all_kernels()
        quantize(torch.randn(2, 2), torch.tensor(1.0), E5M2)
    assert {c.kernel for c in inner.calls} == ALL_KERNELS and len(inner) == 8
    assert set(inner.backends()) == {"torch"}
    assert len(outer) == 9 and outer.counts()[("quantize", "torch")] == 2
    assert "exact emulation" in inner.last("fp8_gemm").reason and inner.last("fp8_gemm").variant == "cpu-emulation"
    with pytest.raises(LookupError):
        inner.last("no_such_kernel")


def test_log_sees_calls_from_other_threads():
    # Regression (first GPU run, H200): the log was per thread, and CUDA's autograd runs
    # the backward on a device thread, so no backward kernel reached a GPU log.
    with record_kernel_paths() as log:
        worker = threading.Thread(target=quantize, args=(torch.randn(2, 2), torch.tensor(1.0), E4M3))
        worker.start()
        worker.join()
    assert [c.kernel for c in log.calls] == ["quantize"]


def test_no_log_outside_context():
    log = dispatch.KernelPathLog()
    with record_kernel_paths(log):
        pass
    quantize(torch.randn(2, 2), torch.tensor(1.0), E4M3)
    assert len(log) == 0


def test_backend_argument_validation():
    with pytest.raises(ValueError, match="backend"):
        gelu_fwd(torch.randn(2, 2), backend="cuda")
    if not dispatch.triton_interpreted():
        # Triton cannot run CPU tensors outside the interpreter (or is not installed):
        # an explicit request must fail loudly, never fall back.
        with pytest.raises(RuntimeError, match="triton"):
            gelu_fwd(torch.randn(2, 2), backend="triton")


def test_cpu_use_does_not_import_triton():
    code = ("import sys, torch, tp_fuse.kernels as k; before = 'triton' in sys.modules; "
            "k.quantize(torch.randn(2, 2), torch.tensor(1.0), torch.float8_e4m3fn); "
            "print(before, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    if out[0] == "True":
        pytest.skip("another tp_fuse module imports triton at import time")
    assert out == ["False", "False"]


def test_select_backend_rules(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "triton X"))
    assert select_backend("k", cuda).backend == "triton"
    choice = select_backend("k", cuda, triton_unsupported="rows too long")
    assert choice.backend == "torch" and choice.reason == "rows too long"
    with pytest.raises(ValueError, match="rows too long"):
        select_backend("k", cuda, "triton", triton_unsupported="rows too long")
    assert select_backend("k", torch.device("cpu")).backend == "torch"
    monkeypatch.setattr(dispatch, "triton_status", lambda: (False, "triton is not importable (boom)"))
    choice = select_backend("k", cuda)
    assert choice.backend == "torch" and "boom" in choice.reason
    with pytest.raises(RuntimeError, match="boom"):
        select_backend("k", cuda, "triton")
    assert select_backend("k", cuda, "torch").backend == "torch"


def test_norm_row_limit_routes_to_torch(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "triton X"))
    from tp_fuse.kernels import norms

    wide = types.SimpleNamespace(shape=(1, MAX_TRITON_NORM_COLS + 1), device=torch.device("cuda"))
    choice = norms._select("rmsnorm_fwd", wide, None)
    assert choice.backend == "torch" and "limit" in choice.reason


# ----------------------------------------------------------------------------------
# CUDA: Triton kernels vs torch reference on the GPU
# ----------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
needs_triton = pytest.mark.skipif(not dispatch.triton_status()[0], reason="triton is not installed")


def _nan_aware_equal(a, b):
    # Hardware cvt.satfinite writes NaN as 0x7F for either sign; torch keeps the sign.
    na, nb = a.float().isnan(), b.float().isnan()
    return torch.equal(na, nb) and torch.equal(_bytes(a)[~na], _bytes(b)[~nb])


def test_fp32_transpose_quantize_on_cuda_is_not_planned_for_triton():
    cuda = torch.device("cuda")
    assert triton_quantize_issue(torch.float32, cuda, transpose=True) is not None
    assert triton_quantize_issue(torch.float32, cuda, transpose=False) is None
    assert triton_quantize_issue(torch.bfloat16, cuda, transpose=True) is None
    assert triton_quantize_issue(torch.float32, torch.device("cpu"), transpose=True) is None  # interpreter: right
    assert "float64" in triton_quantize_issue(torch.float64, cuda, transpose=False)


@cuda_only
@needs_triton
@pytest.mark.gpu
@pytest.mark.xfail(reason="H200, Triton 3.6: wrong transposed bytes for fp32 input; an XPASS means "
                          "triton_quantize_issue's fp32 rule can go", strict=False)
def test_triton_fp32_transpose_on_cuda():
    # Calls the kernel directly (quantize refuses it): the evidence behind the rule.
    from tp_fuse.kernels import cast_triton  # needs triton (needs_triton above)

    x = make_input((4096, 4096), torch.float32, "contiguous", std=60.0, device="cuda")
    s = torch.tensor(3.0, device="cuda")
    data, data_t, _, _ = cast_triton.quantize_triton(x, s, E4M3, transpose=True)
    ref = quantize(x, s, E4M3, transpose=True, backend="torch")
    assert _nan_aware_equal(data, ref[0]) and _nan_aware_equal(data_t, ref[1])


@cuda_only
@needs_triton
@pytest.mark.gpu
def test_cuda_defaults_to_triton_except_the_fp8_gemm():
    # The FP8 GEMM defaults to torch._scaled_mm (cuBLASLt) on CUDA; the rest to Triton.
    with record_kernel_paths() as log:
        _all_kernels(device="cuda")
    assert {c.kernel: c.backend for c in log.calls} == {k: "torch" if k == "fp8_gemm" else "triton" for k in ALL_KERNELS}


@cuda_only
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", CASES + [((4096, 4096), "contiguous")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_cuda_triton_matches_torch(shape, layout, dtype, fp8_dtype):
    x = make_input(shape, dtype, layout, std=60.0, device="cuda")
    s = torch.tensor(3.0, device="cuda")
    # fp32 + transpose on CUDA is refused for Triton (test_triton_fp32_transpose_on_cuda).
    transpose = dtype != torch.float32
    q_t = quantize(x, s, fp8_dtype, transpose=transpose, backend="triton")
    q_r = quantize(x, s, fp8_dtype, transpose=transpose, backend="torch")
    assert _nan_aware_equal(q_t[0], q_r[0]) and (not transpose or _nan_aware_equal(q_t[1], q_r[1]))
    assert torch.equal(q_t[2], q_r[2])
    n = shape[-1]
    w = torch.randn(n, device="cuda")
    for fp8 in (None, fp8_dtype):
        sc = s if fp8 else None
        y_t, _, rstd_t, amax_t = layernorm_fwd(x / 30, w, w, 1e-5, scale=sc, fp8_dtype=fp8, backend="triton")
        y_r, _, rstd_r, amax_r = layernorm_fwd(x / 30, w, w, 1e-5, scale=sc, fp8_dtype=fp8, backend="torch")
        torch.testing.assert_close(rstd_t, rstd_r, **F32)
        torch.testing.assert_close(amax_t, amax_r, **F32)
        if fp8:
            assert max_fp8_ulp_distance(y_t, y_r) <= 1
        else:
            torch.testing.assert_close(y_t.float(), y_r.float(), **tols(dtype))
        g_t, gamax_t = gelu_fwd(x / 30, scale=sc, fp8_dtype=fp8, backend="triton")
        g_r, gamax_r = gelu_fwd(x / 30, scale=sc, fp8_dtype=fp8, backend="torch")
        torch.testing.assert_close(gamax_t, gamax_r, **F32)
        if fp8:
            assert max_fp8_ulp_distance(g_t, g_r) <= 1
        else:
            torch.testing.assert_close(g_t.float(), g_r.float(), **tols(dtype))


@cuda_only
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(128, 256, 512), (33, 65, 80), (7, 13, 5)])
@pytest.mark.parametrize("fa,fb", [(E4M3, E4M3), (E4M3, E5M2)])
def test_cuda_fp8_gemm_triton(M, N, K, fa, fb):
    from tp_fuse.kernels import gemm_triton

    a, b, sa, sb, bias = gemm_operands(M, N, K, fa, fb, device="cuda")
    bias = bias.to(torch.bfloat16)
    variants = [None, False]  # auto (TMA on sm_90 when aligned), pointer
    for tma in variants:
        out, pre, variant = gemm_triton.fp8_gemm_triton(a, b, sa, sb, torch.bfloat16, bias, True, tma=tma)
        gemm_check(out.cpu(), pre.cpu(), a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), bias.cpu(), True, torch.bfloat16,
                   mma_rel=2.0**-12)
        if tma is None and torch.cuda.get_device_capability() >= (9, 0) and K % 16 == 0:
            assert variant.startswith("tma"), variant
