"""Plain dim-0 collectives (every implementation) against a float64 reference, their
error checks (raised on every rank before any communication), and check_shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed


def _rand(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _raises(fn, *needles: str) -> None:
    try:
        fn()
    except ValueError as e:
        assert all(n in str(e) for n in needles), f"{needles} not all in: {e}"
    else:
        raise AssertionError(f"no ValueError (expected {needles})")


def _collective_cases(rank: int, world: int) -> int:
    from tp_fuse import comm

    g = dist.group.WORLD
    pool = comm.UserBufferPool()
    n = 0
    for shape in [(3, 7), (2, 3, 4), (5,)]:
        xs = [_rand(10 * r + len(shape), *shape) for r in range(world)]
        full = torch.cat(xs)
        for impl in ("auto", "collective", "p2p"):
            got = comm.all_gather_dim0(xs[rank], g, impl=impl)
            assert torch.equal(got, full), (impl, shape)
            out = torch.empty_like(full)
            assert comm.all_gather_dim0(xs[rank], g, impl=impl, out=out) is out and torch.equal(out, full)
            n += 1
        # reduce-scatter: every rank contributes a full [world * m, ...] tensor
        big = [_rand(100 + 10 * r + len(shape), world * shape[0], *shape[1:]) for r in range(world)]
        ref = sum(b.double() for b in big)[rank * shape[0] : (rank + 1) * shape[0]]
        for impl in ("auto", "collective", "all_to_all"):
            got = comm.reduce_scatter_dim0(big[rank], g, impl=impl)
            assert got.shape == ref.shape and _rel(got, ref) < 1e-6, (impl, shape, _rel(got, ref))
            out = torch.empty(ref.shape)
            assert comm.reduce_scatter_dim0(big[rank], g, impl=impl, out=out) is out
            got = comm.reduce_scatter_dim0(big[rank], g, impl=impl, pool=pool)
            assert _rel(got, ref) < 1e-6, (impl, shape, "pool")
            n += 1
        ref = sum(x.double() for x in xs)
        x = xs[rank].clone()
        got = comm.all_reduce(x, g)
        assert _rel(got, ref) < 1e-6 and torch.equal(x, xs[rank]), "all_reduce must not modify its input"
        assert comm.all_reduce(x, g, inplace=True) is x and _rel(x, ref) < 1e-6
        got = comm.all_reduce(xs[rank], g, op=dist.ReduceOp.MAX)
        assert torch.equal(got, torch.stack(xs).amax(0))
        n += 1
    # uint8 bytes gather exactly
    b = torch.arange(rank * 6, rank * 6 + 6, dtype=torch.uint8).view(2, 3)
    assert torch.equal(comm.all_gather_dim0(b, g), torch.arange(world * 6, dtype=torch.uint8).view(-1, 3))
    # async form: launch, compute, wait (idempotent)
    p = comm.reduce_scatter_dim0_async(torch.ones(world * 2, 3), g, impl="all_to_all")
    _ = torch.randn(16, 16) @ torch.randn(16, 16)
    assert torch.equal(p.wait(), torch.full((2, 3), float(world))) and p.wait() is p.wait()

    # local checks: every rank raises before communicating, the group stays usable
    _raises(lambda: comm.reduce_scatter_dim0(torch.ones(2 * world + 1, 2), g),
            f"first dimension {2 * world + 1}", f"TP size {world}")  # fmt: skip
    _raises(lambda: comm.all_gather_dim0(torch.ones(2, 2), g, out=torch.empty(2, 2)), "out must be")
    _raises(lambda: comm.reduce_scatter_dim0(torch.ones(world, 2), g, impl="ring"), "impl must be one of")
    _raises(lambda: comm.all_gather_dim0(torch.tensor(1.0), g), "0-d")
    assert comm.all_reduce(torch.tensor(1.0), g).item() == world  # scalars (a loss) are fine
    if hasattr(torch, "float8_e4m3fn"):
        _raises(lambda: comm.all_gather_dim0(torch.ones(2, 2).to(torch.float8_e4m3fn), g), "torch.uint8")
    _raises(lambda: comm.all_reduce(torch.ones(4, 4).t(), g, inplace=True), "contiguous")
    # cross-rank check: a shape mismatch raises on every rank, listing all shapes
    mism = torch.ones(world * (2 + rank % 2), 3)
    listing = "rank 0: (" + str(2 * world) + ", 3)"
    _raises(lambda: comm.reduce_scatter_dim0(mism, g, check_shapes=True), "disagree", listing)
    _raises(lambda: comm.all_reduce(mism, g, check_shapes=True), "disagree")
    _raises(lambda: comm.check_same_shape(torch.ones(3, dtype=torch.float32 if rank else torch.float64), g),
            "torch.float64", "torch.float32")  # fmt: skip
    comm.check_same_shape(torch.ones(2, 3), g)  # agreeing shapes pass
    t = comm.all_reduce(torch.ones(1), g)
    assert t.item() == world
    return n


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_plain_collectives(world: int) -> None:
    counts = run_distributed(world, _collective_cases, timeout=90)
    assert counts == [counts[0]] * world and counts[0] == 3 * (6 + 1)
