"""ParallelTopology: size resolution and validation, group layout on 4 gloo ranks, world size 1."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tp_fuse.comm import resolve_parallel_sizes
from dist_utils import run_distributed


@pytest.mark.parametrize(
    "tp, dp, world, expected",
    [
        ("auto", "auto", 4, (4, 1)),
        ("auto", 2, 4, (2, 2)),
        (2, "auto", 8, (2, 4)),
        (1, 4, 4, (1, 4)),
        (4, 1, 4, (4, 1)),
        ("auto", "auto", 1, (1, 1)),
    ],
)
def test_resolve_parallel_sizes(tp, dp, world, expected) -> None:
    assert resolve_parallel_sizes(tp, dp, world) == expected


@pytest.mark.parametrize(
    "tp, dp, world, needles",
    [
        (3, 2, 4, ["tp (3)", "dp (2)", "6", "world size (4)"]),
        (2, 1, 4, ["tp (2)", "dp (1)", "world size (4)"]),
        (3, "auto", 4, ["tp=3", "world size 4"]),
        ("auto", 3, 8, ["dp=3", "world size 8"]),
        (0, "auto", 4, ["tp must be a positive int", "0"]),
        (True, "auto", 4, ["tp must be a positive int"]),
        ("all", "auto", 4, ["tp must be a positive int or 'auto'"]),
        (2, -1, 4, ["dp must be a positive int"]),
    ],
)
def test_resolve_parallel_sizes_errors(tp, dp, world, needles) -> None:
    with pytest.raises(ValueError) as info:
        resolve_parallel_sizes(tp, dp, world)
    for n in needles:
        assert n in str(info.value), str(info.value)


def _topology_cases(rank: int, world: int) -> list[str]:
    import torch

    from tp_fuse.comm import FP8_GROUP_KINDS, ParallelTopology

    assert world == 4
    seen = []
    for tp, dp in [(2, 2), ("auto", "auto"), (1, 4), (2, "auto"), ("auto", 4)]:
        topo = ParallelTopology(tp=tp, dp=dp)
        T, D = topo.tp_size, topo.dp_size
        assert T * D == world
        # TP groups are consecutive ranks; DP groups stride by T.
        assert topo.tp_ranks == [(rank // T) * T + i for i in range(T)], (tp, dp, topo.tp_ranks)
        assert topo.dp_ranks == [rank % T + j * T for j in range(D)], (tp, dp, topo.dp_ranks)
        assert (topo.tp_rank, topo.dp_rank) == (rank % T, rank // T)
        assert topo.tp_group.size() == T and topo.dp_group.size() == D
        assert topo.fp8_group("tp") is topo.tp_group
        assert topo.fp8_group("dp") is topo.dp_group
        assert topo.fp8_group("world").size() == world
        # The groups work: a sum over the TP group counts its members.
        t = torch.ones(1)
        dist.all_reduce(t, group=topo.tp_group)
        assert t.item() == T
        for kind in FP8_GROUP_KINDS:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=topo.fp8_group(kind))
            assert t.item() == max(dist.get_process_group_ranks(topo.fp8_group(kind)))
        seen.append(repr(topo))
    # user mistakes: raised before any group is created, on every rank (no hang)
    for kwargs, needle in [({"tp": 3}, "tp=3"), ({"tp": 2, "dp": 3}, "tp (2) * dp (3) = 6")]:
        try:
            ParallelTopology(**kwargs)
        except ValueError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError for {kwargs}")
    topo = ParallelTopology(tp=2)
    try:
        topo.fp8_group("pp")
    except ValueError as e:
        assert "'pp'" in str(e) and "tp" in str(e)
    else:
        raise AssertionError("fp8_group('pp') accepted")
    dist.barrier()
    return seen


@pytest.mark.multirank
def test_topology_layout_on_four_ranks() -> None:
    reprs = run_distributed(4, _topology_cases, timeout=90)
    assert "tp=2" in reprs[3][0] and "tp_rank=1" in reprs[3][0] and "dp_rank=1" in reprs[3][0]


def _single_rank_topology(rank: int, world: int) -> str:
    from tp_fuse.comm import ParallelTopology

    topo = ParallelTopology()
    assert (topo.tp_size, topo.dp_size, topo.tp_rank, topo.dp_rank) == (1, 1, 0, 0)
    assert topo.device_type == "cpu"
    assert topo.fp8_group("world").size() == 1
    return repr(topo)


@pytest.mark.multirank
def test_topology_world_size_one() -> None:
    assert "tp=1" in run_distributed(1, _single_rank_topology, timeout=60)[0]


def test_topology_needs_process_group() -> None:
    from tp_fuse.comm import ParallelTopology

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group is initialized in this pytest process")
    with pytest.raises(ValueError, match="initialized default process group"):
        ParallelTopology(tp=1)
