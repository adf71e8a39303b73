"""Compiled tensor-parallel ``TransformerLayer`` (TP=2, 2 gloo ranks) == eager, one graph.

Under ``torch.compile`` the TP comm ops of a fusion group are autograd functions over
PyTorch's functional collectives (``tp_fuse/ops/compiled/comm.py``), traced into the layer's
graph with the GEMMs. Each rank compiles its layer and compares it with an eager twin built
from the same seed: 2 SGD steps, outputs, input gradients and parameters (fp32: 1e-5, as
the other compiled==eager checks; FP8 delayed: equal amax histories and scales).

One case here: sequence parallelism with FP8 delayed scaling (amax group = the TP group)
under ``aot_eager``, on a layer built without ``overlap=`` (each comm op's own default
``TPOverlap``). The other combinations -- fp32 + SP under inductor, fp32 and FP8 delayed
without SP -- run in test_compile_tp_overlap.py on the same layer, sizes, seeds and steps
(``inductor-default``, ``aot_eager-gemm_ar``, ``aot_eager-fp8-delayed-gemm_ar``), with an
explicit ``TPOverlap`` and stricter checks (aot_eager bit-identical to eager, the number of
overlap windows in the graph). ``fullgraph=True``: the layer's check that the amax group
covers the TP group reads the mirrored autocast state, and still raises its ValueError
under compile for a group that does not.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch._dynamo

import tp_fuse
from tp_fuse.layers import TransformerLayer
from tp_fuse.ops import BasicLinear
from tp_fuse.recipe import DelayedScaling

from dist_utils import run_distributed

SEQ, BATCH, HIDDEN, FFN, HEADS = 8, 2, 32, 64, 2
CASES = [  # (name, sequence_parallel, fp8, backend)
    ("sp-delayed", True, True, "aot_eager"),
]


def _steps(layer, sp: bool, fp8: bool, rank: int, tp: int, group) -> list[torch.Tensor]:
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + (rank if sp else 0))
        x = torch.randn(SEQ // tp if sp else SEQ, BATCH, HIDDEN, generator=gen).requires_grad_()
        ctx = tp_fuse.autocast(recipe=DelayedScaling(), amax_reduction_group=group) if fp8 else contextlib.nullcontext()
        with ctx:
            y = layer(x)
        (y ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        out += [y.detach(), x.grad]
    return out


def _rank_main(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    report = {}
    for name, sp, fp8, backend in CASES:
        torch._dynamo.reset()
        eager, twin = (TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, sequence_parallel=sp, seed=3)
                       for _ in range(2))
        compiled = torch.compile(twin, backend=backend, fullgraph=True)
        torch._dynamo.utils.counters.clear()
        ref = _steps(eager, sp, fp8, rank, world, group)
        got = _steps(compiled, sp, fp8, rank, world, group)
        diffs = [float((a - b).abs().max()) for a, b in zip(ref, got)]
        diffs += [float((p - q).abs().max()) for p, q in zip(eager.parameters(), twin.parameters())]
        state_equal = True
        if fp8:
            for a, b in zip(eager.modules(), twin.modules()):
                if isinstance(a, BasicLinear):
                    for role, q in a._quantizers.quantizers.items():
                        q2 = b._quantizers.quantizers[role]
                        state_equal &= torch.equal(q.amax_history, q2.amax_history) and torch.equal(q.scale, q2.scale)
        breaks = list(torch._dynamo.utils.counters["graph_break"])
        report[name] = {"max_diff": max(diffs), "state_equal": state_equal, "breaks": breaks}
    # An amax group that leaves out the other TP rank: refused under compile too.
    own = [dist.new_group([r]) for r in range(world)][rank]
    torch._dynamo.reset()
    layer = torch.compile(TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, sequence_parallel=True, seed=3),
                          backend="aot_eager")
    try:
        with tp_fuse.autocast(recipe=DelayedScaling(), amax_reduction_group=own):
            layer(torch.randn(SEQ // world, BATCH, HIDDEN))
        report["bad_group"] = "no error"
    except ValueError as e:
        report["bad_group"] = str(e)
    return report


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(2, _rank_main, timeout=900)


@pytest.mark.multirank
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_compiled_tp_layer_matches_eager(results, name: str) -> None:
    for rank, report in enumerate(results):
        case = report[name]
        assert case["max_diff"] <= 1e-5, (rank, case)
        assert case["state_equal"], (rank, case)
        assert not case["breaks"], (rank, case)


@pytest.mark.multirank
def test_compiled_sp_layer_refuses_an_amax_group_without_the_tp_ranks(results) -> None:
    for report in results:
        assert "must include the tensor-parallel group" in report["bad_group"], report["bad_group"]
