"""GPU readiness on CPU: the FP8 GEMM's CUDA default (decided for a faked GPU), and the
strict CUDA conformance mode (``TP_FUSE_STRICT_CUDA=1``): CUDA's ``_scaled_mm`` rules
and NCCL's collective rules, each rule on its own, and in multi-rank use on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_fuse as te
from tp_fuse.comm.nccl_rules import check_collective, collective_violations
from tp_fuse.strict import STRICT_ENV, CudaConformanceError
from dist_utils import run_distributed
from tp_fuse import kernels
from tp_fuse.kernels import dispatch, gemm
from tp_fuse.kernels.cuda_rules import scaled_mm, scaled_mm_violations
from tp_fuse.ops.explanation import _plan_kernels

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CUDA = torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch, tp_settings):
    """A CUDA device with triton importable, of a chosen compute capability."""
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "triton X"))
    tp_settings(TP_FUSE_FP8_GEMM=None)

    def set_capability(cap):
        monkeypatch.setattr(dispatch, "cuda_capability", lambda device: cap)

    set_capability((9, 0))
    return set_capability


# ------------------------------------------------------------------ FP8 GEMM default on CUDA


def test_fp8_gemm_defaults_to_scaled_mm_on_cuda(fake_gpu):
    choice = dispatch.select_fp8_gemm_backend(CUDA)
    assert choice.backend == "torch" and choice.runnable
    assert "torch._scaled_mm (cuBLASLt) on sm_90: default on CUDA" in choice.reason
    assert kernels.planned_backend("fp8_gemm", CUDA, torch.bfloat16) == choice
    # The memory-bound kernels still take Triton on CUDA.
    assert kernels.planned_backend("quantize", CUDA, torch.bfloat16).backend == "triton"


def test_triton_gemm_only_by_explicit_choice(fake_gpu, tp_settings):
    assert dispatch.select_fp8_gemm_backend(CUDA, "triton").backend == "triton"
    tp_settings(TP_FUSE_FP8_GEMM="triton")
    choice = dispatch.select_fp8_gemm_backend(CUDA)
    assert choice.backend == "triton" and "TP_FUSE_FP8_GEMM=triton" in choice.reason
    tp_settings(TP_FUSE_FP8_GEMM="torch")
    choice = dispatch.select_fp8_gemm_backend(CUDA)
    assert choice.backend == "torch" and ": chosen;" in choice.reason
    # An invalid value is refused when the settings are read, before any GEMM runs.
    with pytest.raises(ValueError, match=r"TP_FUSE_FP8_GEMM: expected one of \('torch', 'triton'\), got 'cublas'"):
        tp_settings(TP_FUSE_FP8_GEMM="cublas")
    assert dispatch.select_fp8_gemm_backend(CUDA).backend == "torch"  # the refused value changed nothing


def test_gpus_without_fp8_tensor_cores_get_a_reason_not_a_crash_inside_cublas(fake_gpu, monkeypatch):
    fake_gpu((8, 0))  # A100
    choice = dispatch.select_fp8_gemm_backend(CUDA)
    assert not choice.runnable and "sm_80" in choice.reason and "TP_FUSE_FP8_GEMM=triton" in choice.reason
    fake_gpu((8, 9))  # Ada: FP8 tensor cores
    assert dispatch.select_fp8_gemm_backend(CUDA).runnable
    # A call that cannot run raises with the reason (checked through the CPU entry point).
    monkeypatch.setattr(dispatch, "select_fp8_gemm_backend", lambda *a, **k: dispatch.BackendChoice("torch", "no", False))
    a = torch.ones(16, 16).to(E4M3)
    with pytest.raises(RuntimeError, match="fp8_gemm: no"):
        gemm.fp8_gemm(a, a, torch.tensor(1.0), torch.tensor(1.0), torch.float32)


def test_explain_says_which_gemm_path_and_why(fake_gpu):
    seq = te.ops.Sequential(te.ops.Linear(32, 16))
    x = torch.randn(16, 32)
    with te.autocast():
        seq(x).sum().backward()
        text = str(te.explain(seq))
        plans = _plan_kernels(seq.fusers()[0], CUDA, torch.bfloat16)  # the plan for a (faked) H100
    assert "fp8_gemm=torch" in text and "torch: inputs on cpu: exact emulation of torch._scaled_mm" in text, text
    gemm_plans = [p for p in plans if p.kernel == "fp8_gemm"]
    assert gemm_plans and all(p.backend == "torch" and "cuBLASLt" in p.reason for p in gemm_plans)
    assert {p.backend for p in plans if p.kernel == "quantize"} == {"triton"}


# ------------------------------------------------------------------ CUDA _scaled_mm rules


def _operands(m=32, k=48, n=16, fa=E4M3, fb=E4M3):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(fa)
    b = torch.randn(n, k, generator=g).to(fb)
    return a, b.t(), torch.tensor(0.5), torch.tensor(2.0)  # mat2 = b.t(): column-major [K, N]


def test_a_conforming_call_has_no_violation_and_runs():
    a, bt, sa, sb = _operands()
    assert scaled_mm_violations(a, bt, sa, sb, torch.bfloat16, torch.zeros(16, dtype=torch.bfloat16)) == []
    rows = (torch.ones(32, 1), torch.ones(1, 16))  # row-wise scaling
    assert scaled_mm_violations(a, bt, *rows, torch.float32) == []
    assert scaled_mm_violations(a[:7], bt, sa, sb, torch.float32) == []  # M is free


@pytest.mark.parametrize("case, needle", [
    ("k", "K (40) and N (16) must be multiples of 16"),
    ("n", "K (48) and N (24) must be multiples of 16"),
    ("e5m2_pair", "e5m2 x e5m2"),
    ("mat1_col_major", "mat1 (32, 48) must be row-major"),
    ("mat2_row_major", "mat2 (48, 16) must be column-major"),
    ("scale_dtype", "scales: need both tensor-wise"),
    ("scale_mixed", "scales: need both tensor-wise"),
    ("rowwise_e5m2", "row-wise scaling: mat2 must be float8_e4m3fn"),
    ("out_f64", "out_dtype: must be one of"),
    ("bias_fp32_out", "bias: not supported with an fp32 output"),
    ("bias_fp32", "bias: must be bf16 or fp16, got torch.float32"),
    ("bias_mismatch", "bias: must be torch.float16 for a torch.float16 output"),
    ("bias_numel", "bias: must have N = 16 elements, got 8"),
])
def test_each_scaled_mm_rule(case, needle):
    a, bt, sa, sb = _operands()
    out, bias = torch.bfloat16, None
    if case == "k":
        a, bt, sa, sb = _operands(k=40)
    elif case == "n":
        a, bt, sa, sb = _operands(n=24)
    elif case == "e5m2_pair":
        a, bt, sa, sb = _operands(fa=E5M2, fb=E5M2)
    elif case == "mat1_col_major":
        a = a.t().contiguous().t()
    elif case == "mat2_row_major":
        bt = bt.contiguous()
    elif case == "scale_dtype":
        sa = sa.double()
    elif case == "scale_mixed":
        sa = torch.ones(32, 1)
    elif case == "rowwise_e5m2":
        a, bt, _, _ = _operands(fb=E5M2)
        sa, sb = torch.ones(32, 1), torch.ones(1, 16)
    elif case == "out_f64":
        out = torch.float64
    elif case == "bias_fp32_out":
        out, bias = torch.float32, torch.zeros(16, dtype=torch.bfloat16)
    elif case == "bias_fp32":
        bias = torch.zeros(16)
    elif case == "bias_mismatch":
        out, bias = torch.float16, torch.zeros(16, dtype=torch.bfloat16)
    elif case == "bias_numel":
        bias = torch.zeros(8, dtype=torch.bfloat16)
    issues = scaled_mm_violations(a, bt, sa, sb, out, bias)
    assert any(needle in i for i in issues), issues


def test_scaled_mm_checks_only_in_strict_mode(tp_settings):
    a, bt, sa, sb = _operands(k=40)
    tp_settings(**{STRICT_ENV: None})
    assert scaled_mm(a, bt, sa, sb, torch.float32).shape == (32, 16)  # CPU takes it
    tp_settings(**{STRICT_ENV: "1"})
    with pytest.raises(CudaConformanceError, match="TP_FUSE_STRICT_CUDA=1: CUDA's torch._scaled_mm would reject"):
        scaled_mm(a, bt, sa, sb, torch.float32)
    with pytest.raises(ValueError, match="TP_FUSE_STRICT_CUDA: expected 0 or 1, got 'yes'"):
        tp_settings(**{STRICT_ENV: "yes"})


@pytest.mark.parametrize("with_bias", [False, True])
def test_float64_output_takes_cudas_path_in_strict_mode(tp_settings, with_bias):
    """Found by strict mode: CUDA's _scaled_mm writes no float64; the kernel used to ask it
    to. The CUDA branch now runs the GEMM in fp32 and widens (bias added after)."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(16, 32, generator=g) * 4).to(E4M3)
    b = (torch.randn(48, 32, generator=g) * 4).to(E4M3)
    sa, sb = torch.tensor(0.25), torch.tensor(0.5)
    bias = torch.randn(48, generator=g, dtype=torch.float64) if with_bias else None
    tp_settings(**{STRICT_ENV: "1"})
    out, _ = kernels.fp8_gemm(a, b, sa, sb, torch.float64, bias=bias)
    assert out.dtype == torch.float64
    ref = (a.double() * 0.25) @ (b.double() * 0.5).t() + (0 if bias is None else bias)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)


def test_strict_mode_rejects_a_transposed_fp8_operand(tp_settings):
    a = torch.ones(16, 32).to(E4M3)
    w_t = torch.ones(32, 48).to(E4M3).t()  # [N, K] as a transposed view: not K-major
    sa = torch.tensor(1.0)
    tp_settings(**{STRICT_ENV: None})
    assert kernels.fp8_gemm(a, w_t, sa, sa, torch.float32)[0].shape == (16, 48)  # copied on CPU
    tp_settings(**{STRICT_ENV: "1"})
    with pytest.raises(CudaConformanceError, match="mat2 .* must be column-major"):
        kernels.fp8_gemm(a, w_t, sa, sa, torch.float32)


# ------------------------------------------------------------------ NCCL rules


def test_conforming_collectives_have_no_violation():
    x = torch.zeros(8, 4)
    assert collective_violations("all_reduce", [x], world_size=2, op=dist.ReduceOp.MAX) == []
    assert collective_violations("all_gather_flat", [x], [torch.zeros(16, 4)], world_size=2) == []
    assert collective_violations("reduce_scatter_flat", [x], [torch.zeros(4, 4)], world_size=2) == []
    assert collective_violations("all_to_all_single", [x], [torch.zeros(8, 4)], world_size=2) == []
    assert collective_violations("p2p", [x.to(E4M3)], [torch.zeros(8, 4, dtype=torch.uint8)], rank=0, peers=[1]) == []


@pytest.mark.parametrize("call, needle", [
    (lambda: collective_violations("all_reduce", [torch.zeros(4, dtype=torch.int16)], world_size=2),
     "dtype torch.int16 is not an NCCL data type"),
    (lambda: collective_violations("all_reduce", [torch.zeros(4, dtype=torch.int32)], world_size=2, op=dist.ReduceOp.BAND),
     "reduction BAND is not supported by NCCL"),
    (lambda: collective_violations("all_reduce", [torch.zeros(4).to(E4M3)], world_size=2),
     "NCCL does not reduce float8"),
    (lambda: collective_violations("all_reduce", [torch.zeros(4, dtype=torch.bool)], world_size=2, op=dist.ReduceOp.AVG),
     "cannot AVG bool"),
    (lambda: collective_violations("all_reduce", [torch.zeros(4, 4).t()[:2]], world_size=2),
     "dense contiguous"),
    (lambda: collective_violations("all_gather_flat", [torch.zeros(4)], [torch.zeros(6)], world_size=2),
     "NCCL needs world_size (2) x input (4)"),
    (lambda: collective_violations("reduce_scatter_flat", [torch.zeros(6)], [torch.zeros(4)], world_size=2),
     "NCCL needs world_size (2) x output (4)"),
    (lambda: collective_violations("all_to_all_single", [torch.zeros(3, 2)], [torch.zeros(3, 2)], world_size=2),
     "dim 0 of (3, 2) is not divisible by 2"),
    (lambda: collective_violations("all_gather_list", [torch.zeros(4)], [torch.zeros(4), torch.zeros(5)], world_size=2),
     "output 1 has shape (5,)"),
    (lambda: collective_violations("p2p", [torch.zeros(4)], [torch.zeros(4)], rank=1, peers=[1]),
     "rank 1 sends to / receives from itself"),
    (lambda: collective_violations("monitored_barrier", []), "monitored_barrier is gloo only"),
])
def test_each_nccl_rule(call, needle):
    issues = call()
    assert any(needle in i for i in issues), issues


def test_overlap_exchange_refuses_cuda_tensors_over_gloo(monkeypatch):
    # Regression (first GPU run, H200): gloo's send of a CUDA tensor died in gloo with
    # "writev ...: Bad address" after the peer had posted its half.
    from types import SimpleNamespace

    from tp_fuse.comm.overlap import _common

    cuda_tensor, group = SimpleNamespace(is_cuda=True), object()
    monkeypatch.setattr(_common.dist, "get_backend", lambda g: "gloo")
    with pytest.raises(ValueError, match="gloo cannot send or receive CUDA tensors"):
        _common._check_p2p_backend(cuda_tensor, group)
    _common._check_p2p_backend(torch.zeros(2), group)  # CPU tensors over gloo: fine
    monkeypatch.setattr(_common.dist, "get_backend", lambda g: "nccl")
    _common._check_p2p_backend(cuda_tensor, group)


def test_check_collective_raises_only_in_strict_mode(tp_settings):
    x = torch.zeros(4, dtype=torch.int16)
    tp_settings(**{STRICT_ENV: None})
    check_collective("all_reduce", [x], world_size=2)
    tp_settings(**{STRICT_ENV: "1"})
    with pytest.raises(CudaConformanceError, match="NCCL would reject this all_reduce: all_reduce input 0: dtype"):
        check_collective("all_reduce", [x], world_size=2)


def _strict_cases(rank: int, world: int) -> dict:
    """Each case on both ranks; returns what happened (the error text or "ok")."""
    from tp_fuse import comm, settings

    out = {}

    def record(name, fn):
        try:
            fn()
            out[name] = "ok"
        except ValueError as exc:  # CudaConformanceError is a ValueError
            out[name] = f"{type(exc).__name__}: {exc}"

    group = dist.group.WORLD
    band = dist.ReduceOp.BAND  # gloo computes bitwise reductions, NCCL has none
    with settings.override(**{STRICT_ENV: None}):
        record("BAND all_reduce, not strict",
               lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), group, op=band))
    with settings.override(**{STRICT_ENV: "1"}):
        _strict_cases_on(rank, group, out, record)
    return out


def _strict_cases_on(rank: int, group, out: dict, record) -> None:
    """The strict-mode cases of :func:`_strict_cases`."""
    from tp_fuse import comm
    from tp_fuse.comm.overlap._common import exchange, wait_all

    peer = 1 - rank
    band = dist.ReduceOp.BAND
    record("BAND all_reduce, strict", lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), group, op=band))
    # Ranks pass different shapes: strict mode turns the cross-rank shape check on.
    record("all_gather shapes differ", lambda: comm.all_gather_dim0(torch.ones(2 + rank, 4), group))
    # Both ranks receive into a buffer of the wrong size: each finds out before the transfer.
    record("p2p sizes differ", lambda: wait_all(exchange(torch.ones(4), peer, torch.empty(5), peer, group)))
    record("p2p sizes agree", lambda: wait_all(exchange(torch.ones(4), peer, torch.empty(4), peer, group)))
    record("fp8 all_gather as bytes", lambda: comm.all_gather_dim0(torch.ones(2, 4).to(E4M3).view(torch.uint8), group))
    # A non-contiguous shard (a transposed view) is gathered into contiguous buffers.
    from tp_fuse.layers.sharding import ShardSpec, gather_tensor

    shard = torch.arange(12.0).reshape(3, 4).t() + rank  # [4, 3], not contiguous
    record("gather_tensor of a transposed shard", lambda: out.__setitem__(
        "gathered", gather_tensor(shard, ShardSpec(dim=0), group)))


@pytest.mark.multirank
def test_strict_mode_on_two_gloo_ranks():
    results = run_distributed(2, _strict_cases, timeout=120)
    for r in results:
        assert r["BAND all_reduce, not strict"] == "ok"  # gloo takes it...
        assert "reduction BAND is not supported by NCCL" in r["BAND all_reduce, strict"]  # ...NCCL would not
        assert r["p2p sizes agree"] == "ok" and r["fp8 all_gather as bytes"] == "ok"
        assert r["gather_tensor of a transposed shard"] == "ok"
        base = torch.arange(12.0).reshape(3, 4).t()
        assert torch.equal(r["gathered"], torch.cat([base, base + 1]))
        # Different shapes on the ranks: every rank raises before the all-gather.
        assert "ranks disagree on the input shape/dtype" in r["all_gather shapes differ"]
        assert r["p2p sizes differ"].startswith("CudaConformanceError")
    assert "rank 1 sends (4,) torch.float32 but rank 0 receives into (5,) torch.float32" in results[0]["p2p sizes differ"]
