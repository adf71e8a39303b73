"""Multi-rank amax reduction (2 ranks, gloo): one process start runs every case.

Each case runs on both ranks with different data and returns what the parent
compares across ranks; assertions against float64/global-amax references run
inside the ranks. ``torch.distributed.all_reduce`` is wrapped to count the
collectives the library issues.
"""

from __future__ import annotations

import contextlib
import math
import struct
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from tp_fuse import ops as te_ops
from tp_fuse.quantization import (
    CurrentScalingQuantizer,
    FP8WeightCache,
    OpQuantizers,
    active_autocast,
    autocast,
    fp8_gemm,
)
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.multirank

WORLD_SIZE = 2
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@contextlib.contextmanager
def count_all_reduce() -> Iterator[list[tuple[int, Any]]]:
    """Record (numel, op) of every torch.distributed.all_reduce call."""
    calls: list[tuple[int, Any]] = []
    original = dist.all_reduce

    def wrapped(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        calls.append((tensor.numel(), kwargs.get("op", args[0] if args else None)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = wrapped
    try:
        yield calls
    finally:
        dist.all_reduce = original


def global_max(values: list[float]) -> list[float]:
    """Elementwise max over ranks (via all_gather, so not counted as all_reduce)."""
    local = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).amax(0).tolist()


class _Fp8Linear(torch.autograd.Function):
    """Test op: ``y = x W^T`` with FP8 GEMMs, amaxes tracked for reduction.

    ======== ==================== ==================================
             forward              backward
    ======== ==================== ==================================
    shapes   x [M, K], W [N, K]   dy [M, N]
    math     y = q(x) q(W)^T      dx = q(dy) q(W);  dW = q(dy)^T q(x)
    ======== ==================== ==================================
    """

    @staticmethod
    def forward(ctx, x, w, qx, qw, qg):  # noqa: ANN001
        state = active_autocast()
        ctx.x8, ctx.w8 = qx.quantize(x), qw.quantize(w)
        state.track_forward(qx)
        state.track_forward(qw)
        ctx.qg, ctx.tracker = qg, state.backward_tracker
        return fp8_gemm(ctx.x8, ctx.w8, x.dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        dy8 = ctx.qg.quantize(dy)
        ctx.tracker.track(ctx.qg)
        dx = fp8_gemm(dy8, ctx.w8.transpose_fp8(), dy.dtype)
        dw = fp8_gemm(dy8.transpose_fp8(), ctx.x8.transpose_fp8(), dy.dtype)
        return dx, dw, None, None, None


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    # The rank holding the largest amax changes between steps and tensors.
    fx, fw, fg = [(3.0, 0.05, 2.0), (1.0, 0.2, 700.0)][(rank + step) % 2]
    # GEMM dimensions (M, N, K; M is wgrad's K) multiples of 16, as CUDA's _scaled_mm needs.
    x = torch.randn(16, 32, generator=gen) * fx
    w = torch.randn(16, 32, generator=gen) * fw
    g = torch.randn(16, 16, generator=gen) * fg
    return x, w, g


@case
def delayed_forward_and_backward(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    recipe = DelayedScaling(amax_history_len=4)
    qs = OpQuantizers(("input", "weight", "grad_output")).get(recipe, group)
    qx, qw, qg = qs["input"], qs["weight"], qs["grad_output"]
    seen: list[list[float]] = []
    per_step = []
    for step in range(3):
        x, w, g = _data(rank, step)
        x.requires_grad_()
        seen.append(global_max([x.abs().max().item(), w.abs().max().item(), g.abs().max().item()]))
        with count_all_reduce() as calls:
            with autocast(recipe=recipe, amax_reduction_group=group):
                y = _Fp8Linear.apply(x, w, qx, qw, qg)
                assert calls == [], calls  # nothing before the outermost exit
            assert len(calls) == 1 and calls[0] == (2, dist.ReduceOp.MAX), calls
            (y * g).sum().backward()
            assert len(calls) == 2 and calls[1] == (1, dist.ReduceOp.MAX), calls
        window = [max(s[i] for s in seen[-4:]) for i in range(3)]
        expected = [f32(448.0 / window[0]), f32(448.0 / window[1]), f32(57344.0 / window[2])]
        got = [qx.scale.item(), qw.scale.item(), qg.scale.item()]
        assert got == expected, (step, got, expected)
        last = [q.amax_history[-1].item() for q in (qx, qw, qg)]
        assert last == [f32(v) for v in seen[-1]], (last, seen[-1])
        # The backward really ran through the FP8 GEMMs.
        assert x.grad is not None and x.grad.shape == x.shape and bool(torch.isfinite(x.grad).all())
        per_step.append(got)
    return {"scales": per_step}


@case
def delayed_nan_on_one_rank(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    q = OpQuantizers(("input",)).get(recipe, group)["input"]
    x = torch.tensor([1.0 + rank, math.nan if rank == 1 else -0.5])
    with autocast(recipe=recipe, amax_reduction_group=group) as ctx:
        q.quantize(x)
        ctx.track_forward(q)
    # NaN on rank 1 only: both ranks see a non-finite amax and keep scale 1.0.
    state = (q.scale.item(), q.nonfinite_amax_count.item())
    assert state == (1.0, 1), state
    with autocast(recipe=recipe, amax_reduction_group=group) as ctx:
        q.quantize(torch.tensor([4.0 * (rank + 1)]))
        ctx.track_forward(q)
    assert q.scale.item() == f32(448.0 / (4.0 * world_size)), q.scale.item()
    return {"scale": q.scale.item(), "nonfinite": q.nonfinite_amax_count.item()}


@case
def nested_autocast_issues_one_collective(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    recipe = DelayedScaling(amax_history_len=3)
    q1 = OpQuantizers(("input",)).get(recipe, group)["input"]
    q2 = OpQuantizers(("weight",)).get(recipe, group)["weight"]
    with count_all_reduce() as calls:
        with autocast(recipe=recipe, amax_reduction_group=group) as outer:
            q1.quantize(torch.tensor([2.0 + rank]))
            outer.track_forward(q1)
            with autocast(recipe=DelayedScaling(amax_history_len=3), amax_reduction_group=group) as inner:
                q2.quantize(torch.tensor([8.0 - rank]))
                inner.track_forward(q2)
                inner.track_forward(q2)  # idempotent
            assert calls == [], calls
    assert len(calls) == 1 and calls[0][0] == 2, calls
    scales = (q1.scale.item(), q2.scale.item())
    assert scales == (f32(448.0 / (2.0 + world_size - 1)), 448.0 / 8.0), scales
    return {"scales": [q1.scale.item(), q2.scale.item()]}


@case
def reduce_amax_false_and_single_rank_groups(rank: int, world_size: int) -> dict:
    local = DelayedScaling(amax_history_len=2, reduce_amax=False)
    q = OpQuantizers(("input",)).get(local, dist.group.WORLD)["input"]
    # Every rank must create every group, in the same order.
    singles = [dist.new_group([r]) for r in range(world_size)]
    recipe = DelayedScaling(amax_history_len=2)
    q_single = OpQuantizers(("input",)).get(recipe, singles[rank])["input"]
    with count_all_reduce() as calls:
        with autocast(recipe=local, amax_reduction_group=dist.group.WORLD) as ctx:
            q.quantize(torch.tensor([1.0 + rank]))
            ctx.track_forward(q)
        with autocast(recipe=recipe, amax_reduction_group=singles[rank]) as ctx:
            q_single.quantize(torch.tensor([2.0 + rank]))
            ctx.track_forward(q_single)
    assert calls == [], calls  # no reduction wanted / a one-rank group needs none
    assert q.scale.item() == f32(448.0 / (1.0 + rank)), q.scale.item()
    assert q_single.scale.item() == f32(448.0 / (2.0 + rank)), q_single.scale.item()
    return {"local_scale": q.scale.item()}


@case
def current_scaling_with_group(rank: int, world_size: int) -> dict:
    group = dist.new_group(list(range(world_size)))
    out = {}
    for power_2 in (False, True):
        q = CurrentScalingQuantizer(Float8CurrentScaling(power_2_scale=power_2), "input", group)
        x = torch.randn(16, generator=torch.Generator().manual_seed(rank)) * (1 + 9 * rank)
        amax = global_max([x.abs().max().item()])[0]
        with count_all_reduce() as calls:
            x8 = q.quantize(x)
        assert len(calls) == 1 and calls[0] == (1, dist.ReduceOp.MAX), calls
        exact = 448.0 / f32(amax)
        expected = 2.0 ** math.floor(math.log2(exact)) if power_2 else f32(exact)
        assert q.scale.item() == expected, (q.scale.item(), expected)
        out[power_2] = x8._scale_inv.item()
    # NaN on one rank: every rank falls back to scale 1.0 (no order-dependent max).
    q = CurrentScalingQuantizer(Float8CurrentScaling(), "grad_output", group)
    q.quantize(torch.tensor([math.nan if rank == 0 else 3.0]))
    state = (q.scale.item(), q.nonfinite_amax_count.item())
    assert state == (1.0, 1), state
    return out


@case
def weight_cache_when_one_ranks_cache_misses(rank: int, world_size: int) -> dict:
    """FP8WeightCache where rank 0's weight changed (a version bump) and rank 1's did not:
    current scaling over a group casts the weight on every micro-batch on every rank (its
    cast all-reduces the amax; a rank reusing its cast would leave the others waiting),
    delayed scaling reuses per rank (no collective in a cast)."""
    group = dist.new_group(list(range(world_size)))
    out = {}
    for name, recipe in (("current", Float8CurrentScaling()), ("delayed", DelayedScaling())):
        torch.manual_seed(0)
        linear = te_ops.Linear(32, 16)
        cache = FP8WeightCache()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))  # sizes CUDA's _scaled_mm takes (strict pass)
        with count_all_reduce() as calls:
            for micro in range(3):
                if micro == 1 and rank == 0:
                    with torch.no_grad():
                        linear.weight.mul_(1.0)  # same values, new version: rank 0's cache misses
                with autocast(recipe=recipe, amax_reduction_group=group, weight_cache=cache):
                    y = linear(x)
                y.sum().backward()
        out[name] = (len(calls), cache.hits, cache.misses)
    return out


def _run_all_cases(rank: int, world_size: int) -> dict[str, tuple[str, Any]]:
    """Run every case in this rank; a failure is reported per case, not fatal."""
    results: dict[str, tuple[str, Any]] = {}
    for name, fn in _CASES.items():
        try:
            results[name] = ("ok", fn(rank, world_size))
        except Exception:  # noqa: BLE001 - reported to the parent per case
            results[name] = ("fail", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def rank_results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(WORLD_SIZE, _run_all_cases, timeout=90)


def _case_values(rank_results: list[dict], name: str) -> list[Any]:
    values = []
    for rank, res in enumerate(rank_results):
        status, value = res[name]
        if status != "ok":
            pytest.fail(f"case {name} failed on rank {rank}:\n{value}", pytrace=False)
        values.append(value)
    return values


def test_delayed_scaling_forward_and_backward_reduce_once_and_agree(rank_results) -> None:
    r0, r1 = _case_values(rank_results, "delayed_forward_and_backward")
    assert r0 == r1
    assert len({tuple(s) for s in r0["scales"]}) > 1  # scales really changed over steps


def test_nan_amax_on_one_rank_is_handled_identically(rank_results) -> None:
    r0, r1 = _case_values(rank_results, "delayed_nan_on_one_rank")
    assert r0 == r1


def test_nested_autocast_joins_outer_buffer(rank_results) -> None:
    r0, r1 = _case_values(rank_results, "nested_autocast_issues_one_collective")
    assert r0 == r1


def test_no_collective_without_reduction(rank_results) -> None:
    r0, r1 = _case_values(rank_results, "reduce_amax_false_and_single_rank_groups")
    assert r0["local_scale"] != r1["local_scale"]  # per-rank scales, as asked


def test_current_scaling_with_group_gives_identical_scales(rank_results) -> None:
    r0, r1 = _case_values(rank_results, "current_scaling_with_group")
    assert r0 == r1


def test_weight_cache_never_skips_a_collective_cast_on_one_rank(rank_results) -> None:
    r0, r1 = _case_values(rank_results, "weight_cache_when_one_ranks_cache_misses")
    # Current scaling: no reuse, the same collectives on both ranks (old code: rank 1 reused
    # its cast and rank 0 waited in the weight's amax all-reduce until the timeout).
    assert r0["current"] == r1["current"] and r0["current"][1:] == (0, 0)
    # Delayed scaling: reuse decided per rank (rank 0 missed once more), same collectives.
    assert r0["delayed"][0] == r1["delayed"][0]
    assert r0["delayed"][1:] == (1, 2) and r1["delayed"][1:] == (2, 1)


def _raises_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("expected failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the helper's grace kill


def test_run_distributed_reports_rank_failures_without_hanging() -> None:
    from dist_utils import DistributedTestError

    with pytest.raises(DistributedTestError, match=r"(?s)rank 1.*KeyError: 'expected failure on rank 1'"):
        run_distributed(WORLD_SIZE, _raises_on_rank_1, timeout=60)
