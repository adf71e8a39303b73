"""TP communication ops, fused and unfused, on 2 gloo ranks: user mistakes raise ValueError
on every rank before any communication, including ranks that disagree on a shape or dtype
(gloo used to abort with SIGABRT), and later collectives still pair up.

Split from ``test_tp_overlap.py`` (its case machinery is reused); one process start.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from dist_utils import run_distributed
from test_tp_overlap import Case, Runner, _check, _config, _expect_fused, _hp_case, _unfused


def _expect_error(fn: Callable[[], Any], *needles: str) -> str:
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), f"expected {n!r} in: {e}"
        return str(e)
    raise AssertionError(f"expected a ValueError containing {needles}")


def _error_cases(run: Runner, r: int, tp: int, group) -> None:
    """User mistakes raise ValueError on every rank before any communication: the next
    collective still pairs up (the case after the errors runs)."""
    from tp_fuse.ops import AllGather, BasicLinear, Sequential
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    messages = {}
    row = Case("row", tp, 2, (), 4, 3, True, seed=7000)

    def non_divisible():
        rows = tp * 2 + 1
        for fused in (True, False):  # the fused and the unfused path say the same
            seq, _, _ = row.build(r, group, TPOverlap(OverlapConfig()) if fused else _unfused(), "fc2")
            messages[f"non-divisible fused={fused}"] = _expect_error(
                lambda: seq(torch.randn(rows, 4)), f"dimension {rows} is not divisible", f"size {tp}"
            )
            _expect_fused(seq, "UserbuffersForwardLinear" if fused else None, None if not fused else
                          "UserbuffersBackwardLinear", f"non-divisible fused={fused}")

    def wrong_features():
        col = Case("col", tp, 2, (), 4, 3, False, seed=7100)
        seq, _, _ = col.build(r, group, TPOverlap(), "fc1")
        messages["in_features"] = _expect_error(lambda: seq(torch.randn(2, 5)), "in_features=4", "(2, 5)")
        _expect_fused(seq, "UserbuffersForwardLinear", "UserbuffersBackwardLinear", "wrong features")

    def conflicting_overlap():
        lin = BasicLinear(4, 3, userbuffers_options={"comm_name": "fc1", "overlap": TPOverlap()})
        seq = Sequential(AllGather(group, overlap=TPOverlap()), lin)
        messages["conflict"] = _expect_error(lambda: seq(torch.randn(2, 4)), "different TPOverlap")

    def unknown_comm_name():
        lin = BasicLinear(4, 3, userbuffers_options={"comm_name": "attn"})
        seq = Sequential(AllGather(group), lin)
        messages["comm_name"] = _expect_error(lambda: seq(torch.randn(2, 4)), "'attn'", "attn_fprop")

    def disagreeing_shapes():
        """Ranks passing different shapes/dtypes: a ValueError on every rank naming each
        rank's shape, by default, fused or not (gloo used to abort with SIGABRT)."""
        from tp_fuse.ops import AllReduce, Bias, ReduceScatter

        rows = 2 * tp + 2 * tp * r  # rank-dependent, divisible by tp
        want = [f"rank {q}: input ({2 * tp + 2 * tp * q}, 4)" for q in range(tp)]
        ov = TPOverlap(OverlapConfig())

        def lin(name):
            return BasicLinear(4, 4, userbuffers_options={"comm_name": name, "overlap": ov})

        seqs = {
            "AllGather": Sequential(AllGather(group)),
            "ReduceScatter": Sequential(ReduceScatter(group)),
            "AllReduce": Sequential(AllReduce(group)),
            "AllGather+GEMM": Sequential(AllGather(group), lin("fc1")),
            "GEMM+ReduceScatter": Sequential(lin("fc2"), ReduceScatter(group)),
            "GEMM+AllReduce": Sequential(lin("fc2"), Bias(4), AllReduce(group)),
        }
        for what, seq in seqs.items():
            messages[f"shapes {what}"] = _expect_error(
                lambda: seq(torch.randn(rows, 4)), f"{what}: ranks disagree on the input shape/dtype", *want)
        dtype = torch.float32 if r == 0 else torch.float64
        messages["dtypes"] = _expect_error(lambda: Sequential(AllReduce(group))(torch.randn(4, 4, dtype=dtype)),
                                           "rank 0: input (4, 4) torch.float32", "rank 1: input (4, 4) torch.float64")
        # Agreed signatures are checked once: the second call adds no collective check.
        ag = AllGather(group)
        for _ in range(3):
            ag(torch.randn(2, 4))
        assert ag.shape_agreement.checks == 1, ag.shape_agreement.checks

    for label, fn in [("disagreeing shapes", disagreeing_shapes),
                      ("non-divisible", non_divisible), ("in_features", wrong_features),
                      ("conflicting TPOverlap", conflicting_overlap), ("unknown comm_name", unknown_comm_name)]:
        run.run("errors", label, fn)
    # Communication still pairs up after the errors above.
    case = Case("col", tp, 2, (), 4, 3, True, seed=7200)
    run.run("errors", "after errors", lambda: _hp_case(case, r, group, _config("col"), "after errors"))
    run.data["error_messages"] = messages


def _rank_main(rank: int, world: int) -> dict:
    import torch.distributed as dist

    run = Runner()
    _error_cases(run, rank, world, dist.group.WORLD)
    return run.result()


@pytest.mark.multirank
def test_errors_raise_on_every_rank_before_communication():
    results = run_distributed(2, _rank_main, timeout=240)
    _check(results, "errors", 6)
    for res in results:
        msgs = res["data"]["error_messages"]
        assert msgs["non-divisible fused=True"] == msgs["non-divisible fused=False"], msgs
        assert "first (sequence) dimension 5 is not divisible by the tensor-parallel size 2" in msgs["non-divisible fused=True"]
        assert "GEMM+ReduceScatter: ranks disagree on the input shape/dtype (rank 0: input (4, 4) torch.float32, " \
               "weight (4, 4) torch.float32; rank 1: input (8, 4) torch.float32, weight (4, 4) torch.float32)" \
               == msgs["shapes GEMM+ReduceScatter"], msgs


