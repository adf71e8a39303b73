"""tp_fuse.debug: feature routing, statistics, DisableFP8GEMM/FakeQuant numerics, fusion, errors."""

from __future__ import annotations

import pytest
import torch

import tp_fuse as te
from dist_utils import run_distributed
from tp_fuse.debug import DebugFeature, DebugSession, Fp8StatsCollector, StatsBuffer
from tp_fuse.debug.stats import tensor_components
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling


def _linear(seed: int = 0, n_in: int = 32, n_out: int = 64) -> te.ops.Sequential:
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.BasicLinear(n_in, n_out, userbuffers_options={"comm_name": "fc1"}))


def _mlp(seed: int = 0) -> te.ops.Sequential:
    torch.manual_seed(seed)
    return te.ops.Sequential(
        te.ops.Linear(32, 64, userbuffers_options={"comm_name": "fc1"}), te.ops.GELU(),
        te.ops.Linear(64, 32, userbuffers_options={"comm_name": "fc2"}),
    )


def _run(model, x, g, recipe=None):
    """y, dx, dW of the first BasicLinear for loss = sum(y * g)."""
    x = x.detach().clone().requires_grad_()
    if recipe is None:
        y = model(x)
    else:
        with te.autocast(recipe=recipe):
            y = model(x)
    (y * g).sum().backward()
    w = next(model.parameters())
    return y.detach(), x.grad, w.grad


def _section(layers: str, features: dict) -> dict:
    return {"sec": {"layers": {"layer_name_regex_pattern": layers}, "transformer_engine": features}}


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=gen), torch.randn(16, 64, generator=gen)


@pytest.mark.parametrize("gemms", [["fprop", "dgrad", "wgrad"], ["fprop"], ["dgrad"], ["wgrad"], ["dgrad", "wgrad"]])
def test_disable_fp8_gemm_runs_exactly_the_high_precision_gemm(data, gemms):
    x, g = data
    recipe = DelayedScaling()
    hp = _run(_linear(), x, g)
    fp8 = _run(_linear(), x, g, recipe)
    model = _linear()
    DebugSession(_section(r".*fc1", {"DisableFP8GEMM": {"gemms": gemms}})).attach(model)
    dbg = _run(model, x, g, recipe)
    for i, gemm in enumerate(("fprop", "dgrad", "wgrad")):
        expected = hp[i] if gemm in gemms else fp8[i]
        assert torch.equal(dbg[i], expected), gemm
    assert not torch.equal(hp[0], fp8[0])  # the FP8 path really differs, so the check means something


def test_layer_with_features_runs_unfused_the_others_fused():
    recipe = DelayedScaling()
    plain = _mlp()
    with te.autocast(recipe=recipe):
        plain_fwd = te.explain(plain).forward_ops
    # FP8 statistics collector only: no feature, so fusion is unchanged.
    observed = _mlp()
    Fp8StatsCollector().attach(observed)
    with te.autocast(recipe=recipe):
        assert te.explain(observed).forward_ops == plain_fwd
    # A feature on fc1: its windows are rejected with the reason, fc2 still fuses.
    model = _mlp()
    session = DebugSession(_section(r".*fc1", {"LogTensorStats": {"tensors": ["activation"], "stats": ["max"]}}))
    assert session.attach(model) == ["0.fc1"]
    with te.autocast(recipe=recipe):
        exp = te.explain(model)
    rejected = [r for r in exp.records if not r.fused and "debug features enabled on 0.fc1" in r.reason]
    assert rejected and all("BasicLinear[0]" in r.window for r in rejected)
    assert any(r.fused and r.window == "BasicLinear[3] Bias[4]" for r in exp.records)
    assert "BasicLinear[0]" in exp.forward_ops and "BasicLinear[0]" not in plain_fwd
    # ... and it computes the same as without the feature (it only observes).
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 32, generator=gen)
    assert torch.equal(model(x), plain(x))


def test_log_tensor_stats_values_and_frequency(data):
    x, g = data
    # "cur_amax" is TE's LogTensorStats name for the tensor's own max |x|.
    stats = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "amax", "cur_amax", "dynamic_range"]
    model = _linear()
    session = DebugSession(_section(".*", {"LogTensorStats": {
        "tensors": ["activation", "weight", "output", "gradient", "dgrad", "wgrad"], "stats": stats, "freq": 2}}))
    session.attach(model)
    for _ in range(3):  # iterations 0, 1, 2: freq 2 logs 0 and 2
        for p in model.parameters():
            p.grad = None
        y, dx, dw = _run(model, x, g)
        session.step()
    records = session.collect()
    assert [it for it, _ in records] == [0, 2]
    rec = records[-1][1]
    w = next(model.parameters()).detach()
    for name, t in (("activation", x), ("weight", w), ("output", y), ("gradient", g), ("dgrad", dx), ("wgrad", dw)):
        t = t.double()
        nz = t.abs()[t != 0]
        ref = {
            "min": t.min(), "max": t.max(), "mean": t.mean(), "std": t.std(), "l1_norm": t.abs().sum(),
            "l2_norm": t.norm(), "amax": t.abs().max(), "cur_amax": t.abs().max(), "dynamic_range": torch.log2(t.abs().max() / nz.min()),
        }
        for stat in stats:
            assert rec[f"debug/0.fc1/{name}/{stat}"] == pytest.approx(float(ref[stat]), rel=1e-9, abs=1e-12), (name, stat)
    assert session.collect() == []  # collected once


def _manual_fp8(x: torch.Tensor, scale: float, dtype=torch.float8_e4m3fn):
    fmax = torch.finfo(dtype).max
    q = (x * scale).clamp(-fmax, fmax).to(dtype).float() / scale
    n = x.numel()
    return {
        "underflows%": 100.0 * float(((x != 0) & (q == 0)).sum()) / n,
        "overflows%": 100.0 * float(((x * scale).abs() > fmax).sum()) / n,
        "mse": float((q.double() - x.double()).square().mean()),
        "scale_inv_min": 1.0 / scale,
        "scale_inv_max": 1.0 / scale,
    }


def test_log_fp8_tensor_stats_and_fp8_stats_collector_values():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32, generator=gen) * 300  # |x| > 448 overflows at scale 1 ...
    x[0, :8] = 1e-4  # ... and these underflow
    g = torch.randn(16, 64, generator=gen)
    stats = ["underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse"]
    model = _linear()
    session = DebugSession(_section(".*", {"LogFp8TensorStats": {"tensors": ["activation"], "stats": stats}}))
    session.attach(model)
    collector = Fp8StatsCollector()
    collector.attach(model)
    collector.active = True
    _run(model, x, g, DelayedScaling())  # first step: delayed scale is 1.0
    ((_, rec),) = session.collect()
    ref = _manual_fp8(x, 1.0)
    assert ref["underflows%"] > 0 and ref["overflows%"] > 0
    for stat in stats:
        assert rec[f"debug/0.fc1/activation/{stat}"] == pytest.approx(ref[stat], rel=1e-9)
    fp8 = collector.collect()
    assert fp8["fp8/0/fc1/input/underflow_pct"] == pytest.approx(ref["underflows%"], rel=1e-9)
    assert fp8["fp8/0/fc1/input/overflow_pct"] == pytest.approx(ref["overflows%"], rel=1e-9)
    assert fp8["fp8/0/fc1/input/mse"] == pytest.approx(ref["mse"], rel=1e-9)
    assert fp8["fp8/0/fc1/input/amax"] == pytest.approx(float(x.abs().max()))
    assert fp8["fp8/0/fc1/input/scale"] == 1.0
    # After the step's update the history holds this step's amax.
    assert fp8["fp8/0/fc1/input/amax_history_max"] == pytest.approx(float(x.abs().max()))
    assert {k.split("/")[3] for k in fp8} == {"input", "weight", "grad_output"}
    # Inactive: nothing is recorded.
    collector.active = False
    _run(model, x, g, DelayedScaling())
    assert collector.collect() == {}


def test_two_features_on_one_tensor_and_micro_batches_combine_correctly(data):
    x, g = data
    model = _linear()
    session = DebugSession(_section(".*", {
        "LogTensorStats": {"tensors": ["activation", "weight"], "stats": ["mean", "l2_norm"]},
        "LogFp8TensorStats": {"tensors": ["activation"], "stats": ["underflows%", "mse"]},
    }))
    session.attach(model)
    x2 = x * 3
    for xi in (x, x2):  # two micro-batches of one iteration
        _run(model, xi, g, DelayedScaling())
    ((_, rec),) = session.collect()
    both = torch.cat([x, x2]).double()
    # Each feature counts the elements once: the mean is that of both micro-batches.
    assert rec["debug/0.fc1/activation/mean"] == pytest.approx(float(both.mean()), rel=1e-9)
    assert rec["debug/0.fc1/activation/l2_norm"] == pytest.approx(float(both.norm()), rel=1e-9)
    # The weight is one tensor, whatever the number of micro-batches that used it.
    w = next(model.parameters()).detach().double()
    assert rec["debug/0.fc1/weight/l2_norm"] == pytest.approx(float(w.norm()), rel=1e-9)
    # Micro-batch 1 is cast with scale 1 (fresh delayed scaling), micro-batch 2 with the
    # scale updated from micro-batch 1's amax (each forward has its own autocast).
    scale2 = float(torch.tensor(448.0 / float(x.abs().max()), dtype=torch.float64).float())
    m1, m2 = _manual_fp8(x, 1.0), _manual_fp8(x2, scale2)
    assert rec["debug/0.fc1/activation/mse"] == pytest.approx((m1["mse"] + m2["mse"]) / 2, rel=1e-6)


def test_fake_quant_feeds_the_gemm_fake_quantized_values(data):
    x, g = data
    model = _linear()
    DebugSession(_section(".*", {"FakeQuant": {
        "gemms_struct": [{"gemm": "fprop", "tensors": ["activation"]}], "quant_format": "FP8E4M3"}})).attach(model)
    y, dx, dw = _run(model, x, g, DelayedScaling())  # FakeQuant turns FP8 off for fprop
    w = next(model.parameters()).detach()
    scale = torch.tensor(448.0 / float(x.abs().max()), dtype=torch.float32)
    # Dequantized as TE's quantize/dequantize does it: times 1/scale (fp32).
    xq = (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * torch.reciprocal(scale)
    assert torch.equal(y, xq @ w.t())
    assert not torch.equal(y, x @ w.t())


def test_custom_feature_and_config_errors():
    calls = []

    class CountInputs(DebugFeature):
        """A user feature: counts the activations it sees."""

        options = frozenset({"note"})

        def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
            return True, iteration + 1

        def inspect_tensor(self, config, layer_name, tensor_name, tensor, *rest, **kw):
            calls.append((layer_name, tensor_name, tuple(tensor.shape), config["note"]))

    model = _mlp()
    session = DebugSession(_section(".*fc2", {"CountInputs": {"tensors": ["activation"], "note": "hi"}}),
                           feature_classes={"CountInputs": CountInputs})
    session.attach(model)
    model(torch.randn(4, 32))
    assert calls == [("2.fc2", "activation", (4, 64), "hi")]

    def err(cfg, match, model=None):
        with pytest.raises(ValueError, match=match):
            DebugSession(cfg).attach(model if model is not None else _mlp())

    err(_section(".*", {"Foo": {}}), r"sec.transformer_engine.Foo: unknown feature 'Foo'")
    err(_section(".*", {"LogTensorStats": {"tensors": ["activations"], "stats": ["max"]}}),
        r"LogTensorStats.tensors: unknown name\(s\) \['activations'\]")
    err(_section(".*", {"LogTensorStats": {"tensors": ["activation"], "stat": ["max"]}}),
        r"unknown option\(s\) \['stat'\] for LogTensorStats")
    err(_section(".*", {"LogTensorStats": {"tensors": ["activation"], "stats": ["median"]}}),
        r"unknown statistic\(s\) \['median'\]")
    err(_section(".*", {"DisableFP8GEMM": {}}), r"DisableFP8GEMM needs a gemms list")
    err(_section(".*", {"LogTensorStats": {"tensors": ["activation"], "stats": ["max"], "freq": 0}}),
        r"LogTensorStats.freq: expected an int >= 1")
    err(_section("layers\\.9", {"DisableFP8GEMM": {"gemms": ["fprop"]}}),
        r"section 'sec' matches no layer; layer names are: 0.fc1, 2.fc2")
    err({"sec": {"layers": {"layer_name_regex_pattern": "("}}}, r"sec.layers.layer_name_regex_pattern: invalid regex")
    err({"sec": {"layer": {}}}, r"sec: unknown key\(s\) \['layer'\]")
    # Two features modifying the same tensor is refused when it happens.
    both = {
        "a": {"layers": {"layer_types": ["fc1"]}, "transformer_engine": {
            "FakeQuant": {"tensors": ["activation"], "quant_format": "FP8E4M3"}}},
        "b": {"layers": {"layer_types": ["fc1"]}, "tp_fuse": {
            "Mod": {"tensors": ["activation"]}}},
    }

    class Mod(DebugFeature):
        def modify_tensor_enabled(self, *a):
            return True

        def modify_tensor(self, config, layer, gemm, tensor_name, tensor, *rest):
            return tensor

    model = _mlp()
    DebugSession(both, feature_classes={"FakeQuant": te.debug.FakeQuant, "Mod": Mod}).attach(model)
    with pytest.raises(ValueError, match=r"0.fc1: features FakeQuant and Mod both modify fprop/activation"):
        model(torch.randn(4, 32))


def test_log_fp8_stats_without_fp8_is_an_error(data):
    x, g = data
    model = _linear()
    DebugSession(_section(".*", {"LogFp8TensorStats": {"tensors": ["activation"], "stats": ["mse"]}})).attach(model)
    with pytest.raises(RuntimeError, match="no FP8 recipe in force"):
        _run(model, x, g)
    # Current scaling works, and reports the tensor's own scale.
    model = _linear()
    session = DebugSession(_section(".*", {"LogFp8TensorStats": {"tensors": ["activation"], "stats": ["scale_inv_max"]}}))
    session.attach(model)
    _run(model, x, g, Float8CurrentScaling())
    ((_, rec),) = session.collect()
    assert rec["debug/0.fc1/activation/scale_inv_max"] == pytest.approx(float(x.abs().max()) / 448.0, rel=1e-6)


def _multirank_stats(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(10 + rank)
    t = torch.randn(100, generator=gen) * (rank + 1)
    buf = StatsBuffer()
    stats = ["min", "max", "mean", "std", "l2_norm", "amax"]
    buf.add(5, "k", stats, tensor_components(t, {"min", "max", "sum", "sumsq", "numel", "amax"}))
    ((it, rec),) = buf.collect()
    everything = [torch.randn(100, generator=torch.Generator().manual_seed(10 + r)) * (r + 1) for r in range(world)]
    full = torch.cat(everything).double()
    ref = {"min": full.min(), "max": full.max(), "mean": full.mean(), "std": full.std(), "l2_norm": full.norm(),
           "amax": full.abs().max()}
    errs = {s: abs(rec[f"k/{s}"] - float(ref[s])) for s in stats}
    mismatch = StatsBuffer()
    mismatch.add(0, f"only-on-rank-{rank}", ["max"], tensor_components(t, {"max"}))
    try:
        mismatch.collect()
        mismatch_error = None
    except RuntimeError as exc:
        mismatch_error = str(exc)
    return {"iteration": it, "errs": errs, "mismatch": mismatch_error}


@pytest.mark.multirank
def test_statistics_combine_across_ranks():
    for res in run_distributed(2, _multirank_stats, timeout=120):
        assert res["iteration"] == 5
        assert all(e < 1e-9 for e in res["errs"].values()), res["errs"]
        assert "ranks recorded different statistics" in res["mismatch"]
