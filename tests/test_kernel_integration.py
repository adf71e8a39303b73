"""Ops run through tp_fuse.kernels: which path ran (and explain's plan), the norm -> FP8 linear
fusion, and the kernel torch-path contracts the ops rely on (float64, dbias like Bias,
transposes seeding the Float8Tensor cache)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import tp_fuse as te
from tolerances import assert_close
from tp_fuse import kernels
from tp_fuse.kernels import dispatch, record_kernel_paths
from tp_fuse.kernels.testing import max_fp8_ulp_distance
from tp_fuse.ops.basic import GELU, BasicLinear, Bias, LayerNorm, RMSNorm, SwiGLU
from tp_fuse.ops.fused import ForwardLinearBiasActivation, ForwardNormQuantizeLinear
from tp_fuse.quantization import DelayedScalingQuantizer, Float8Tensor, autocast
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

H, FFN, LEAD = 16, 32, (3, 5)
RECIPES = [DelayedScaling(), Float8CurrentScaling()]


def _randn(shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1])).to(p.dtype))


def _mlp(device="cpu", dtype=torch.float32) -> te.ops.Sequential:
    """Every op that calls a kernel: both norms, GELU, SwiGLU, linears (FP8: quantize, fp8_gemm)."""
    seq = te.ops.Sequential(
        LayerNorm(H, device=device, dtype=dtype),
        te.ops.Linear(H, FFN, device=device, dtype=dtype),
        GELU(),
        te.ops.Linear(FFN, H, device=device, dtype=dtype),
        RMSNorm(H, device=device, dtype=dtype),
        te.ops.Linear(H, FFN, device=device, dtype=dtype),
        SwiGLU(),
    )
    _randomize(seq)
    return seq


def _step(seq, x, recipe=None):
    """Forward + backward (under ``recipe`` when given); returns the recorded kernel calls."""
    x = x.detach().clone().requires_grad_()
    with record_kernel_paths() as log:
        if recipe is None:
            y = seq(x)
        else:
            with autocast(recipe=recipe):
                y = seq(x)
        y.backward(torch.ones_like(y))
    return log


def _planned(seq, recipe=None):
    if recipe is None:
        return te.explain(seq)
    with autocast(recipe=recipe):
        return te.explain(seq)


# ---- which path ran, and explain says so beforehand ------------------------------


@pytest.mark.parametrize("recipe", [None, *RECIPES], ids=["hp", "delayed", "current"])
def test_ops_take_the_torch_path_on_cpu_and_explain_plans_it(recipe):
    seq = _mlp()
    exp = _planned(seq, recipe)
    log = _step(seq, _randn((*LEAD, H)), recipe)
    ran = {c.kernel for c in log.calls}
    expected = {"layernorm_fwd", "gelu_fwd", "dgelu_dbias", "rmsnorm_fwd", "swiglu_fwd", "dswiglu"}
    if recipe is not None:
        expected |= {"quantize", "fp8_gemm"}
    if isinstance(recipe, DelayedScaling):
        expected.add("delayed_scale_update")  # one per direction, for every quantizer
    assert ran == expected, log
    assert set(log.backends()) == {"torch"}
    assert all("cpu" in c.device and "CUDA" in c.reason for c in log.calls)
    # explain planned exactly the kernels that then ran, each on the path that ran.
    assert {p.kernel for p in exp.kernels} == ran
    assert {p.backend for p in exp.kernels} == {"torch"}
    text = str(exp)
    assert "kernels:" in text and "layernorm_fwd=torch" in text and "dgelu_dbias=torch" in text


def test_explain_plans_torch_for_float64_even_where_triton_would_run(monkeypatch):
    # The plan applies the dtype rule: the Triton kernels are fp32/bf16/fp16 only.
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "triton X"))
    cuda = torch.device("cuda")
    assert kernels.planned_backend("gelu_fwd", cuda, torch.bfloat16).backend == "triton"
    choice = kernels.planned_backend("gelu_fwd", cuda, torch.float64)
    assert choice.backend == "torch" and "float64" in choice.reason
    # An explicit Triton request for float64 is a user error, not a silent torch run.
    monkeypatch.setattr(dispatch, "triton_interpreted", lambda: True)
    with pytest.raises(ValueError, match="float64"):
        kernels.gelu_fwd(torch.randn(2, 4, dtype=torch.float64), backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.skipif(not dispatch.triton_status()[0], reason="triton is not installed")
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["hp", "delayed"])
def test_ops_take_the_triton_path_on_cuda(recipe):
    seq = _mlp(device="cuda", dtype=torch.bfloat16)
    exp = _planned(seq, recipe)
    log = _step(seq, _randn((16, H), torch.bfloat16).cuda(), recipe)
    # The FP8 GEMM takes torch._scaled_mm by default on CUDA; every other kernel Triton.
    assert {(c.kernel, c.backend) for c in log.calls} == {(c.kernel, "torch" if c.kernel == "fp8_gemm" else "triton")
                                                          for c in log.calls}, log.calls
    assert {(p.kernel, p.backend) for p in exp.kernels} == {(c.kernel, c.backend) for c in log.calls}
    assert {p.kernel for p in exp.kernels} == {c.kernel for c in log.calls}


# ---- [norm, BasicLinear] writes FP8 in the norm ------------------------------------


def _norm_linear(norm_cls, consumer: str, dtype):
    ops = [norm_cls(H, dtype=dtype), BasicLinear(H, FFN, dtype=dtype)]
    if consumer == "linear+bias+gelu":
        ops += [Bias(FFN, dtype=dtype), GELU()]
    seq = te.ops.Sequential(*ops)
    _randomize(seq, seed=1)
    return seq


def _run(fn, params, x, dy, recipe):
    leaf = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    with autocast(recipe=recipe):
        y = fn(leaf)
    y.backward(dy)
    return [y.detach(), leaf.grad, *[p.grad.clone() for p in params]]


def _unfused(seq):
    ops = list(seq)

    def run(x):
        for op in ops:  # each op in its own one-op fuser: nothing fuses
            x = op(x)
        return x

    return run


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize("norm_cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("consumer", ["linear", "linear+bias+gelu"])
def test_norm_linear_fusion_is_bit_exact_in_fp32(recipe, norm_cls, consumer):
    fused_seq = _norm_linear(norm_cls, consumer, torch.float32)
    unfused_seq = copy.deepcopy(fused_seq)
    x = _randn((*LEAD, H), seed=2, scale=3.0) + 0.5
    dy = _randn((*LEAD, FFN), seed=3)
    # Two steps: the second quantizes with the scale the first step's amax produced.
    for _ in range(2):
        fused = _run(fused_seq, list(fused_seq.parameters()), x, dy, recipe)
        unfused = _run(_unfused(unfused_seq), list(unfused_seq.parameters()), x, dy, recipe)
        for a, b in zip(fused, unfused):
            assert torch.equal(a, b)
    (fuser,) = fused_seq.fusers()
    assert isinstance(fuser.forward_ops[0][0], ForwardNormQuantizeLinear), fuser.forward_ops
    if consumer != "linear":
        assert isinstance(fuser.forward_ops[0][0].linear_op, ForwardLinearBiasActivation)
    # The linear's input quantizer saw the same amaxes (recorded and tracked: its
    # delayed scale moved off 1.0 identically in both models).
    q_fused = fused_seq[1]._quantizers.quantizers["input"]
    q_unfused = unfused_seq[1]._quantizers.quantizers["input"]
    assert torch.equal(q_fused.scale, q_unfused.scale) and torch.equal(q_fused.last_amax, q_unfused.last_amax)
    if isinstance(q_fused, DelayedScalingQuantizer):
        assert q_fused.scale.item() != 1.0
        assert torch.equal(q_fused.amax_history, q_unfused.amax_history)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
def test_norm_linear_fusion_writes_the_bytes_the_quantizer_would(recipe):
    seq = _norm_linear(LayerNorm, "linear", torch.float32)
    ln, linear = seq[0], seq[1]
    x = _randn((*LEAD, H), seed=4)
    rows = math.prod(LEAD)
    saved = []

    def pack(t):
        if isinstance(t, Float8Tensor) and tuple(t.shape) == (rows, H):  # the GEMM input
            saved.append(t)
        return t

    with autocast(recipe=recipe):
        q = linear.fp8_quantizers()["input"]
        if isinstance(q, DelayedScalingQuantizer):
            q.scale.fill_(20.0)  # this step's scale, as an earlier step's update would set it
        ref_q = copy.deepcopy(q)
        with torch.no_grad():
            y = torch.nn.functional.layer_norm(x, (H,), ln.weight, ln.bias, ln.eps)
        expected = ref_q.quantize(y.reshape(rows, H))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            seq(x.clone().requires_grad_())
        assert isinstance(seq.fusers()[0].forward_ops[0][0], ForwardNormQuantizeLinear)
    (got,) = saved
    assert torch.equal(got._data.view(torch.uint8), expected._data.view(torch.uint8))
    assert torch.equal(got._scale_inv, expected._scale_inv)


@pytest.mark.parametrize("norm_cls", [LayerNorm, RMSNorm])
def test_norm_linear_fusion_in_bf16_is_within_one_fp8_step(norm_cls):
    seq = _norm_linear(norm_cls, "linear+bias+gelu", torch.bfloat16)
    ref = copy.deepcopy(seq)
    recipe = Float8CurrentScaling()
    x = _randn((*LEAD, H), torch.bfloat16, seed=6)
    rows = math.prod(LEAD)
    outs, inputs = [], []

    def pack(t):
        if isinstance(t, Float8Tensor) and tuple(t.shape) == (rows, H):  # the GEMM input
            inputs.append(t._fp8)
        return t

    for fn in (seq, _unfused(ref)):
        with autocast(recipe=recipe), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs.append(fn(x.clone().requires_grad_()).detach())
    assert isinstance(seq.fusers()[0].forward_ops[0][0], ForwardNormQuantizeLinear)
    # One rounding (fp32 -> FP8) instead of two (fp32 -> bf16 -> FP8), and the scale from
    # the unrounded amax: the GEMM input moves by at most one E4M3 step.
    fused_x8, unfused_x8 = inputs
    assert max_fp8_ulp_distance(fused_x8, unfused_x8) <= 1
    assert_close(outs[0], outs[1].double(), key="fp8_e4m3")


def test_norm_linear_fusion_rejected_without_fp8_with_reason():
    seq = _norm_linear(LayerNorm, "linear", torch.float32)
    exp = seq.explain()
    reasons = [r.reason for r in exp.records if not r.fused and r.fusion == "fuse_forward_norm_quantize_linear"]
    assert reasons == ["no FP8 recipe: nothing to quantize"]
    assert not any("ForwardNormQuantizeLinear" in op for op in exp.forward_ops)
    # And with FP8 on, explain reports the fusion.
    with autocast(recipe=DelayedScaling()):
        exp = seq.explain()
    assert any(r.fused and r.fusion == "fuse_forward_norm_quantize_linear" for r in exp.records), str(exp)


def test_norm_linear_fusion_rejects_a_size_mismatch_and_the_basic_op_reports_it():
    seq = te.ops.Sequential(LayerNorm(H), BasicLinear(H + 1, FFN))
    with autocast(recipe=DelayedScaling()):
        exp = seq.explain()
        assert any("does not match BasicLinear in_features=17" in r.reason for r in exp.records), str(exp)
        with pytest.raises(ValueError, match="BasicLinear: expected input with last dimension in_features=17"):
            seq(torch.randn(4, H))


# ---- kernel contracts the ops rely on ---------------------------------------------


def test_dgelu_dbias_takes_float64_and_sums_dbias_like_bias():
    x = _randn((7, 13), torch.float64, seed=8, scale=3.0)
    g = _randn((7, 13), torch.float64, seed=9)
    dx, dbias, amax = kernels.dgelu_dbias(g, x)
    assert dx.dtype == dbias.dtype == torch.float64
    x64 = x.clone().requires_grad_()
    u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)
    (ref,) = torch.autograd.grad(0.5 * x64 * (1 + torch.tanh(u)), x64, g)
    assert_close(dx, ref)  # float64 tolerance: computed in float64
    bias = Bias(13, dtype=torch.float64)
    assert torch.equal(dbias, bias.bias_grad(dx))
    assert amax.dtype == torch.float32 and amax.item() == dx.abs().max().float().item()
    for dtype in (torch.float32, torch.bfloat16):
        dx, dbias, _ = kernels.dgelu_dbias(g.to(dtype), x.to(dtype))
        assert torch.equal(dbias, Bias(13, dtype=dtype).bias_grad(dx))


def test_dgelu_negative_tail_keeps_relative_accuracy():
    # aten's tanh-form backward cancels below x ~ -3; the torch path recomputes that tail.
    x = torch.tensor([-9.0, -6.0, -5.0, -4.0, -3.5, -2.0, 0.5, 3.0])
    dx, _, _ = kernels.dgelu_dbias(torch.ones_like(x), x)
    x64 = x.double().requires_grad_()
    y = x64 * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3))
    (ref,) = torch.autograd.grad(y.sum(), x64)
    torch.testing.assert_close(dx.double(), ref, rtol=1e-5, atol=0.0)


def test_with_amax_false_skips_the_amax_only():
    x = _randn((5, 8), seed=10)
    y, a = kernels.gelu_fwd(x)
    y2, a2 = kernels.gelu_fwd(x, with_amax=False)
    assert a2 is None and torch.equal(y, y2) and a.item() == y.abs().max().item()
    w, b = torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    yb, _, rstd, none = kernels.layernorm_fwd(x.bfloat16(), w, b, 1e-5, with_amax=False)
    assert none is None and rstd.dtype == torch.float32
    assert_close(yb, torch.nn.functional.layer_norm(x.double(), (8,)))


def test_quantizer_transpose_fills_the_float8_cache():
    q = DelayedScalingQuantizer(DelayedScaling(), "input")
    x = _randn((6, 4), seed=11)
    with record_kernel_paths() as log:
        f = q.quantize(x, transpose=True)
    assert log.backends("quantize") == ["torch"]
    cached = f._transpose_cache[1]
    assert f.transpose_data() is cached  # no second pass over the FP8 bytes
    assert torch.equal(cached.view(torch.uint8), f._data.t().contiguous().view(torch.uint8))
    assert q.amax_history[0].item() == x.abs().max().item()
    f.mul_(2.0)  # an in-place write still invalidates the seeded cache
    assert f.transpose_data() is not cached
    assert q.quantize(x)._transpose_cache is None


def test_basic_linear_fp8_gemms_go_through_the_kernels():
    linear = BasicLinear(H, FFN)
    x = _randn((4, H), seed=12).requires_grad_()
    with record_kernel_paths() as log:
        with autocast(recipe=DelayedScaling()):
            y = linear(x)
        y.sum().backward()
    # fprop, dgrad, wgrad GEMMs; input, weight and grad_output casts; the forward and
    # backward scale updates.
    assert log.counts() == {("fp8_gemm", "torch"): 3, ("quantize", "torch"): 3, ("delayed_scale_update", "torch"): 2}
    assert_close(y, x.double() @ linear.weight.double().t(), key="fp8_hybrid")
    assert_close(x.grad, torch.ones(4, FFN, dtype=torch.float64) @ linear.weight.double(), key="fp8_hybrid")
