"""FP8 recipes and delayed-scaling math against float64 hand-computed references."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from tp_fuse.quantization import DelayedScalingQuantizer, scaling
from tp_fuse.quantization.float8.delayed_scaling import update_delayed_quantizers
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
FP32_MAX = 3.4028234663852886e38


def f32(x: float) -> float:
    """Round a Python float to fp32, as the library stores scales."""
    return struct.unpack("f", struct.pack("f", x))[0] if math.isfinite(x) and abs(x) <= FP32_MAX else x


# ----------------------------------------------------------------------------- Format
def test_format_dtypes_and_maxima() -> None:
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert (Format.E4M3.fwd_dtype, Format.E4M3.bwd_dtype) == (e4, e4)
    assert (Format.E5M2.fwd_dtype, Format.E5M2.bwd_dtype) == (e5, e5)
    assert (Format.HYBRID.fwd_dtype, Format.HYBRID.bwd_dtype) == (e4, e5)
    assert (Format.HYBRID.fwd_max, Format.HYBRID.bwd_max) == (E4M3_MAX, E5M2_MAX)
    assert (Format.E4M3.fwd_max, Format.E4M3.bwd_max) == (E4M3_MAX, E4M3_MAX)
    assert (Format.E5M2.fwd_max, Format.E5M2.bwd_max) == (E5M2_MAX, E5M2_MAX)


# ----------------------------------------------------------------------------- recipes
def test_recipe_defaults_match_transformer_engine() -> None:
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
        0, Format.HYBRID, 1024, "max"
    )
    assert r.scaling_factor_compute_algo is None and r.reduce_amax is True
    assert r.delayed() and not r.float8_current_scaling() and isinstance(r, Recipe)
    c = Float8CurrentScaling()
    assert (c.fp8_format, c.power_2_scale) == (Format.HYBRID, False)
    assert c.float8_current_scaling() and not c.delayed()


def test_recipe_equality_is_fieldwise() -> None:
    assert DelayedScaling() == DelayedScaling()
    assert DelayedScaling(margin=1) != DelayedScaling()
    algo = lambda h: h.amax()  # noqa: E731
    assert DelayedScaling(amax_compute_algo=algo) == DelayedScaling(amax_compute_algo=algo)
    assert DelayedScaling(amax_compute_algo=algo) != DelayedScaling(amax_compute_algo=lambda h: h.amax())
    assert Float8CurrentScaling(power_2_scale=True) != Float8CurrentScaling()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"margin": -1}, "margin"),
        ({"margin": 1.5}, "margin"),
        ({"margin": True}, "margin"),
        ({"fp8_format": "E4M3"}, "fp8_format"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_history_len": 2.0}, "amax_history_len"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"scaling_factor_compute_algo": "pow2"}, "scaling_factor_compute_algo"),
        ({"reduce_amax": 1}, "reduce_amax"),
    ],
)
def test_delayed_scaling_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"DelayedScaling.{field}: expected .* got"):
        DelayedScaling(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"fp8_format": 3}, "fp8_format"), ({"power_2_scale": "yes"}, "power_2_scale")],
)
def test_current_scaling_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"Float8CurrentScaling.{field}: expected .* got"):
        Float8CurrentScaling(**kwargs)


# ----------------------------------------------------------------------------- references
def ref_amax(history: list[float], algo) -> float:
    if algo == "max":
        return math.nan if any(math.isnan(a) for a in history) else max(history)
    if algo == "most_recent":
        return history[0]
    return float(algo(torch.tensor(history, dtype=torch.float64)))


def ref_scale(amax: float, prev: float, fp8_max: float, margin: int) -> float:
    if not (math.isfinite(amax) and amax > 0):
        return prev
    return f32(min(fp8_max / amax / 2.0**margin, FP32_MAX))


def random_history(gen: torch.Generator, n: int) -> list[float]:
    """Positive amaxes over many binades, with 0, inf, nan and tiny values mixed in."""
    vals = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-20, 20, generator=gen))
    out = [f32(v) for v in vals.tolist()]
    specials = [0.0, math.inf, math.nan, 1e-44]
    for i in range(n):
        r = torch.rand((), generator=gen).item()
        if r < 0.25:
            out[i] = specials[int(torch.randint(len(specials), (), generator=gen))]
    return out


def _top2(h: torch.Tensor) -> torch.Tensor:
    # A custom algo: max of the two most recent slots.
    return h[:2].amax()


@pytest.mark.parametrize("algo", ["max", "most_recent", _top2])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fmt_max", [("fwd", E4M3_MAX), ("bwd", E5M2_MAX)])
def test_delayed_scale_matches_reference(algo, margin: int, fmt_max) -> None:
    role = "input" if fmt_max[0] == "fwd" else "grad_output"
    gen = torch.Generator().manual_seed(1234 + margin)
    recipe = DelayedScaling(margin=margin, amax_history_len=5, amax_compute_algo=algo)
    nonfinite = 0
    for _ in range(150):
        q = DelayedScalingQuantizer(recipe, role)
        prev = f32(float(torch.exp2(torch.empty(()).uniform_(-4, 4, generator=gen))))
        q.scale.fill_(prev)
        hist = random_history(gen, 5)
        q.amax_history.copy_(torch.tensor(hist))
        q.update()
        # This step's amax (slot 0) if NaN/inf is counted and recorded as 0: it never enters
        # the history (older slots are as given, to exercise the formula with specials).
        current_bad = not math.isfinite(hist[0])
        hist = [0.0 if current_bad else hist[0]] + hist[1:]
        amax = ref_amax(hist, algo)
        expected = ref_scale(amax, prev, fmt_max[1], margin)
        assert q.scale.item() == expected, (hist, amax, q.scale.item(), expected)
        nonfinite += current_bad or not math.isfinite(amax)
        assert q.nonfinite_amax_count.item() == int(current_bad or not math.isfinite(amax))
        assert (q.last_amax.item() == f32(amax)) or (math.isnan(amax) and q.last_amax.isnan())
        # History rolled: current (slot 0) moves to the end, oldest dropped, fresh slot 0.
        expected_hist = torch.tensor([0.0] + hist[2:] + hist[:1])
        torch.testing.assert_close(q.amax_history, expected_hist, equal_nan=True, rtol=0, atol=0)
    assert nonfinite > 10  # the random histories really exercised the guard


def test_scaling_factor_compute_algo_replaces_formula() -> None:
    calls = []

    def halve(amax, scale, fp8_max, recipe):
        calls.append((float(amax), float(scale), fp8_max, recipe.margin))
        return fp8_max / amax / 2

    recipe = DelayedScaling(margin=1, amax_history_len=2, scaling_factor_compute_algo=halve)
    q = DelayedScalingQuantizer(recipe, "weight")
    q.amax_history.copy_(torch.tensor([2.0, 1.0]))
    q.update()
    assert q.scale.item() == 448.0 / 2.0 / 2
    assert calls[-1] == (2.0, 1.0, 448.0, 1)
    # Non-finite / zero amaxes still keep the previous scale.
    prev = q.scale.item()
    q.amax_history.copy_(torch.tensor([math.inf, 0.0]))
    q.update()
    assert q.scale.item() == prev and q.nonfinite_amax_count.item() == 1
    q.amax_history.zero_()
    q.update()
    assert q.scale.item() == prev and q.nonfinite_amax_count.item() == 1


def test_bad_custom_algo_result_is_a_value_error() -> None:
    q = DelayedScalingQuantizer(DelayedScaling(amax_compute_algo=lambda h: h[:2]), "input")
    with pytest.raises(ValueError, match="amax_compute_algo result"):
        q.update()


def test_delayed_quantizer_over_steps() -> None:
    """Step loop: quantize (amax folded into slot 0, max over calls), update, repeat."""
    recipe = DelayedScaling(amax_history_len=3)
    q = DelayedScalingQuantizer(recipe, "input")
    assert q.scale.item() == 1.0 and q.amax_history.tolist() == [0.0, 0.0, 0.0]
    step_amaxes = [[2.0, 8.0], [4.0], [1.0, 0.5], [0.25]]
    seen: list[float] = []
    for amaxes in step_amaxes:
        for a in amaxes:
            x = torch.tensor([a, -a / 2, 0.0])
            scale_before = q.scale.item()
            out = q.quantize(x)
            assert out._scale_inv.item() == f32(1.0 / scale_before)
        assert q.amax_history[0].item() == max(amaxes)
        q.update()
        seen.append(max(amaxes))
        window = seen[-3:]
        assert q.scale.item() == f32(448.0 / max(window))
        assert q.amax_history[0].item() == 0.0
        assert q.amax_history[-1].item() == max(amaxes)
    stats = q.stats()
    assert stats["scale"] == q.scale.item() and stats["amax"] == 4.0
    assert stats["amax_history_max"] == 1.0 and stats["nonfinite_amax_count"] == 0


def test_scale_overflow_is_clamped_to_fp32_max() -> None:
    scale = scaling.delayed_scale(torch.tensor(1e-44), torch.tensor(1.0), E4M3_MAX, 0)
    assert scale.item() == f32(FP32_MAX) and math.isfinite(scale.item())


def test_round_down_to_power_of_2() -> None:
    vals = torch.tensor([1.0, 1.5, 2.0, 3.999, 0.3, 448.0 / 3.0, 2.0**-130])
    got = scaling.round_down_to_power_of_2(vals)
    expected = [2.0 ** math.floor(math.log2(v)) for v in vals.double().tolist()]
    assert got.tolist() == expected


@pytest.mark.parametrize("algos,margins", [(("max", "most_recent"), (0, 2)), (("max",), (0,)),
                                           (("most_recent",), (0,)), (("max",), (1,))],
                         ids=["mixed", "max", "most_recent", "max-margin"])
def test_batched_delayed_update_is_bit_identical_to_per_quantizer_update(algos, margins):
    """update_delayed_quantizers (one stacked update per step) == q.update() per quantizer,
    bit for bit, for both built-in amax algorithms (alone and mixed in one group), margins,
    forward/backward formats and NaN / inf / 0 / huge / tiny amaxes."""
    def build():
        qs = []
        for algo in algos:
            for margin in margins:
                recipe = DelayedScaling(margin=margin, amax_history_len=5, amax_compute_algo=algo)
                qs += [DelayedScalingQuantizer(recipe, role) for role in ("input", "grad_output")]
        return qs

    per_quantizer, batched = build(), build()
    amaxes = [0.5, float("nan"), float("inf"), 0.0, 3e38, 1e-30]
    for step in range(8):
        for i, (qa, qb) in enumerate(zip(per_quantizer, batched)):
            value = torch.tensor(amaxes[(i + step) % len(amaxes)] * (1 + step))
            qa.amax_history[0] = value
            qb.amax_history[0] = value
        for q in per_quantizer:
            q.update()
        update_delayed_quantizers(batched)
        for qa, qb in zip(per_quantizer, batched):
            for name in ("scale", "amax_history", "last_amax"):
                assert torch.equal(getattr(qa, name).view(torch.int32), getattr(qb, name).view(torch.int32)), name
            assert torch.equal(qa.nonfinite_amax_count, qb.nonfinite_amax_count)


def test_batched_update_keeps_state_in_shared_buffers_and_refuses_rebinding():
    """After a batched update the quantizers' tensors are rows of shared buffers (no
    per-step stacking); in-place loads go through them; a rebound tensor is refused."""
    recipe = DelayedScaling(amax_history_len=4)
    qs = [DelayedScalingQuantizer(recipe, role) for role in ("input", "weight", "grad_output")]
    ref = [DelayedScalingQuantizer(recipe, role) for role in ("input", "weight", "grad_output")]

    def step(value):
        for q in (*qs, *ref):
            q.amax_history[0] = value
        update_delayed_quantizers(qs)
        for q in ref:
            q.update()
        for q, r in zip(qs, ref):
            for name in ("scale", "amax_history", "last_amax", "nonfinite_amax_count"):
                assert torch.equal(getattr(q, name), getattr(r, name)), name

    step(2.0)
    state = qs[0]._shared_state
    assert all(q._shared_state is state for q in qs)
    assert qs[1].amax_history._base is state.hist and qs[2].scale._base is state.scale
    # A checkpoint load writes in place: the shared row sees it.
    with torch.no_grad():
        qs[1].scale.copy_(torch.tensor(0.5))
        ref[1].scale.copy_(torch.tensor(0.5))
    step(3.0)
    assert qs[0]._shared_state is state  # reused, not rebuilt
    step(float("nan"))
    step(7.0)
    assert qs[0]._shared_state is state  # static: never rebuilt
    # Rebinding a tensor after the first update is refused (graphs hold its address).
    qs[2].scale = qs[2].scale.clone()
    with pytest.raises(ValueError, match="rebound after its first scale update"):
        update_delayed_quantizers(qs)


def test_batched_update_of_some_members_equals_their_own_updates():
    """A step that uses only some members of a group (or adds new quantizers) updates
    exactly those, bit for bit as their own ``update()``, and leaves the others' rows alone."""
    recipes = [DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1,
                                                                  amax_compute_algo="most_recent")]
    roles = ("input", "weight", "grad_output")
    qs = [DelayedScalingQuantizer(r, role) for r in recipes for role in roles]
    ref = [DelayedScalingQuantizer(r, role) for r in recipes for role in roles]
    extra, extra_ref = DelayedScalingQuantizer(recipes[0], "input"), DelayedScalingQuantizer(recipes[0], "input")
    names = ("scale", "amax_history", "last_amax", "nonfinite_amax_count")
    steps = [(range(6), 3.0), ((0, 2, 5), 40.0), ((1, 3), float("inf")), ((0, 2, 5), 0.5), (range(6), 9.0)]
    for i, (used, value) in enumerate(steps):
        batch = [qs[j] for j in used] + ([extra] if i >= 2 else [])
        own = [ref[j] for j in used] + ([extra_ref] if i >= 2 else [])
        for q, r in zip(batch, own):
            q.amax_history[0] = value * (1 + q.fp8_max / 1000)
            r.amax_history[0] = value * (1 + r.fp8_max / 1000)
        update_delayed_quantizers(batch)
        for r in own:
            r.update()
        for q, r in zip([*qs, extra], [*ref, extra_ref]):
            for name in names:
                assert torch.equal(getattr(q, name), getattr(r, name)), (i, q.role, name)
    assert extra._shared_state is not qs[0]._shared_state  # joined a group of its own
