"""Block-scaled recipes with tensor parallelism on 2 gloo ranks: every overlap fusion
(AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce, and their backwards) equals the unfused
ops under Float8BlockScaling / MXFP8BlockScaling / Float8RowwiseScaling / NVFP4BlockScaling
(with its RHT and stochastic rounding), the fusions happen, the wire carries bytes plus
scales (0.5 byte/element for FP4), explain says no amax reduction is needed (NVFP4: that
its per-tensor amax is reduced over the TP group), and a shard whose blocks would straddle
ranks is refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from test_tp_overlap import Case, Runner, WireCounter, _close, _config, _expect_fused, _unfused

_FWD = {"col": "UserbuffersForwardLinear", "row": "UserbuffersForwardLinear", "ar": "UserbuffersForwardLinearAllReduce"}
_BWD = {"col": "UserbuffersBackwardLinear", "row": "UserbuffersBackwardLinear", "ar": None}
_NAME = {"col": "fc1", "row": "fc2", "ar": "proj"}


def _recipes() -> dict:
    from tp_fuse.recipe import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling, NVFP4BlockScaling

    # Local rows per case: a multiple of the column-wise block (128 / 32 / any / 16).
    return {"blockwise": (Float8BlockScaling(), 128), "mxfp8": (MXFP8BlockScaling(), 32),
            "rowwise": (Float8RowwiseScaling(), 24), "nvfp4": (NVFP4BlockScaling(), 32)}


def _block_case(case: Case, r: int, group, cfg, recipe, label: str) -> None:
    """One step fused vs unfused (same quantization; fp32 summation order may differ)."""
    import tp_fuse
    from tolerances import NVFP4_REL_NORM
    from tp_fuse.overlap.config import TPOverlap

    models = [case.build(r, group, ov, _NAME[case.kind]) for ov in (TPOverlap(cfg), _unfused())]
    results = []
    for seq, lin, b in models:
        torch.manual_seed(11)  # NVFP4's stochastic rounding: the same seed draws in both runs
        with tp_fuse.autocast(recipe=recipe):
            x = case.x[r].float().requires_grad_()
            y = seq(x)
        y.backward(case.dy[r].float())
        res = {"y": y.detach(), "dx": x.grad, "dW": lin.weight.grad.clone()}
        if b is not None:
            res["db"] = b.bias.grad.clone()
        results.append(res)
    got, base = results
    for k in got:
        _close(got[k], base[k], f"{label} {k}: fused vs unfused")
    # And near the float64 math (block FP8 rounding: a few percent; FP4: the table's bound).
    ref = case.reference(r)
    bound = NVFP4_REL_NORM if label.startswith("nvfp4") else 0.1
    for k in ("y", "dx", "dW"):
        err = (got[k].double() - ref[k]).norm() / ref[k].norm()
        assert err < bound, f"{label} {k}: relative error {err:.3g} vs float64"
    with tp_fuse.autocast(recipe=recipe):
        _expect_fused(models[0][0], _FWD[case.kind], _BWD[case.kind], label)


def _cases(run: Runner, r: int, tp: int, group) -> None:
    for name, (recipe, m) in _recipes().items():
        col = Case("col", tp, m, (), 128, 64, True, seed=7000)
        row = Case("row", tp, m, (), 64, 128, True, seed=7100)
        ar = Case("ar", tp, m, (), 128, 64, True, seed=7200)
        variants = [
            (col, {"fprop": {"method": "ring_exchange"}, "dgrad": {"method": "bulk"}}),
            (col, {"dgrad": {"method": "pipeline", "num_splits": 2}}),
            (row, {"fprop": {"method": "pipeline", "num_splits": 2}}),
            (row, {"fprop": {"method": "ring_exchange"}}),
            (ar, {"fprop": {"method": "pipeline", "num_splits": 2}}),
        ]
        for case, entries in variants:
            label = f"{name} {case.kind} {entries}"
            cfg = _config(case.kind, **entries)
            run.run(name, label, lambda: _block_case(case, r, group, cfg, recipe, label))


def _wire_and_explain(run: Runner, r: int, tp: int, group) -> None:
    import tp_fuse
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    sent, texts = {}, {}
    for name, (recipe, m) in _recipes().items():
        col = Case("col", tp, m, (), 256, 64, False, seed=7300)
        seq, _, _ = col.build(r, group, TPOverlap(OverlapConfig()), "fc1")
        with torch.no_grad(), WireCounter() as wc, tp_fuse.autocast(recipe=recipe):
            seq(col.x[r].float())
        sent[name] = (wc.sent, col.x[r].numel())
        with tp_fuse.autocast(recipe=recipe):
            texts[name] = str(seq.explain())
    run.data["wire"] = sent
    run.data["explain"] = texts

    def straddling_blocks():
        from tp_fuse.recipe import Float8BlockScaling

        col = Case("col", tp, 64, (), 128, 64, False, seed=7400)  # 64 local rows < 128-row blocks
        seq, _, _ = col.build(r, group, TPOverlap(OverlapConfig()), "fc1")
        with tp_fuse.autocast(recipe=Float8BlockScaling()):
            x = col.x[r].float().requires_grad_()
            y = seq(x)
        try:
            y.backward(col.dy[r].float())
        except Exception as e:  # noqa: BLE001 - the message is the point
            assert "not a multiple of 128" in str(e), str(e)
        else:
            raise AssertionError("straddling 1x128 blocks were not refused")

    run.run("errors", "straddling blocks", straddling_blocks)


def _rank_main(rank: int, world: int) -> dict:
    run = Runner()
    _cases(run, rank, world, dist.group.WORLD)
    _wire_and_explain(run, rank, world, dist.group.WORLD)
    return run.result()


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(2, _rank_main, timeout=300)


def _check(results: list[dict], topic: str, min_cases: int) -> None:
    for rank, res in enumerate(results):
        fails = res["failures"].get(topic, [])
        assert not fails, f"rank {rank}: {len(fails)} failing '{topic}' case(s):\n" + "\n".join(fails[:3])
        assert res["counts"].get(topic, 0) >= min_cases, (topic, res["counts"])


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8", "rowwise", "nvfp4"])
def test_overlap_fusions_match_unfused(results, recipe):
    _check(results, recipe, 5)


@pytest.mark.multirank
def test_wire_carries_bytes_plus_scales(results):
    k = 256
    # NVFP4: two values per byte, a 1-byte E4M3 scale per 16 values, the fp32 tensor amax.
    per_row = {"blockwise": k + 4 * (k // 128), "mxfp8": k + k // 32, "rowwise": k + 4,
               "nvfp4": k // 2 + k // 16 + 4}
    for res in results:
        for name, (sent, numel) in res["data"]["wire"].items():
            rows = numel // k
            # Ring all-gather at TP=2: each rank sends its shard once, packed with its scales.
            assert sent == rows * per_row[name], (name, sent, rows * per_row[name])


@pytest.mark.multirank
def test_explain_says_no_amax_reduction_for_block_scales(results):
    for name, text in results[0]["data"]["explain"].items():
        assert "UserbuffersForwardLinear" in text or "AllGather+GEMM" in text, text
        assert f"{name}: input quantized before the gather" in text, text
        if name == "nvfp4":
            assert "0.5 byte/element" in text and "per-tensor amax" in text and "all-reduced (MAX)" in text, text
        else:
            assert "no amax reduction is needed" in text, text
        assert "re-gathered for wgrad (block-scaled: its column-wise copy)" in text, text


@pytest.mark.multirank
def test_straddling_blocks_are_refused(results):
    _check(results, "errors", 1)
