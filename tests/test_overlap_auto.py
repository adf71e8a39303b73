"""``method: auto`` overlap selection (tp_fuse.overlap.auto).

Single process: candidate labels, config defaults (explicit YAML entries win), the choice
file as untrusted input. Two gloo ranks (one start): a fake clock that prefers each
candidate in turn makes it the choice and every choice gives the result of the unfused ops
(fp32 and FP8 delayed scaling) within the tolerance table; ranks with different timings
make the same choice (max over ranks); choices are cached and decided again for a new
shape; a saved choice file is reused without measuring; measuring records no extra FP8
amax values; ``explain`` shows candidates, times and the choice. No timing thresholds:
the clock is fake wherever a choice is asserted.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from test_tp_overlap import _BWD, _FWD, _NAME, Case, Runner, _close, _expect_fused, _step
from tolerances import assert_close, tols
from tp_fuse.overlap.auto import AutoDecision, OverlapAutoTuner, candidate_labels, load_choice_file, save_choice_file
from tp_fuse.overlap.config import OverlapConfig


class PreferClock:
    """Fake clock: runs each candidate and reports ``times[label]`` seconds (default 2 ms;
    ``prefer``: 1 ms), well inside the tuner's time budgets."""

    def __init__(self, times: Optional[dict[str, float]] = None, prefer: Optional[str] = None) -> None:
        self.times = dict(times or {})
        if prefer is not None:
            self.times[prefer] = 1e-3
        self.calls: list[str] = []

    def measure(self, label: str, fn) -> float:
        fn()
        self.calls.append(label)
        return self.times.get(label, 2e-3)


class NoClock:
    """A clock that must not be used (choices come from a file)."""

    def measure(self, label: str, fn) -> float:
        raise AssertionError(f"measured {label} although the choice file has it")


# ---------------------------------------------------------------- single process


def test_candidate_labels() -> None:
    assert candidate_labels(("ring_exchange",), (2, 4), 8) == ["ring_exchange", "unfused"]
    assert candidate_labels(("ring_exchange", "pipeline", "bulk"), (4, 2, 4), 8) == [
        "ring_exchange", "pipeline/2", "pipeline/4", "bulk", "unfused"]
    # at most one chunk per row; duplicates after clamping are measured once
    assert candidate_labels(("pipeline",), (2, 4), 3) == ["pipeline/2", "pipeline/3", "unfused"]
    assert candidate_labels(("pipeline",), (2, 4), 1) == ["pipeline/1", "unfused"]


def test_config_auto_defaults_and_explicit_entries_win() -> None:
    cfg = OverlapConfig.from_yaml("fc2_fprop:\n  method: ring_exchange\n", auto=True)
    assert cfg.entry("fc2_fprop").method == "ring_exchange"
    assert {cfg.entry(k).method for k in ("fc1_fprop", "qkv_dgrad", "proj_fprop")} == {"auto"}
    assert cfg.resolve(None, "fprop", "row")[1].method == "auto"
    assert cfg.disable("fc1").auto and cfg.with_entry("fc1_fprop", method="bulk").auto
    assert OverlapConfig().entry("fc1_fprop").method == "ring_exchange"  # the library default stays Megatron's
    assert OverlapConfig.from_dict({"fc1_fprop": {"method": "auto"}}).entry("fc1_fprop").method == "auto"
    with pytest.raises(ValueError, match="auto must be a bool"):
        OverlapConfig(auto="yes")  # type: ignore[arg-type]


def test_tuner_argument_checks() -> None:
    with pytest.raises(ValueError, match="repeats"):
        OverlapAutoTuner(repeats=0)
    with pytest.raises(ValueError, match="splits"):
        OverlapAutoTuner(splits=(0,))
    with pytest.raises(ValueError, match="clock"):
        OverlapAutoTuner(clock=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choice_file"):
        OverlapAutoTuner(write_choices=True)


def _good_doc() -> dict:
    return {"format": "tp_fuse.overlap_choices", "version": 1, "choices": [
        {"gemm": "fc1_fprop", "signature": "x 4x8 float32, hp, tp=2", "choice": "pipeline/2",
         "candidates": ["pipeline/2", "unfused"], "times_s": {"pipeline/2": 0.001, "unfused": 0.002}}]}


def test_choice_file_round_trip(tmp_path) -> None:
    path = str(tmp_path / "choices.json")
    d = AutoDecision("fc2_dgrad", "sig", "ring_exchange", ("ring_exchange", "unfused"), {"ring_exchange": 1.0, "unfused": 2.0})
    save_choice_file(path, [d])
    (got,) = load_choice_file(path)
    assert (got.gemm, got.signature, got.choice, got.candidates, dict(got.times)) == (
        d.gemm, d.signature, d.choice, d.candidates, dict(d.times))
    assert got.source == path
    tuner = OverlapAutoTuner(NoClock(), choice_file=path)
    assert [x.choice for x in tuner.decisions] == ["ring_exchange"]
    assert "from " + path in tuner.decisions[0].describe()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: "not json {", "<file>"),
        (lambda d: [1, 2], "<top level>"),
        (lambda d: {**d, "format": "pickle"}, "format"),
        (lambda d: {**d, "version": 2}, "version"),
        (lambda d: {**d, "extra": 1}, "<top level>"),
        (lambda d: {**d, "choices": {}}, "choices"),
        (lambda d: {**d, "choices": ["x"]}, "choices[0]"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "gemm": 3}]}, "choices[0].gemm"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "choice": "__import__('os')"}]}, "choices[0].choice"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "choice": "ring_exchange"}]}, "choices[0].choice"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "candidates": "pipeline/2"}]}, "choices[0].candidates"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "times_s": {"pipeline/2": -1}}]}, "choices[0].times_s"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "times_s": {"bulk": 1.0}}]}, "choices[0].times_s"),
        (lambda d: {**d, "choices": [{**d["choices"][0], "py/object": "os.system"}]}, "choices[0]"),
        (lambda d: {**d, "choices": d["choices"] * 2}, "choices[1]"),
        (lambda d: '{"format": NaN}', "<file>"),
        # symm_mem is one label (the op pipelines by itself): no split count.
        (lambda d: {**d, "choices": [{**d["choices"][0], "choice": "symm_mem/2",
                                      "candidates": ["symm_mem/2"], "times_s": {}}]}, "choices[0].choice"),
        # Issue 24 item 8: `^...$` accepted a label with a trailing newline.
        (lambda d: {**d, "choices": [{**d["choices"][0], "choice": "pipeline/2\n",
                                      "candidates": ["pipeline/2\n"], "times_s": {}}]}, "choices[0].choice"),
    ],
)
def test_choice_file_malformed(tmp_path, mutate, field) -> None:
    path = str(tmp_path / "overlap_choices.json")
    doc = mutate(_good_doc())
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(ValueError) as e:
        OverlapAutoTuner(choice_file=path)
    assert path in str(e.value) and f"{field}:" in str(e.value), str(e.value)


# ---------------------------------------------------------------- two ranks


def _auto_overlap(clock, **kw) -> Any:
    from tp_fuse.overlap.config import TPOverlap

    return TPOverlap(OverlapConfig(auto=True), tuner=OverlapAutoTuner(clock, warmup=1, repeats=2, **kw))


def _unfused_overlap() -> Any:
    from tp_fuse.overlap.config import TPOverlap

    return TPOverlap(OverlapConfig(enabled=False))


def _fp8(group):
    import tp_fuse
    from tp_fuse.recipe import DelayedScaling

    return tp_fuse.autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=group)


def _run_step(case: Case, r: int, group, overlap, fp8: bool):
    seq, lin, bias = case.build(r, group, overlap, _NAME[case.kind])
    if fp8:
        with _fp8(group):
            x = case.x[r].float().requires_grad_()
            y = seq(x)
        y.backward(case.dy[r].float())
        out = {"y": y.detach().clone(), "dx": x.grad.clone(), "dW": lin.weight.grad.clone()}
        if bias is not None:
            out["db"] = bias.bias.grad.clone()
    else:
        out = _step(seq, lin, bias, case.x[r], case.dy[r])
    return seq, lin, out


def _stages(kind: str) -> list[str]:
    return [f"{_NAME[kind]}_fprop"] + ([f"{_NAME[kind]}_dgrad"] if kind != "ar" else [])


def _prefer_each(run: Runner, r: int, tp: int, group) -> None:
    """Each candidate, preferred by the fake clock, is chosen, runs, and matches the unfused ops."""
    shapes = {"col": (4, (2,), 8, 6), "row": (4, (2,), 6, 8), "ar": (8, (), 6, 8)}
    labels = ["ring_exchange", "pipeline/2", "pipeline/4", "bulk", "unfused"]
    for kind, shape in shapes.items():
        case = Case(kind, tp, *shape, True, seed=40)
        for fp8 in (False, True):
            _, _, base = _run_step(case, r, group, _unfused_overlap(), fp8)
            ref = case.reference(r)
            for prefer in labels:
                label = f"{kind} fp8={fp8} prefer={prefer}"

                def one(case=case, fp8=fp8, prefer=prefer, base=base, ref=ref, label=label, kind=kind) -> None:
                    clock = PreferClock(prefer=prefer)
                    ov = _auto_overlap(clock)
                    seq, _, got = _run_step(case, r, group, ov, fp8)
                    _expect_fused(seq, _FWD[kind], _BWD[kind], label)
                    decided = {d.gemm: d for d in ov.tuner.decisions}
                    assert sorted(decided) == sorted(_stages(kind)), (label, sorted(decided))
                    for stage, d in decided.items():
                        assert set(d.candidates) <= set(labels) and d.candidates[-1] == "unfused", d
                        # PyTorch's symm_mem ops run on CUDA+NCCL only: never a candidate on gloo/CPU.
                        assert "symm_mem" not in d.candidates, d
                        # ties: the static default (Megatron's method, or unfused)
                        want = prefer if prefer in d.candidates else d.default
                        assert d.default in d.candidates, d
                        assert d.choice == want, (label, stage, d)
                        assert all(clock.calls.count(c) >= 2 for c in d.candidates), (label, clock.calls)
                    run.data.setdefault("choices", []).append((label, sorted((k, v.choice) for k, v in decided.items())))
                    for k in ref:
                        # every method is the unfused computation on the same operands
                        assert_close(got[k], base[k], torch.float32)
                        if not fp8:
                            assert_close(got[k], ref[k], torch.float32)
                        else:  # FP8 rounding, relative to the largest entry (as test_tp_overlap)
                            _close(got[k], ref[k], f"{label} {k}", rtol=tols("fp8_hybrid")["rtol"])

                run.run("prefer_each", label, one)


def _agree_across_ranks(run: Runner, r: int, tp: int, group) -> None:
    """Rank 0 finds ring_exchange fastest, rank 1 pipeline/2; pipeline/4 is never the slowest
    anywhere, so the max over ranks picks it on every rank."""
    def one() -> None:
        times = {"ring_exchange": 1e-3, "pipeline/2": 5e-3} if r == 0 else {"ring_exchange": 5e-3, "pipeline/2": 1e-3}
        times.update({"pipeline/4": 2e-3, "unfused": 3e-3})
        ov = _auto_overlap(PreferClock(times))
        case = Case("row", tp, 4, (), 6, 8, False, seed=7)
        _run_step(case, r, group, ov, False)
        (d,) = [d for d in ov.tuner.decisions if d.gemm == "fc2_fprop"]
        assert d.choice == "pipeline/4", d
        assert d.times["ring_exchange"] == 5e-3 and d.times["pipeline/2"] == 5e-3, d.times
        gathered: list[Any] = [None] * tp
        dist.all_gather_object(gathered, [(x.gemm, x.choice) for x in ov.tuner.decisions], group=group)
        assert all(g == gathered[0] for g in gathered), gathered

    run.run("agree", "max over ranks", one)

    def explicit_wins() -> None:
        from tp_fuse.overlap.config import TPOverlap

        clock = PreferClock(prefer="unfused")
        cfg = OverlapConfig(auto=True).with_entry("fc2_fprop", method="pipeline", num_splits=2)
        ov = TPOverlap(cfg, tuner=OverlapAutoTuner(clock, repeats=1))
        case = Case("row", tp, 4, (), 6, 8, False, seed=8)
        seq, _, _ = _run_step(case, r, group, ov, False)
        assert [d.gemm for d in ov.tuner.decisions] == ["fc2_dgrad"], ov.tuner.decisions
        assert "fc2_fprop: pipeline (num_splits=2)" in str(seq.explain())

    run.run("agree", "explicit entry wins", explicit_wins)


def _cached_and_new_shape(run: Runner, r: int, tp: int, group) -> None:
    def one() -> None:
        clock = PreferClock(prefer="ring_exchange")
        ov = _auto_overlap(clock)
        case = Case("col", tp, 4, (), 8, 6, True, seed=3)
        seq, lin, _ = case.build(r, group, ov, "fc1")
        # a second layer with the same GEMM name and shapes shares the decision
        seq2, lin2, _ = case.build(r, group, ov, "fc1")
        for s, lin_ in ((seq, lin), (seq2, lin2), (seq, lin)):
            _step(s, lin_, None, case.x[r], case.dy[r])
        assert len(ov.tuner.decisions) == 2 and ov.tuner.measured_count() == 2
        n_calls = len(clock.calls)
        _step(seq, lin, None, case.x[r], case.dy[r])
        assert len(clock.calls) == n_calls, "a cached choice was measured again"
        bigger = Case("col", tp, 8, (), 8, 6, True, seed=3)
        _step(seq, lin, None, bigger.x[r], bigger.dy[r])
        assert len(ov.tuner.decisions) == 4 and len(clock.calls) > n_calls, "a new shape was not decided"
        sigs = {d.signature for d in ov.tuner.decisions_for("fc1_fprop")}
        assert len(sigs) == 2, sigs
        text = str(seq.explain())
        assert "overlap auto" in text and "fc1_fprop [x 4x8 float32, hp, tp=2]" in text, text
        assert "ring_exchange" in text and " ms" in text and "-> ring_exchange (measured" in text, text
        assert "fc1_dgrad [" in text, text

    run.run("cache", "cached, new shape, explain", one)


def _reused_from_file(run: Runner, r: int, tp: int, group) -> None:
    def one() -> None:
        holder: list[Any] = [tempfile.mkdtemp() if r == 0 else None]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
        path = os.path.join(holder[0], "overlap_choices.json")
        case = Case("row", tp, 4, (2,), 6, 8, True, seed=11)
        ov = _auto_overlap(PreferClock(prefer="unfused"), choice_file=path, write_choices=r == 0)
        _, _, first = _run_step(case, r, group, ov, False)
        dist.barrier(group=group)
        assert os.path.exists(path)
        ov2 = _auto_overlap(NoClock(), choice_file=path)  # every rank reads the file
        _, _, again = _run_step(case, r, group, ov2, False)
        assert [(d.gemm, d.choice) for d in ov2.tuner.decisions] == [(d.gemm, d.choice) for d in ov.tuner.decisions]
        assert {d.choice for d in ov2.tuner.decisions} == {"unfused"}
        assert ov2.tuner.measured_count() == 0
        for k in first:
            assert torch.equal(first[k], again[k]), k
        text = str(case.build(r, group, ov2, "fc2")[0].explain())
        assert f"from {path}" in text, text
        # only rank 0 has the file (e.g. a run directory that is not shared): both measure
        ov4 = _auto_overlap(PreferClock(prefer="ring_exchange"), choice_file=path if r == 0 else None)
        _run_step(case, r, group, ov4, False)
        assert {(d.choice, d.source) for d in ov4.tuner.decisions} == {("ring_exchange", "measured")}
        # a choice that does not apply to the window: ValueError naming the file
        dist.barrier(group=group)
        if r == 0:
            doc = json.load(open(path))
            for e in doc["choices"]:
                e["choice"], e["candidates"], e["times_s"] = "bulk", ["bulk"], {}
            json.dump(doc, open(path, "w"))
        dist.barrier(group=group)
        ov3 = _auto_overlap(NoClock(), choice_file=path)
        try:
            _run_step(case, r, group, ov3, False)
        except ValueError as e:
            assert path in str(e) and "'bulk'" in str(e), str(e)
        else:
            raise AssertionError("a choice that does not apply was accepted")

    run.run("file", "reuse from file", one)


def _fp8_no_extra_amax(run: Runner, r: int, tp: int, group) -> None:
    """Measuring (2 warm-up + timed runs per candidate) leaves the FP8 state exactly as one
    run of a fixed method does: the same amax histories and scales after two steps."""
    def one() -> None:
        from tp_fuse.overlap.config import TPOverlap

        for kind in ("col", "row"):
            case = Case(kind, tp, 4, (2,), 8, 8, True, seed=21)
            name = _NAME[kind]
            fixed_cfg = OverlapConfig().with_entry(f"{name}_fprop", method="ring_exchange")
            prefer = "pipeline/2"
            states = []
            for ov in (_auto_overlap(PreferClock(prefer=prefer)), TPOverlap(fixed_cfg)):
                seq, lin, _ = case.build(r, group, ov, name)
                for _ in range(2):
                    with _fp8(group):
                        x = case.x[r].float().requires_grad_()
                        y = seq(x)
                    y.backward(case.dy[r].float())
                with _fp8(group):
                    qs = lin.fp8_quantizers()
                states.append({k: (q.amax_history.clone(), q.scale.clone()) for k, q in qs.items()})
            for role in states[0]:
                for a, b in zip(states[0][role], states[1][role]):
                    assert torch.equal(a, b), (kind, role, a, b)

    run.run("fp8_amax", "no extra amax", one)


def _all_cases(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    run = Runner()
    _prefer_each(run, rank, world, group)
    _agree_across_ranks(run, rank, world, group)
    _cached_and_new_shape(run, rank, world, group)
    _reused_from_file(run, rank, world, group)
    _fp8_no_extra_amax(run, rank, world, group)
    return run.result()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(2, _all_cases, timeout=600)


@pytest.mark.multirank
@pytest.mark.parametrize("topic, minimum", [
    ("prefer_each", 30), ("agree", 1), ("cache", 1), ("file", 1), ("fp8_amax", 1),
])
def test_auto_two_ranks(results, topic, minimum) -> None:
    for rank, res in enumerate(results):
        assert res["counts"].get(topic, 0) >= minimum, (rank, res["counts"])
        fails = res["failures"].get(topic, [])
        assert not fails, f"rank {rank}: {len(fails)} failure(s):\n" + "\n".join(fails[:3])


@pytest.mark.multirank
def test_auto_same_choices_on_both_ranks(results) -> None:
    assert results[0]["data"]["choices"] == results[1]["data"]["choices"]


# ---------------------------------------------------------------- launcher


def test_launcher_overlap_method(tmp_path) -> None:
    from tp_fuse.launch.config import OverlapSettings as LaunchOverlap
    from tp_fuse.launch.config_parse import from_dict
    from tp_fuse.launch.models.build import OVERLAP_CHOICE_FILE, build_overlap

    model = {"name": "gpt"}
    assert from_dict({"model": model, "overlap": {"enabled": True}}).overlap.method == "auto"  # default when on
    with pytest.raises(ValueError, match="overlap.method"):
        from_dict({"model": model, "overlap": {"enabled": True, "method": "fastest"}})
    ov = build_overlap(LaunchOverlap(enabled=True), str(tmp_path), is_rank0=True)
    assert ov.config.auto and ov.config.entry("fc1_dgrad").method == "auto"
    assert ov.tuner.choice_file == str(tmp_path / OVERLAP_CHOICE_FILE) and ov.tuner.write_choices
    assert not build_overlap(LaunchOverlap(enabled=True), str(tmp_path), is_rank0=False).tuner.write_choices
    yaml_path = tmp_path / "ub.yaml"
    yaml_path.write_text("fc2_fprop:\n  method: ring_exchange\n")
    ov = build_overlap(LaunchOverlap(enabled=True, config=str(yaml_path)), str(tmp_path))
    assert ov.config.entry("fc2_fprop").method == "ring_exchange" and ov.config.entry("fc1_fprop").method == "auto"
    fixed = build_overlap(LaunchOverlap(enabled=True, method="megatron"), str(tmp_path))
    assert not fixed.config.auto and fixed.config.entry("fc2_fprop").method == "pipeline"
    assert not build_overlap(LaunchOverlap(enabled=False), str(tmp_path)).config.enabled
    (tmp_path / OVERLAP_CHOICE_FILE).write_text('{"format": "tp_fuse.overlap_choices", "version": 1, "choices": 5}')
    with pytest.raises(ValueError, match=f"{OVERLAP_CHOICE_FILE}: choices: expected a list"):
        build_overlap(LaunchOverlap(enabled=True), str(tmp_path))


# ---------------------------------------------------------------- time budgets and noise


class SlowClock:
    """Reports ``seconds`` per call (and counts calls) without running anything slow."""

    def __init__(self, seconds: dict[str, float] | float) -> None:
        self.seconds, self.calls = seconds, []

    def measure(self, label: str, fn) -> float:
        fn()
        self.calls.append(label)
        return self.seconds if isinstance(self.seconds, float) else self.seconds[label]


@pytest.fixture
def one_rank():
    """A one-rank gloo world in this process (the tuner agrees over its group)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _decide(tuner: OverlapAutoTuner, gemm: str, default: Optional[str] = "pipeline/4") -> str:
    labels = ("ring_exchange", "pipeline/2", "pipeline/4", "unfused")
    return tuner.decide(gemm, "sig", {lb: (lambda: None) for lb in labels}, None, torch.device("cpu"), default=default)


def test_stage_budget_caps_the_rounds(one_rank) -> None:
    # 1.5 s per candidate call: the first round (6 s) is over the 2 s stage budget, so
    # there is no second one, although repeats asks for 5.
    clock = SlowClock(1.5)
    tuner = OverlapAutoTuner(clock, repeats=5, stage_budget_s=2.0, run_budget_s=1000.0)
    _decide(tuner, "fc2_fprop")
    assert len(clock.calls) == 4 and tuner.timed_seconds == 6.0
    fast = SlowClock(1e-3)
    _decide(OverlapAutoTuner(fast, repeats=5), "fc2_fprop")
    assert len(fast.calls) == 4 * 5  # inside the budget: every round runs


def test_run_budget_spent_takes_the_static_default_unmeasured(one_rank, tmp_path) -> None:
    clock = SlowClock({"ring_exchange": 1.0, "pipeline/2": 3.0, "pipeline/4": 3.0, "unfused": 3.0})
    lines: list[str] = []
    tuner = OverlapAutoTuner(clock, repeats=1, run_budget_s=5.0, log=lines.append,
                             choice_file=tmp_path / "choices.json", write_choices=True)
    assert _decide(tuner, "fc2_fprop") == "ring_exchange"  # measured: 10 s timed, over the 5 s budget
    calls = len(clock.calls)
    assert _decide(tuner, "fc2_dgrad", default="pipeline/2") == "pipeline/2"  # not measured
    assert len(clock.calls) == calls
    (d,) = tuner.decisions_for("fc2_dgrad")
    assert d.source == "budget" and "budget of 5 s spent" in d.describe() and d.times == {}
    assert "tuning so far 10.00 s timed, budget 5 s" in lines[-1]
    # Unmeasured choices are not saved: a later run measures them.
    assert [x.gemm for x in load_choice_file(str(tmp_path / "choices.json"))] == ["fc2_fprop"]


def test_choice_within_noise_keeps_the_static_default(one_rank) -> None:
    class Noisy:
        """ring_exchange 3% faster than the default pipeline/4 at best, with 10% spread."""

        def __init__(self) -> None:
            self.n: dict[str, int] = {}

        def measure(self, label: str, fn) -> float:
            self.n[label] = self.n.get(label, 0) + 1
            base = {"ring_exchange": 0.97e-3, "pipeline/4": 1.0e-3}.get(label, 2e-3)
            return base * (1.2 if self.n[label] % 2 else 1.0)  # every other sample 20% slow

    tuner = OverlapAutoTuner(Noisy(), repeats=4)
    assert _decide(tuner, "fc2_fprop", default="pipeline/4") == "pipeline/4"
    (d,) = tuner.decisions
    assert "within the noise" in d.note and d.spread["ring_exchange"] > 0.05
    assert "+-" in d.describe() and "static default kept" in d.describe()
    # A clear win (no noise, 2x) is taken.
    clear = OverlapAutoTuner(SlowClock({"ring_exchange": 1e-3, "pipeline/2": 2e-3, "pipeline/4": 2e-3,
                                        "unfused": 2e-3}))
    assert _decide(clear, "fc2_fprop", default="pipeline/4") == "ring_exchange"


def test_static_default_per_stage() -> None:
    from tp_fuse.overlap.config import static_default

    assert static_default("fc1_fprop") == ("ring_exchange", 4)
    assert static_default("fc2_fprop") == ("pipeline", 4)
    assert static_default("row_dgrad") == ("ring_exchange", 4)
    assert static_default("myproj_fprop") is None
