"""``autocast(gemms="auto")``: FP8 only for the Linears where it wins (issue 35, point 3).

Single process, CPU: the prior's rule, measured decisions with an injected clock (fake
times, no timing thresholds), a Linear the choice excludes running high precision bit for
bit beside one that runs FP8, ``gemms="all"`` unchanged, explain's and the launcher's text.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import tp_fuse as te
from tp_fuse.launch.api import compose
from tp_fuse.launch.startup import fp8_gemm_choice_lines, fp8_gemms_line
from tp_fuse.ops.compiled.basic import unsupported_reason
from tp_fuse.quantization.compile_state import recipe_key
from tp_fuse.quantization.gemm_choice import GemmChoice, decision_of, prior_rule, traced_gemms_auto
from tp_fuse.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling


class FakeClock:
    """Runs each candidate (so its CPU code is exercised) and reports fixed seconds."""

    def __init__(self, hp: float, fp8: float) -> None:
        self.seconds = {"hp": hp, "fp8": fp8}
        self.calls = {"hp": 0, "fp8": 0}

    def measure(self, label, fn):
        fn()
        self.calls[label] += 1
        return self.seconds[label]


def _state(recipe=None):
    return types.SimpleNamespace(recipe=recipe or DelayedScaling(), amax_reduction_group=None)


def _op(out_features, in_features):
    return types.SimpleNamespace(out_features=out_features, in_features=in_features)


# ---- the prior: torchao's tensorwise filter -------------------------------------------


@pytest.mark.parametrize("out_features, in_features, fp8", [
    (4096, 1024, False),   # both at the thresholds: high precision
    (4112, 1024, True),    # N one multiple of 16 past 4096
    (4096, 1040, True),    # K one multiple of 16 past 1024
    (16, 16, False),
    (128, 16384, True),
    (8192, 8192, True),
    (4100, 2048, False),   # N not a multiple of 16
    (8192, 1036, False),   # K not a multiple of 16
])
def test_prior_rule_at_its_boundary(out_features, in_features, fp8):
    got, why = prior_rule(out_features, in_features)
    assert got is fp8, why
    assert why.startswith("prior: ")


# ---- measured decisions: cached per shape, reused ---------------------------------------


def test_measured_decision_overrides_prior_and_is_cached_per_shape():
    clock = FakeClock(hp=2e-3, fp8=1e-3)  # FP8 twice as fast
    choice = GemmChoice(clock, warmup=0, repeats=3)
    op, state = _op(64, 48), _state()
    assert prior_rule(64, 48)[0] is False  # the prior alone would keep it in high precision
    x = torch.randn(32, 48)
    assert choice.runs_fp8(op, x, None, state) is True
    assert clock.calls == {"hp": 3, "fp8": 3}
    d = decision_of(op)
    assert (d.source, d.rows, d.out_features, d.in_features, d.ratio) == ("measured", 32, 64, 48, 0.5)
    assert "measured: FP8 step 0.50x the high-precision step" in d.reason
    # Same shape again (another tensor, another op with the same sizes): no measurement.
    for _ in range(3):
        assert choice.runs_fp8(_op(64, 48), torch.randn(32, 48), None, state) is True
    assert clock.calls == {"hp": 3, "fp8": 3}
    # A new M is a new shape: measured once more. So is another recipe kind.
    choice.runs_fp8(op, torch.randn(16, 48), None, state)
    assert clock.calls == {"hp": 6, "fp8": 6}
    choice.runs_fp8(op, torch.randn(16, 48), None, _state(Float8CurrentScaling()))
    assert clock.calls == {"hp": 9, "fp8": 9}
    assert choice.measured_count == 3 and len(choice.decisions) == 3
    # rows= overrides x's row count (an all-gather before the GEMM): a fourth shape.
    choice.runs_fp8(op, torch.randn(16, 48), 64, state)
    assert decision_of(op).rows == 64 and clock.calls["hp"] == 12


def test_measured_slower_fp8_runs_high_precision_where_the_prior_says_fp8():
    clock = FakeClock(hp=1e-3, fp8=1.5e-3)
    choice = GemmChoice(clock, warmup=0, repeats=2)
    op = _op(32, 1040)
    assert prior_rule(32, 1040)[0] is True
    assert choice.runs_fp8(op, torch.randn(16, 1040), None, _state()) is False
    assert decision_of(op).source == "measured" and decision_of(op).ratio == 1.5


def test_a_difference_within_the_noise_keeps_the_prior():
    # FP8 1 % faster; the tuner's noise floor is 2 %: the measurement cannot support it.
    clock = FakeClock(hp=1.01e-3, fp8=1e-3)
    choice = GemmChoice(clock, warmup=0, repeats=2)
    op = _op(64, 48)
    assert choice.runs_fp8(op, torch.randn(16, 48), None, _state()) is False
    assert "within the noise" in decision_of(op).reason


def test_unmeasured_cases_use_the_prior():
    # CPU without an injected clock: nothing to measure on.
    choice = GemmChoice()
    op = _op(64, 48)
    assert choice.runs_fp8(op, torch.randn(16, 48), None, _state()) is False
    assert decision_of(op).source == "prior" and "not measured on cpu: no FP8 hardware" in decision_of(op).reason
    # Block-scaled recipes have no timed FP8 step: the clock is never called.
    clock = FakeClock(hp=2e-3, fp8=1e-3)
    choice = GemmChoice(clock, warmup=0, repeats=2)
    assert choice.runs_fp8(op, torch.randn(16, 48), None, _state(Float8BlockScaling())) is False
    assert clock.calls == {"hp": 0, "fp8": 0}
    assert "no timed FP8 step for Float8BlockScaling" in decision_of(op).reason
    # M not a multiple of 16 (the backward GEMMs' N/K): _scaled_mm could not run the FP8 step.
    assert choice.runs_fp8(op, torch.randn(20, 48), None, _state()) is False
    assert clock.calls == {"hp": 0, "fp8": 0}
    assert "M, N and K must be positive multiples of 16" in decision_of(op).reason


# ---- in a model: excluded Linears run high precision, the others FP8 --------------------


def _models():
    torch.manual_seed(0)
    # K=64, N=256: the prior keeps it in high precision (LayerNorm -> Linear fuses under FP8).
    small = te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 256))
    # K=2048 > 1024: the prior runs it in FP8.
    large = te.ops.Linear(2048, 64)
    return small, large


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_excluded_linear_is_bitwise_high_precision_beside_an_fp8_one(recipe):
    small, large = _models()
    ref_small, ref_large = copy.deepcopy(small), copy.deepcopy(large)
    x1 = torch.randn(4, 8, 64, requires_grad=True)
    x2 = torch.randn(4, 8, 2048, requires_grad=True)
    r1 = x1.detach().clone().requires_grad_()
    r2 = x2.detach().clone().requires_grad_()
    y_ref = ref_small(r1)
    y_ref.sum().backward()
    with te.autocast(recipe=recipe, gemms="auto") as ctx:
        y1 = small(x1)
        y2 = large(x2)
        slots = sum(len(e.forward) for e in ctx._state.entries)
    (y1.sum() + y2.sum()).backward()
    # Forward and backward of the excluded Linear (and its norm) equal plain high precision.
    assert torch.equal(y1, y_ref) and torch.equal(x1.grad, r1.grad)
    for p, q in zip(small.parameters(), ref_small.parameters()):
        assert torch.equal(p.grad, q.grad)
    # It made no quantizers, so registered no amax slot; the FP8 Linear registered its two.
    assert small[1].basic_ops[0]._quantizers.quantizers == {}
    assert slots == (2 if isinstance(recipe, DelayedScaling) else 0)
    # The other Linear ran FP8: not the high-precision result.
    y2_ref = ref_large(r2)
    assert not torch.equal(y2, y2_ref)
    y2_ref.sum().backward()
    assert not torch.equal(x2.grad, r2.grad)
    assert set(large.basic_ops[0]._quantizers.quantizers) == {"input", "weight", "grad_output"}


def test_all_keeps_every_gemm_in_fp8():
    small, _ = _models()
    default, explicit = copy.deepcopy(small), copy.deepcopy(small)
    x = torch.randn(4, 8, 64)
    with te.autocast(recipe=DelayedScaling()) as ctx:
        assert ctx.gemm_choice is None  # the Python API's default is "all"
        y_default = default(x)
    with te.autocast(recipe=DelayedScaling(), gemms="all"):
        y_all = explicit(x)
    assert torch.equal(y_default, y_all)
    assert not torch.equal(y_all, small(x))  # FP8, although the prior would exclude it
    assert decision_of(explicit[1].basic_ops[0]) is None


def test_nested_autocast_inherits_or_overrides_gemms():
    with te.autocast(recipe=DelayedScaling(), gemms="auto") as outer:
        assert outer.gemm_choice is not None
        with te.autocast(recipe=DelayedScaling()) as inner:
            assert inner.gemm_choice is outer.gemm_choice
        with te.autocast(recipe=DelayedScaling(), gemms="all") as inner:
            assert inner.gemm_choice is None


def test_user_errors():
    with pytest.raises(ValueError, match=r"autocast: gemms: expected 'all', 'auto' or a GemmChoice, got 'fast'"):
        with te.autocast(recipe=DelayedScaling(), gemms="fast"):
            pass
    lin = te.ops.BasicLinear(64, 32)
    with te.autocast(recipe=DelayedScaling(), gemms="auto"):
        with pytest.raises(ValueError, match=r"depends on their shape: pass the GEMM input"):
            lin.fp8_quantizers()


def test_compiled_groups_run_eagerly_under_auto():
    lin = te.ops.BasicLinear(64, 32)
    key = recipe_key(DelayedScaling())
    with te.autocast(recipe=DelayedScaling(), gemms="auto"):
        assert traced_gemms_auto()
        assert "gemms='auto'" in unsupported_reason(lin, key)
    assert not traced_gemms_auto()
    with te.autocast(recipe=DelayedScaling()):
        assert unsupported_reason(lin, key) is None


# ---- what explain and the launcher say ----------------------------------------------------


def test_explain_says_which_gemms_run_fp8_and_why():
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 2048), te.ops.Linear(2048, 64))
    with te.autocast(recipe=DelayedScaling(), gemms="auto"):
        model(torch.randn(2, 16, 64)).sum().backward()
    text = str(te.ops.explain(model))
    assert "fp8 gemms (gemms=auto, last decision per Linear):" in text
    assert ("BasicLinear[1]: M=32 N=2048 K=64 DelayedScaling: high precision (prior: torchao's tensorwise "
            "filter keeps N=2048 <= 4096 and K=64 <= 1024 in high precision; not measured on cpu") in text
    assert ("BasicLinear[3]: M=32 N=64 K=2048 DelayedScaling: FP8 (prior: torchao's tensorwise filter runs FP8 "
            "(N=64 > 4096 or K=2048 > 1024)") in text
    assert "LayerNorm writes high precision: autocast(gemms='auto') keeps BasicLinear in high precision" in text


def test_launcher_fp8_gemms_field_and_lines():
    default = compose(["+model=gpt", "fp8=delayed"]).fp8
    assert default.gemms == "device"
    assert (default.gemms_on("cuda"), default.gemms_on("cpu")) == ("auto", "all")
    cfg = compose(["+model=gpt", "fp8=current", "fp8.gemms=auto"])
    assert cfg.fp8.gemms == "auto"
    with pytest.raises(ValueError, match=r"fp8\.gemms: expected one of 'device' \| 'all' \| 'auto', got 'aut'; did you mean 'auto'\?"):
        compose(["+model=gpt", "fp8=delayed", "fp8.gemms=aut"])
    with pytest.raises(ValueError, match=r"fp8\.gemms: expected one of 'device' \| 'all' \| 'auto', got 'fastest'"):
        compose(["+model=gpt", "fp8=delayed", "fp8.gemms=fastest"])
    cpu = torch.device("cpu")
    assert "torchao's tensorwise rule (the prior: nothing is measured on cpu" in fp8_gemms_line(cfg, cpu)
    assert "measured once per shape at the first step" in fp8_gemms_line(cfg, torch.device("cuda"))
    assert "every Linear's forward, dgrad and wgrad GEMMs run delayed FP8" in fp8_gemms_line(
        compose(["+model=gpt", "fp8=delayed"]), cpu)
    assert "FP8 GEMMs (fp8.gemms=device: all on cpu)" in fp8_gemms_line(compose(["+model=gpt", "fp8=delayed"]), cpu)
    assert "FP8 GEMMs (fp8.gemms=device: auto on cuda)" in fp8_gemms_line(
        compose(["+model=gpt", "fp8=delayed"]), torch.device("cuda"))
    assert fp8_gemms_line(compose(["+model=gpt"]), cpu) is None

    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([
        torch.nn.ModuleDict({"fc1": te.ops.Linear(64, 256), "fc2": te.ops.Linear(2048, 64)}) for _ in range(2)])})
    with te.autocast(recipe=DelayedScaling(), gemms="auto"):
        for layer in model["layers"]:
            layer["fc1"](torch.randn(8, 64))
            layer["fc2"](torch.randn(8, 2048))
    lines = fp8_gemm_choice_lines(model)
    assert lines[0] == "FP8 GEMMs chosen (fp8.gemms=auto): FP8 for 2 of 4 Linears, high precision for 2"
    assert lines[1].startswith("  M=8 N=256 K=64 DelayedScaling: high precision (prior: ")
    assert lines[1].endswith(": layers.0.fc1.basic_linear, layers.1.fc1.basic_linear")
    assert lines[2].startswith("  M=8 N=64 K=2048 DelayedScaling: FP8 (prior: ")


def test_timed_fp8_step_meets_cuda_gemm_rules(tp_settings):
    """The measured FP8 step passes CUDA's ``_scaled_mm`` rules (K-major operands, dims
    multiples of 16), checked on CPU in strict mode: on a GPU it would not raise mid-forward."""
    tp_settings(TP_FUSE_STRICT_CUDA="1")
    for recipe in (DelayedScaling(), Float8CurrentScaling()):
        clock = FakeClock(hp=2e-3, fp8=1e-3)
        assert GemmChoice(clock, warmup=1, repeats=1).runs_fp8(_op(64, 48), torch.randn(32, 48), None, _state(recipe))
        assert clock.calls == {"hp": 1, "fp8": 1}
