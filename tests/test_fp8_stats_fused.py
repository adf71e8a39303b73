"""The FP8-stats tap sees the casts that fused ops do, and does not block fusions.

``Fp8StatsCollector`` (what the launcher logs to W&B) observes every FP8 cast of
a layer's GEMM operands. Fused ops that cast themselves -- the norm writing the
next GEMM's FP8 input, and the overlapped comm+GEMM ops that cast before the
all-gather -- must report those casts too, while staying fused.
"""

import pytest
import torch
import torch.distributed as dist

import tp_fuse as te
from dist_utils import run_distributed
from tp_fuse.debug import Fp8StatsCollector
from tp_fuse.recipe import DelayedScaling

STATS = ("amax", "scale", "scale_inv", "underflow_pct", "overflow_pct", "mse")


def _fused_names(seq: te.ops.Sequential, direction: str) -> list[str]:
    runs = [f.forward_ops if direction == "forward" else f.backward_ops for f in seq.fusers()]
    return [type(op).__name__ for group in runs for op, _ in group]


def test_norm_fp8_fusion_reports_its_input_cast():
    torch.manual_seed(0)
    seq = te.ops.Sequential(
        te.ops.LayerNorm(32), te.ops.Linear(32, 48, userbuffers_options={"comm_name": "fc1"})
    )
    collector = Fp8StatsCollector()
    collector.attach(seq)
    collector.active = True
    recipe = DelayedScaling(amax_history_len=4)
    x = 3 * torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = seq(x)
    y.sum().backward()
    assert "ForwardNormQuantizeLinear" in _fused_names(seq, "forward")
    stats = collector.collect()
    prefix = next(k.rsplit("/", 2)[0] for k in stats if k.endswith("/input/amax"))
    for role in ("input", "weight", "grad_output"):
        for stat in STATS:
            assert f"{prefix}/{role}/{stat}" in stats, sorted(stats)
    # The recorded amax is the amax of the high-precision norm output.
    ln = seq[0]
    with torch.no_grad():
        ref = torch.nn.functional.layer_norm(x, (32,), ln.weight, ln.bias, ln.eps)
    assert stats[f"{prefix}/input/amax"] == pytest.approx(float(ref.abs().max()), rel=1e-6)


def _overlap_cases(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    group = dist.group.WORLD
    fc1 = te.ops.Sequential(
        te.ops.AllGather(group), te.ops.Linear(32, 64, userbuffers_options={"comm_name": "fc1"})
    )
    fc2 = te.ops.Sequential(
        te.ops.Linear(64, 32, userbuffers_options={"comm_name": "fc2"}), te.ops.ReduceScatter(group)
    )
    model = torch.nn.Sequential(fc1, fc2)
    collector = Fp8StatsCollector(reduction_group=group)
    collector.attach(model)
    collector.active = True
    x = torch.randn(8, 32, requires_grad=True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=group):
        y = model(x)
    y.square().sum().backward()
    return {
        "fc1_fwd": _fused_names(fc1, "forward"),
        "fc1_bwd": _fused_names(fc1, "backward"),
        "fc2_fwd": _fused_names(fc2, "forward"),
        "fc2_bwd": _fused_names(fc2, "backward"),
        "stats": collector.collect(),
    }


@pytest.mark.multirank
def test_overlap_fusions_report_their_casts():
    results = run_distributed(2, _overlap_cases, timeout=120)
    for res in results:
        assert res["fc1_fwd"] == ["UserbuffersForwardLinear"]
        assert res["fc2_fwd"] == ["UserbuffersForwardLinear"]
        assert "UserbuffersBackwardLinear" in res["fc1_bwd"] + res["fc2_bwd"]
        stats = res["stats"]
        for gemm in ("fc1", "fc2"):
            for role in ("input", "weight", "grad_output"):
                keys = [k for k in stats if f"/{gemm}/{role}/" in k]
                assert {k.rsplit("/", 1)[1] for k in keys} >= set(STATS), (gemm, role, sorted(stats))
    # Statistics are reduced over the group: both ranks log the same numbers.
    assert results[0]["stats"] == results[1]["stats"]
