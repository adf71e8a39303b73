"""Float8Tensor, quantizers, fp8_gemm, autocast and FP8 parameters (single process).

References are float64; FP8 error bounds are the format's rounding bounds:
relative 2^-4 (E4M3) / 2^-3 (E5M2) in the normal range, half the smallest
subnormal spacing below it.
"""

from __future__ import annotations

import contextvars
import math
import threading

import pytest
import torch

from tp_fuse.strict import CudaConformanceError, strict_cuda_enabled
from tp_fuse.quantization import (
    CurrentScalingQuantizer,
    DelayedScalingQuantizer,
    Float8Tensor,
    OpQuantizers,
    active_autocast,
    autocast,
    fp8_gemm,
    is_fp8_parameter,
    make_fp8_parameter,
    model_init_recipe,
    quantized_model_init,
)
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Format

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# dtype -> (max, relative rounding bound in the normal range, half subnormal spacing)
FP8 = {E4M3: (448.0, 2.0**-4, 2.0**-10), E5M2: (57344.0, 2.0**-3, 2.0**-17)}
FMT_OF = {E4M3: Format.E4M3, E5M2: Format.E5M2}


def delayed_q(dtype: torch.dtype, scale: float = 1.0, role: str = "input") -> DelayedScalingQuantizer:
    q = DelayedScalingQuantizer(DelayedScaling(fp8_format=FMT_OF[dtype]), role)
    q.scale.fill_(scale)
    return q


def fp8_error_bound(x: torch.Tensor, dtype: torch.dtype, scale_inv: float) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x)) - x| (x within range)."""
    _, rel, half_sub = FP8[dtype]
    # 1e-6: fp32 rounding of x*scale and of scale_inv on top of the FP8 rounding.
    return torch.maximum(rel * x.abs(), torch.full_like(x, half_sub * scale_inv)) * (1 + 1e-6)


def log_uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    mag = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=gen))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return mag * sign


# ------------------------------------------------------------------ round trip
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_trip_relative_error_in_normal_range(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    fp8_max, rel, _ = FP8[dtype]
    lo = math.log2(torch.finfo(dtype).smallest_normal)
    x = log_uniform(4096, lo, math.log2(fp8_max), gen).float()
    for q in (delayed_q(dtype), CurrentScalingQuantizer(Float8CurrentScaling(fp8_format=FMT_OF[dtype]), "input")):
        xin = x if isinstance(q, DelayedScalingQuantizer) else x * 1e-3  # current scaling rescales
        out = q.quantize(xin)
        assert isinstance(out, Float8Tensor) and out.fp8_dtype == dtype and out.dtype == torch.float32
        err = ((out.dequantize(torch.float64) - xin.double()).abs() / xin.double().abs()).max().item()
        assert err <= rel * (1 + 1e-6), (q, err)
        assert err > rel / 4  # it really went through FP8


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturation_and_nan(dtype: torch.dtype) -> None:
    fp8_max = FP8[dtype][0]
    x = torch.tensor([2 * fp8_max, -10 * fp8_max, math.inf, -math.inf, math.nan, 1.0, 0.0])
    out = delayed_q(dtype).quantize(x).dequantize()
    assert out[:4].tolist() == [fp8_max, -fp8_max, fp8_max, -fp8_max]
    assert math.isnan(out[4].item()) and out[5:].tolist() == [1.0, 0.0]
    # With a scale: saturation happens in the scaled domain.
    q = delayed_q(dtype, scale=4.0)
    assert q.quantize(torch.tensor([fp8_max])).dequantize().item() == fp8_max / 4


def test_quantize_keeps_nominal_dtype_and_records_amax() -> None:
    q = delayed_q(E4M3, scale=2.0)
    x = torch.tensor([[0.5, -3.0], [1.0, 2.0]], dtype=torch.bfloat16)
    out = q.quantize(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 2) and out._scale_inv.item() == 0.5
    assert out.dequantize().dtype == torch.bfloat16 and out.dequantize(torch.float64).dtype == torch.float64
    q.quantize(torch.tensor([1.0]))
    assert q.amax_history[0].item() == 3.0  # max over the step's calls
    # scale_inv was captured at quantize time: a later scale change does not alter it.
    q.scale.fill_(8.0)
    assert out._scale_inv.item() == 0.5
    with pytest.raises(ValueError, match="floating-point"):
        q.quantize(torch.tensor([1, 2]))


# ------------------------------------------------------------------ Float8Tensor dispatch
def make_fp8(shape=(3, 4), seed: int = 0) -> tuple[torch.Tensor, Float8Tensor]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x, delayed_q(E4M3, scale=16.0).quantize(x)


def test_dispatch_fallback_runs_in_high_precision() -> None:
    _, f = make_fp8()
    ref = f.dequantize()
    assert type(f.sum()) is torch.Tensor and f.sum().item() == pytest.approx(ref.sum().item())
    torch.testing.assert_close(f + 1, ref + 1, rtol=0, atol=0)
    torch.testing.assert_close(f * f, ref * ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.zeros_like(f), torch.zeros(3, 4))
    assert type(torch.zeros_like(f)) is torch.Tensor
    assert f.double().dtype == torch.float64 and type(f.double()) is torch.Tensor
    assert "Float8Tensor" in repr(f) and "float8_e4m3fn" in repr(f)


def test_dispatch_view_transpose_detach_clone_stay_fp8() -> None:
    _, f = make_fp8()
    ref = f.dequantize()
    for out, expected in [
        (f.view(4, 3), ref.view(4, 3)),
        (f.reshape(12), ref.reshape(12)),
        (f.t(), ref.t()),
        (f.transpose(0, 1), ref.t()),
        (f.detach(), ref),
        (f.clone(), ref),
    ]:
        assert isinstance(out, Float8Tensor), type(out)
        assert out.fp8_dtype == E4M3
        torch.testing.assert_close(out.dequantize(), expected, rtol=0, atol=0)
    # view shares the bytes, clone does not
    assert f.view(12)._data.data_ptr() == f._data.data_ptr()
    assert f.clone()._data.data_ptr() != f._data.data_ptr()


def test_transpose_data_is_cached_and_invalidated_by_inplace_update() -> None:
    _, f = make_fp8((2, 3, 4))
    t1 = f.transpose_data()
    assert t1.shape == (4, 6) and t1.is_contiguous() and t1.dtype == E4M3
    assert f.transpose_data() is t1
    torch.testing.assert_close(f.transpose_fp8().dequantize(), f.dequantize().reshape(6, 4).t())
    alias = f.detach()
    alias.mul_(0.5)  # in place through an alias: re-quantized into the shared buffers
    t2 = f.transpose_data()
    assert t2 is not t1
    torch.testing.assert_close(t2.float(), f._fp8.reshape(6, 4).t().float())
    f._data.copy_(torch.zeros(2, 3, 4))  # a direct write is detected too
    assert (f.transpose_data().float() == 0).all()


def test_inplace_op_on_plain_float8_tensor_requantizes_with_own_scale() -> None:
    x, f = make_fp8()
    before = f.dequantize()
    out = f.add_(0.25)
    assert out is f and isinstance(f, Float8Tensor) and f._scale_inv.item() == 1 / 16
    bound = fp8_error_bound(before + 0.25, E4M3, 1 / 16)
    assert ((f.dequantize() - (before + 0.25)).abs() <= bound).all()
    f.copy_(torch.full((3, 4), 1e6))  # beyond range for scale 16: saturates
    assert (f.dequantize() == 448.0 / 16).all()


class _ScaleThenQuantize(torch.autograd.Function):
    """Test op returning a Float8Tensor: y = quantize(3 x); dx = 3 dy."""

    @staticmethod
    def forward(ctx, x, quantizer):  # noqa: ANN001
        return quantizer._quantize_impl(3 * x)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        assert type(dy) is torch.Tensor  # gradients reach us in high precision
        return 3 * dy, None


def test_autograd_through_float8_tensor_output_of_custom_function() -> None:
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    y = _ScaleThenQuantize.apply(x, delayed_q(E4M3, scale=8.0))
    assert isinstance(y, Float8Tensor) and y.requires_grad and y.dtype == torch.float64
    loss = (y * w).sum() + y.view(20).sum()
    loss.backward()
    torch.testing.assert_close(x.grad, 3 * (w.detach() + 1))
    torch.testing.assert_close(w.grad, y.dequantize().detach())
    # Quantizer.quantize is itself differentiable (straight-through) ...
    x.grad = None
    q8 = delayed_q(E4M3).quantize(x)
    q8.dequantize().mul(2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


# ------------------------------------------------------------------ current scaling
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_current_scaling_scale(power_2: bool, dtype: torch.dtype) -> None:
    fp8_max = FP8[dtype][0]
    recipe = Float8CurrentScaling(fp8_format=FMT_OF[dtype], power_2_scale=power_2)
    q = CurrentScalingQuantizer(recipe, "input")
    gen = torch.Generator().manual_seed(3)
    for amax in [3.7, 1e-3, 448.0 / 3, 12345.6, 2.0**-20]:
        x = torch.randn(64, generator=gen)
        x = x / x.abs().max() * amax
        a = x.abs().max().double().item()
        out = q.quantize(x)
        exact = fp8_max / a
        if power_2:
            expected = 2.0 ** math.floor(math.log2(exact))
        else:
            expected = torch.tensor(exact, dtype=torch.float32).item()
        assert q.scale.item() == expected and out._scale_inv.item() == pytest.approx(1 / expected, rel=1e-7)
        assert ((out.dequantize().double() - x.double()).abs() <= fp8_error_bound(x.double(), dtype, 1 / expected)).all()
    for bad, counter in [(0.0, "zero_amax_count"), (math.inf, "nonfinite_amax_count"), (math.nan, "nonfinite_amax_count")]:
        before = getattr(q, counter).item()
        q.quantize(torch.tensor([bad, 0.0]))
        assert q.scale.item() == 1.0 and getattr(q, counter).item() == before + 1
    stats = q.stats()
    assert stats["zero_amax_count"] == 1 and stats["nonfinite_amax_count"] == 2


# ------------------------------------------------------------------ fp8_gemm
# Odd shapes exercise the CPU kernel's generality; CUDA's _scaled_mm (and so strict mode,
# TP_FUSE_STRICT_CUDA=1) needs K and N multiples of 16.
ODD_SHAPES = pytest.param(
    (13, 37, 11), id="odd",
    marks=pytest.mark.skipif(strict_cuda_enabled(), reason="odd GEMM sizes: CPU only, CUDA's _scaled_mm rejects them"),
)


@pytest.mark.parametrize("mkn", [ODD_SHAPES, pytest.param((24, 48, 32), id="cuda-legal")])
@pytest.mark.parametrize(
    "a_dtype, b_dtype, with_bias, out_dtype",
    [
        (E4M3, E4M3, False, torch.float32),
        (E5M2, E4M3, False, torch.float32),
        (E4M3, E4M3, True, torch.float32),
        (E4M3, E5M2, True, torch.bfloat16),
        (E4M3, E4M3, False, torch.float64),
    ],
)
def test_fp8_gemm_matches_float64(mkn, a_dtype, b_dtype, with_bias: bool, out_dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    m, k, n = mkn
    a = torch.randn(m, k, generator=gen, dtype=torch.float64)
    b = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.05
    bias = torch.randn(n, generator=gen, dtype=torch.float64) if with_bias else None
    qa = CurrentScalingQuantizer(Float8CurrentScaling(fp8_format=FMT_OF[a_dtype]), "input")
    qb = delayed_q(b_dtype, scale=512.0, role="weight")
    a8, b8 = qa.quantize(a.float()), qb.quantize(b.float())
    out = fp8_gemm(a8, b8, out_dtype, bias=None if bias is None else bias.float())
    assert type(out) is torch.Tensor and out.dtype == out_dtype and out.shape == (m, n)
    bias64 = torch.zeros(n, dtype=torch.float64) if bias is None else bias
    # 1) against the float64 product of the dequantized operands: only output rounding.
    ref_deq = a8.dequantize(torch.float64) @ b8.dequantize(torch.float64).t() + bias64
    # The CPU kernel accumulates in fp32 whatever out_dtype is.
    out_eps = {torch.float32: 2e-6, torch.float64: 2e-6, torch.bfloat16: 2.0**-8}[out_dtype]
    scale_ref = (a8.dequantize(torch.float64).abs() @ b8.dequantize(torch.float64).abs().t()) + bias64.abs()
    assert ((out.double() - ref_deq).abs() <= out_eps * scale_ref + 1e-12).all()
    # 2) against the float64 product of the originals: FP8 rounding of both operands.
    ea = fp8_error_bound(a, a_dtype, a8._scale_inv.item())
    eb = fp8_error_bound(b, b_dtype, b8._scale_inv.item())
    bound = ea @ (b.abs() + eb).t() + a.abs() @ eb.t() + out_eps * scale_ref + 1e-12
    err = (out.double() - (a @ b.t() + bias64)).abs()
    assert (err <= bound).all()
    assert err.max() > 1e-4  # FP8, not a high-precision path


def test_fp8_gemm_handles_transposed_operands_and_validates() -> None:
    gen = torch.Generator().manual_seed(1)
    q = delayed_q(E4M3, scale=32.0)
    # M, K, N = 16, 32, 48: every GEMM dimension (wgrad's K is M) a multiple of 16.
    x8 = q.quantize(torch.randn(16, 32, generator=gen))
    w8 = q.quantize(torch.randn(48, 32, generator=gen))
    dy8 = q.quantize(torch.randn(16, 48, generator=gen))
    x, w, dy = (t.dequantize(torch.float64) for t in (x8, w8, dy8))
    torch.testing.assert_close(fp8_gemm(dy8, w8.transpose_fp8(), torch.float64), dy @ w)  # dgrad
    torch.testing.assert_close(fp8_gemm(dy8.transpose_fp8(), x8.transpose_fp8(), torch.float64), dy.t() @ x)
    if strict_cuda_enabled():
        # A transposed FP8 view is not K-major: on Hopper it would need a transpose copy
        # on every call; strict mode says so instead of copying.
        with pytest.raises(CudaConformanceError, match="mat2 .*must be column-major"):
            fp8_gemm(dy8, w8.t(), torch.float64)
    else:
        torch.testing.assert_close(fp8_gemm(dy8, w8.t(), torch.float64), dy @ w)  # non-contiguous view
    with pytest.raises(ValueError, match=r"a \[M, K\] and b \[N, K\].*\(16, 32\).*\(16, 48\)"):
        fp8_gemm(x8, dy8, torch.float32)
    with pytest.raises(ValueError, match="expected Float8Tensor operands.*Tensor shape"):
        fp8_gemm(x8, torch.randn(4, 5), torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm(x8, w8, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"bias: expected .* shape \(48,\)"):
        fp8_gemm(x8, w8, torch.float32, bias=torch.zeros(5))


# ------------------------------------------------------------------ OpQuantizers
def test_op_quantizers_reuse_and_rebuild() -> None:
    ops = OpQuantizers(("input", "weight", "grad_output"))
    r = DelayedScaling(amax_history_len=8)
    qs = ops.get(r)
    assert qs["input"].fp8_dtype == E4M3 and qs["weight"].fp8_dtype == E4M3
    assert qs["grad_output"].fp8_dtype == E5M2 and qs["grad_output"].fp8_max == 57344.0
    assert all(isinstance(q, DelayedScalingQuantizer) for q in qs.values())
    again = ops.get(r)
    same_fields = ops.get(DelayedScaling(amax_history_len=8))  # equal recipe, new object
    assert all(again[k] is qs[k] and same_fields[k] is qs[k] for k in qs)
    r.margin = 2  # edited in place: must rebuild
    rebuilt = ops.get(r)
    assert rebuilt["input"] is not qs["input"] and rebuilt["input"].margin == 2
    cur = ops.get(Float8CurrentScaling(fp8_format=Format.E4M3))
    assert isinstance(cur["grad_output"], CurrentScalingQuantizer) and cur["grad_output"].fp8_dtype == E4M3
    sentinel = object()
    assert ops.get(Float8CurrentScaling(fp8_format=Format.E4M3), sentinel)["input"].amax_reduction_group is sentinel
    with pytest.raises(ValueError, match="recipe"):
        ops.get("delayed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct"):
        OpQuantizers(("input", "input"))


# ------------------------------------------------------------------ autocast
class _TrackedOp(torch.autograd.Function):
    """Test op: y = dequant(quantize(x)); backward quantizes dy and tracks it."""

    @staticmethod
    def forward(ctx, x, qx, qg):  # noqa: ANN001
        state = active_autocast()
        ctx.qg, ctx.tracker = qg, state.backward_tracker
        y = qx.quantize(x)
        state.track_forward(qx)
        return y.dequantize()

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        ctx.tracker.track(ctx.qg)
        ctx.tracker.track(ctx.qg)  # idempotent within a pass
        return ctx.qg.quantize(dy).dequantize(), None, None


def test_autocast_updates_forward_at_exit_and_backward_at_end_of_pass() -> None:
    recipe = DelayedScaling(amax_history_len=4)
    qs = OpQuantizers(("input", "grad_output")).get(recipe)
    qx, qg = qs["input"], qs["grad_output"]
    x = torch.tensor([1.0, -7.0, 2.0], requires_grad=True)
    assert active_autocast() is None
    with autocast(recipe=recipe) as ctx:
        assert active_autocast() is ctx and ctx.recipe is recipe and ctx.amax_reduction_group is None
        y = _TrackedOp.apply(x, qx, qg)
        with autocast(recipe=DelayedScaling(amax_history_len=4)):  # nested: joins outer buffers
            y2 = _TrackedOp.apply(x * 2, qx, qg)
        assert qx.scale.item() == 1.0  # inner exit does not update
    assert active_autocast() is None
    assert qx.scale.item() == 448.0 / 14.0 and qx.amax_history[0].item() == 0.0
    assert qg.scale.item() == 1.0
    ((y + y2) * torch.tensor([3.0, 1.0, 1.0])).sum().backward()  # backward outside autocast
    assert qg.scale.item() == torch.tensor(57344.0 / 3.0).item() and qg.amax_history[-1].item() == 3.0
    assert qx.scale.item() == 448.0 / 14.0  # forward quantizer untouched by backward


def test_autocast_disabled_and_defaults_and_exception() -> None:
    with autocast() as ctx:
        assert ctx.recipe == DelayedScaling()
        with autocast(enabled=False):
            assert active_autocast() is None
        assert active_autocast() is ctx
    q = delayed_q(E4M3)
    with pytest.raises(RuntimeError, match="boom"):
        with autocast() as ctx:
            q.quantize(torch.tensor([2.0]))
            ctx.track_forward(q)
            raise RuntimeError("boom")
    assert q.scale.item() == 1.0 and q.amax_history[0].item() == 2.0  # no update on error
    with pytest.raises(ValueError, match="recipe"):
        with autocast(recipe="hybrid"):  # type: ignore[arg-type]
            pass
    with autocast(recipe=Float8CurrentScaling()) as ctx:
        cq = CurrentScalingQuantizer(Float8CurrentScaling(), "input")
        ctx.track_forward(cq)  # no-op for current scaling


def test_autocast_contexts_do_not_interfere_across_threads() -> None:
    r1, r2 = DelayedScaling(margin=1), Float8CurrentScaling()
    barrier = threading.Barrier(2)
    seen: dict[str, object] = {}

    def model(name: str, recipe) -> None:  # noqa: ANN001
        with autocast(recipe=recipe):
            barrier.wait()  # both threads inside their autocast at once
            seen[name] = active_autocast().recipe
            barrier.wait()
        seen[name + "_after"] = active_autocast()

    threads = [threading.Thread(target=model, args=a) for a in (("a", r1), ("b", r2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"a": r1, "b": r2, "a_after": None, "b_after": None}
    # Also within one thread: a copied context does not see a later autocast.
    snapshot = contextvars.copy_context()
    with autocast():
        assert snapshot.run(active_autocast) is None


# ------------------------------------------------------------------ FP8 parameters
def test_quantized_model_init_context() -> None:
    assert model_init_recipe() is None
    with quantized_model_init():
        assert model_init_recipe() == DelayedScaling()
        with quantized_model_init(enabled=False):
            assert model_init_recipe() is None
    r = Float8CurrentScaling()
    with quantized_model_init(recipe=r):
        assert model_init_recipe() is r
    assert model_init_recipe() is None


@pytest.mark.parametrize("foreach", [False, True, None])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8_parameter_trains_with_adamw(foreach, recipe) -> None:
    gen = torch.Generator().manual_seed(11)
    init = torch.randn(8, 6, generator=gen) * 0.05
    with quantized_model_init(recipe=recipe):
        quantizer = OpQuantizers(("weight",)).get(model_init_recipe())["weight"]
        module = torch.nn.Module()
        module.weight = make_fp8_parameter(init.clone(), quantizer)
    p = module.weight
    assert isinstance(p, torch.nn.Parameter) and isinstance(p, Float8Tensor) and is_fp8_parameter(p)
    assert [n for n, _ in module.named_parameters()] == ["weight"] and p.is_leaf and p.requires_grad
    ref = torch.nn.Parameter(init.clone())  # plain fp32 twin, same optimizer, same grads
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=foreach)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=foreach)
    x = torch.randn(5, 6, generator=gen)
    for _ in range(3):
        (x @ p.t()).square().sum().backward()
        ref.grad = p.grad.clone()  # the gradient is taken w.r.t. the FP8 value
        assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        # The optimizer's update landed on the master exactly as on a plain tensor ...
        torch.testing.assert_close(p.master, ref.detach(), rtol=0, atol=0)
        # ... and the FP8 bytes follow the master within FP8 error.
        bound = fp8_error_bound(p.master, E4M3, p._scale_inv.item())
        assert ((p.dequantize().detach() - p.master).abs() <= bound).all()
    assert (p.master - init).abs().max() > 1e-3  # it really trained
    assert all(type(s) is torch.Tensor for s in opt.state[p].values())


def _fp8_linear(seed: int) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(6, 4)
    q = OpQuantizers(("weight",)).get(DelayedScaling())["weight"]
    lin.weight = make_fp8_parameter(torch.randn(4, 6, generator=gen), q)
    return lin


def test_fp8_parameter_state_dict_deepcopy_and_module_conversion() -> None:
    import copy

    src, dst = _fp8_linear(0), _fp8_linear(1)
    dst.load_state_dict(src.state_dict())  # copy_ takes the source master: lossless
    assert torch.equal(dst.weight.master, src.weight.master) and is_fp8_parameter(dst.weight)
    twin = copy.deepcopy(src)
    assert is_fp8_parameter(twin.weight) and twin.weight.master is not src.weight.master
    assert torch.equal(twin.weight.dequantize(), src.weight.dequantize())
    twin.double()  # nominal dtype and master follow; the FP8 bytes stay
    w = twin.weight
    assert isinstance(w, torch.nn.Parameter) and isinstance(w, Float8Tensor)
    assert (w.dtype, w.master.dtype, w.fp8_dtype) == (torch.float64, torch.float64, E4M3)
    torch.testing.assert_close(w.dequantize(), src.weight.dequantize().double(), rtol=0, atol=0)
    # A plain Float8Tensor (activation) converts to a plain tensor instead.
    _, f = make_fp8()
    assert type(f.to(torch.float64)) is torch.Tensor


def test_view_ops_alias_fp8_bytes_so_writes_are_not_lost() -> None:
    _, f = make_fp8((4, 5))
    ref = f.dequantize()
    row, col = f[1], f[:, 2:4]
    assert isinstance(row, Float8Tensor) and isinstance(col, Float8Tensor)
    torch.testing.assert_close(row.dequantize(), ref[1], rtol=0, atol=0)
    torch.testing.assert_close(col.dequantize(), ref[:, 2:4], rtol=0, atol=0)
    torch.testing.assert_close(f.unsqueeze(0).permute(2, 1, 0).dequantize(), ref.unsqueeze(0).permute(2, 1, 0))
    parts = f.split(2)
    assert all(isinstance(p, Float8Tensor) for p in parts) and len(parts) == 2
    f[1].zero_()  # through a view: lands in f's bytes
    f[:, 0] = 0.5
    expected = ref.clone()
    expected[1] = 0.0
    expected[:, 0] = 0.5
    torch.testing.assert_close(f.dequantize(), expected, rtol=0, atol=0)
