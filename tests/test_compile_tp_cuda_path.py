"""A compiled tensor-parallel ``TransformerLayer`` on the FP8 CUDA path (strict-CUDA mode, 2 CPU ranks).

Without sequence parallelism the column-parallel GEMMs (qkv, fc1) are traced op by op
(their input is replicated: ``CopyToTensorParallelRegion``, dgrad all-reduced); the row
GEMMs with their all-reduce are overlap windows (``tp_fuse::ub_linear_fp8``, the eager
overlapped algorithm, unchanged here). The traced ATen casts
(``tp_fuse/ops/compiled/traced_cast.py``) MAX-reduce current scaling's amax over the amax
group as a functional collective; delayed scaling joins the step's reductions through
``tp_fuse::fp8_track``. Compiled == eager over 2 training steps: outputs, input gradients,
parameters after SGD, and every quantizer's state. ``TP_FUSE_CPU_FP8_GEMM=scaled_mm``:
eager and compiled run one GEMM kernel, ``torch._scaled_mm``.
"""

from __future__ import annotations


import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import tp_fuse
from tp_fuse import settings
from tp_fuse.layers import TransformerLayer
from tp_fuse.ops import BasicLinear
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

from dist_utils import run_distributed

SEQ, BATCH, HIDDEN, FFN, HEADS = 16, 2, 32, 64, 2
RECIPES = {"current": Float8CurrentScaling, "delayed": DelayedScaling}
STATE = ("scale", "last_amax", "amax_history", "nonfinite_amax_count", "zero_amax_count")


def _steps(layer, recipe_cls, rank: int, tp: int, group) -> list[torch.Tensor]:
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step)  # replicated input
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).requires_grad_()
        with tp_fuse.autocast(recipe=recipe_cls(), amax_reduction_group=group):
            y = layer(x)
        (y ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        out += [y.detach(), x.grad]
    return out


def _rank_main(rank: int, world: int) -> dict:
    # The rank imported tp_fuse (with this module) before it got here: the settings change
    # through override, which a variable set now would not reach.
    with settings.override(TP_FUSE_STRICT_CUDA="1", TP_FUSE_CPU_FP8_GEMM="scaled_mm"):
        return _rank_report(rank, world)


def _rank_report(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    report = {}
    for name, recipe_cls in RECIPES.items():
        torch._dynamo.reset()
        eager, twin = (TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, sequence_parallel=False, seed=3)
                       for _ in range(2))
        targets: list[str] = []

        def keep(gm: torch.fx.GraphModule, example_inputs):
            for n in gm.graph.nodes:
                if n.op == "call_function":  # all-reduces with their reduce op
                    targets.append(f"{n.target}:{n.args[1]}" if "all_reduce" in str(n.target) else str(n.target))
            return make_boxed_func(gm.forward)

        compiled = torch.compile(twin, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        ref = _steps(eager, recipe_cls, rank, world, group)
        got = _steps(compiled, recipe_cls, rank, world, group)
        count = {op: sum(op in t for t in targets)
                 for op in ("aten._scaled_mm", "tp_fuse.fp8_cast", "tp_fuse.fp8_track", "ub_linear_fp8.default",
                            "all_reduce.default:max", "all_reduce.default:sum")}
        diffs = [float((a - b).abs().max()) for a, b in zip(ref, got)]
        diffs += [float((p - q).abs().max()) for p, q in zip(eager.parameters(), twin.parameters())]
        unequal = []
        for (path, a), (_, b) in zip(eager.named_modules(), twin.named_modules()):
            if isinstance(a, BasicLinear):
                for role, q in a._quantizers.quantizers.items():
                    q2 = b._quantizers.quantizers[role]
                    unequal += [f"{path}.{role}.{s}" for s in STATE
                                if hasattr(q, s) and not torch.equal(getattr(q, s), getattr(q2, s))]
        report[name] = {"max_diff": max(diffs), "unequal_state": unequal, "count": count}
    return report


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(2, _rank_main, timeout=900)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_sp_layer_on_the_cuda_path_matches_eager(results, name: str) -> None:
    for rank, report in enumerate(results):
        case = report[name]
        assert case["max_diff"] == 0.0, (rank, case)
        assert not case["unequal_state"], (rank, case)
        count = case["count"]
        # qkv and fc1: 3 GEMMs each, casts as ATen ops; proj and fc2: one overlap window each.
        assert count["aten._scaled_mm"] == 6 and count["tp_fuse.fp8_cast"] == 0, (rank, count)
        assert count["ub_linear_fp8.default"] == 2, (rank, count)
        assert count["tp_fuse.fp8_track"] == (6 if name == "delayed" else 0), (rank, count)
        assert count["all_reduce.default:sum"] == 2, (rank, count)  # the column GEMMs' dgrad
        # current scaling: each traced cast's amax is MAX-reduced over the amax group
        assert count["all_reduce.default:max"] == (6 if name == "current" else 0), (rank, count)
