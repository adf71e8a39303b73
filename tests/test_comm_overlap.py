"""Overlap algorithms against the unfused path and a float64 reference (gloo, 2 and 4 ranks).

Every rank can build every rank's inputs from shared seeds, so the float64 reference is
computed locally without communication; the fp32 unfused reference uses the plain
collectives (all-gather then matmul; matmul then reduce-scatter / all-reduce).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tp_fuse.strict import strict_cuda_enabled

from dist_utils import run_distributed

RTOL = 1e-5  # relative to the largest reference entry, as the task requires


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = _rel_err(got, ref)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def _rand(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _mm(w: torch.Tensor):
    """GEMM callable with the comm contract: writes chunk @ w^T into out."""
    return lambda chunk, out: torch.matmul(chunk, w.t(), out=out)


def _expect_value_error(fn, *needles: str) -> None:
    try:
        fn()
    except ValueError as e:
        for n in needles:
            assert n in str(e), f"expected {n!r} in error message: {e}"
    else:
        raise AssertionError(f"expected ValueError containing {needles}")


# Shapes: (m_local, k, n, extra middle dims)
SHAPES = [(3, 7, 5, ()), (8, 16, 12, ()), (4, 6, 3, (2,))]


def _overlap_cases(rank: int, world: int) -> int:
    from tp_fuse import comm
    from tp_fuse.comm.overlap.collectives import PendingCollective

    group = dist.group.WORLD
    ncases = 0
    for dtype in (torch.float32, torch.float64):
        for si, (m, k, n, mid) in enumerate(SHAPES):
            if dtype == torch.float64 and si > 0:
                continue
            pool = comm.UserBufferPool()  # one per shape: growth warnings are tested elsewhere
            seed = 1000 * si
            tol = RTOL if dtype == torch.float32 else 1e-12
            tag = f"[{dtype}, m={m}, k={k}, n={n}, mid={mid}, world={world}]"
            # ---------------- AllGather + GEMM (column parallel) ----------------
            xs = [_rand(seed + r, m, *mid, k, dtype=dtype) for r in range(world)]
            w = _rand(seed + 100 + rank, n, k, dtype=dtype)  # this rank's weight shard
            x_full = torch.cat(xs)
            ref64 = x_full.double() @ w.double().t()
            unfused = comm.all_gather_dim0(xs[rank], group) @ w.t()
            _close(unfused, ref64, f"unfused AG+GEMM vs float64 {tag}", tol)
            for ret in (False, True):
                res = comm.ring_exchange_ag_gemm(
                    xs[rank], _mm(w), group, pool, out_features=n, return_gathered=ret
                )
                out, gathered = res if ret else (res, None)
                _close(out, unfused, f"ring AG+GEMM vs unfused {tag}", tol)
                _close(out, ref64, f"ring AG+GEMM vs float64 {tag}", tol)
                if ret:
                    assert torch.equal(gathered, x_full), f"gathered input differs {tag}"
                ncases += 1
            # preallocated output is written in place
            pre = torch.full((world * m, *mid, n), float("nan"), dtype=dtype)
            got = comm.ring_exchange_ag_gemm(xs[rank], _mm(w), group, pool, out=pre)
            assert got is pre and not torch.isnan(pre).any(), f"out= not filled in place {tag}"
            # a GEMM that ignores `out` still produces the right answer (copied in)
            got = comm.ring_exchange_ag_gemm(xs[rank], lambda c, o: c @ w.t(), group, pool, out_features=n)
            _close(got, unfused, f"ring AG+GEMM (gemm ignoring out) {tag}", tol)

            # ---------------- GEMM + ReduceScatter (row parallel) ----------------
            xs_rs = [_rand(seed + 200 + r, world * m, *mid, k, dtype=dtype) for r in range(world)]
            ws_rs = [_rand(seed + 300 + r, n, k, dtype=dtype) for r in range(world)]
            full64 = sum(xs_rs[r].double() @ ws_rs[r].double().t() for r in range(world))
            ref64 = full64[rank * m : (rank + 1) * m]
            x, w = xs_rs[rank], ws_rs[rank]
            for impl in ("collective", "all_to_all"):
                unfused = comm.reduce_scatter_dim0(x @ w.t(), group, impl=impl)
                _close(unfused, ref64, f"unfused GEMM+RS[{impl}] vs float64 {tag}", tol)
                for splits in sorted({1, 2, 3, m} & set(range(1, m + 1))):
                    got = comm.gemm_reduce_scatter_pipelined(
                        x, _mm(w), group, pool, num_splits=splits, out_features=n, impl=impl
                    )
                    _close(got, unfused, f"pipelined GEMM+RS[{impl}, splits={splits}] vs unfused {tag}", tol)
                    _close(got, ref64, f"pipelined GEMM+RS[{impl}, splits={splits}] vs float64 {tag}", tol)
                    ncases += 1
                _expect_value_error(
                    lambda: comm.gemm_reduce_scatter_pipelined(
                        x, _mm(w), group, pool, num_splits=m + 1, out_features=n, impl=impl
                    ),
                    f"num_splits={m + 1}",
                    str(m),
                )
            got = comm.gemm_reduce_scatter_ring(x, _mm(w), group, pool, out_features=n)
            _close(got, unfused, f"ring GEMM+RS vs unfused {tag}", tol)
            _close(got, ref64, f"ring GEMM+RS vs float64 {tag}", tol)
            ncases += 1

            # ---------------- GEMM + AllReduce ----------------
            rows = m * world
            xs_ar = [_rand(seed + 400 + r, rows, *mid, k, dtype=dtype) for r in range(world)]
            ws_ar = [_rand(seed + 500 + r, n, k, dtype=dtype) for r in range(world)]
            ref64 = sum(xs_ar[r].double() @ ws_ar[r].double().t() for r in range(world))
            x, w = xs_ar[rank], ws_ar[rank]
            unfused = comm.all_reduce(x @ w.t(), group)
            _close(unfused, ref64, f"unfused GEMM+AR vs float64 {tag}", tol)
            for splits in (1, 2, 3, rows):
                got = comm.gemm_all_reduce_chunked(x, _mm(w), group, num_splits=splits, out_features=n)
                _close(got, unfused, f"chunked GEMM+AR[splits={splits}] vs unfused {tag}", tol)
                _close(got, ref64, f"chunked GEMM+AR[splits={splits}] vs float64 {tag}", tol)
                ncases += 1
            _expect_value_error(
                lambda: comm.gemm_all_reduce_chunked(x, _mm(w), group, num_splits=rows + 1, out_features=n),
                f"num_splits={rows + 1}",
            )

            # ---------------- bulk overlap ----------------
            a, b = _rand(seed + 600, 9, k, dtype=dtype), _rand(seed + 601, k, 4, dtype=dtype)
            gathered, prod = comm.bulk_overlap(
                lambda: comm.all_gather_dim0_async(xs[rank], group), lambda: a @ b
            )
            assert torch.equal(gathered, x_full), f"bulk all-gather {tag}"
            _close(prod, a.double() @ b.double(), f"bulk compute {tag}", tol)
            ncases += 1

    # ---- user mistakes raise on every rank before any communication; the group survives ----
    pool = comm.UserBufferPool()
    x = _rand(7, 2 * world + 1, 5)  # rows not divisible by the TP size
    w = _rand(8, 3, 5)
    for fn in (
        lambda: comm.gemm_reduce_scatter_pipelined(x, _mm(w), group, pool, out_features=3),
        lambda: comm.gemm_reduce_scatter_ring(x, _mm(w), group, pool, out_features=3),
        lambda: comm.reduce_scatter_dim0(x, group),
    ):
        _expect_value_error(fn, str(2 * world + 1), str(world))
    _expect_value_error(lambda: comm.ring_exchange_ag_gemm(x, _mm(w), group, pool), "out_features")
    _expect_value_error(
        lambda: comm.ring_exchange_ag_gemm(x, lambda c, o: c[:, :2] @ w[:, :2].t()[:, :1], group, pool,
                                           out_features=3),
        "gemm returned",
    )  # every rank raises at step 0; the posted exchange completes on its own
    _expect_value_error(lambda: comm.gemm_reduce_scatter_pipelined(
        _rand(1, 2 * world, 5), _mm(w), group, pool, num_splits=0, out_features=3), "num_splits")
    _expect_value_error(lambda: comm.bulk_overlap(lambda: None, lambda: 1), "PendingCollective")
    # mismatched shapes across ranks: detected by the collective check, on every rank
    bad = _rand(9, 2 + rank, 5)
    _expect_value_error(lambda: comm.ring_exchange_ag_gemm(
        bad, _mm(w), group, pool, out_features=3, check_shapes=True), "rank 0: (2, 5)", "rank 1: (3, 5)")
    t = torch.ones(3)
    comm.all_reduce(t, group, inplace=True)
    assert torch.equal(t, torch.full((3,), float(world))), "group unusable after errors"
    assert isinstance(comm.all_reduce_async(t, group), PendingCollective)
    return ncases


def _bytes_and_reuse_cases(rank: int, world: int) -> None:
    from tp_fuse import comm

    group = dist.group.WORLD
    pool = comm.UserBufferPool()
    # ---- uint8 payloads (FP8 bytes) round-trip exactly through the ring ----
    m, k = 5, 11
    g = torch.Generator().manual_seed(42)
    all_bytes = torch.randint(0, 256, (world * m, k), generator=g, dtype=torch.uint8)
    mine = all_bytes[rank * m : (rank + 1) * m]
    out, gathered = comm.ring_exchange_ag_gemm(
        mine, lambda c, o: o.copy_(c), group, pool, out_features=k, out_dtype=torch.uint8, return_gathered=True
    )
    assert out.dtype == torch.uint8 and torch.equal(out, all_bytes), "bytes changed on the ring"
    assert torch.equal(gathered, all_bytes)
    assert torch.equal(comm.all_gather_dim0(mine, group, impl="p2p"), all_bytes)
    assert torch.equal(comm.all_gather_dim0(mine, group, impl="collective"), all_bytes)
    # An FP8 GEMM in the caller's hands: bytes travel, the callable reinterprets them.
    if hasattr(torch, "float8_e4m3fn"):
        f8 = _rand(43, world * m, k).to(torch.float8_e4m3fn)
        w = _rand(44 + rank, 3, k)
        ref = f8.float() @ w.t()
        got = comm.ring_exchange_ag_gemm(
            f8[rank * m : (rank + 1) * m].view(torch.uint8),
            lambda c, o: torch.matmul(c.view(torch.float8_e4m3fn).float(), w.t(), out=o),
            group, pool, out_features=3, out_dtype=torch.float32,
        )  # fmt: skip
        _close(got, ref, "FP8-bytes AG+GEMM")
        _expect_value_error(lambda: comm.ring_exchange_ag_gemm(f8[:m], _mm(w), group, pool, out_features=3),
                            "uint8")  # fmt: skip
        _expect_value_error(lambda: comm.ring_exchange_ag_gemm(f8[:m].view(torch.uint8), _mm(w), group, pool,
                                                               out_features=3), "out_dtype")  # fmt: skip

    # ---- userbuffer reuse: the algorithms hit the same storage every step, no growth ----
    pool = comm.UserBufferPool()
    x = _rand(50 + rank, 4, 6)
    w = _rand(60 + rank, 5, 6)
    xr = _rand(70 + rank, 4 * world, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ptrs = []
        for _ in range(3):
            comm.ring_exchange_ag_gemm(x, _mm(w), group, pool, out_features=5)
            comm.gemm_reduce_scatter_pipelined(xr, _mm(w), group, pool, num_splits=2, out_features=5)
            comm.gemm_reduce_scatter_ring(xr, _mm(w), group, pool, out_features=5)
            ptrs.append(pool.get(group, "ag_gemm.gathered", (world * 4, 6), torch.float32, "cpu").data_ptr())
            ptrs.append(pool.get(group, "gemm_rs.partial0", (world * 2, 5), torch.float32, "cpu").data_ptr())
            ptrs.append(pool.get(group, "gemm_rs_ring.acc0", (4, 5), torch.float32, "cpu").data_ptr())
        assert ptrs[0:3] == ptrs[3:6] == ptrs[6:9], "pool buffers reallocated between steps"
        nbuf = len(pool)
        comm.ring_exchange_ag_gemm(x, _mm(w), group, pool, out_features=5)
        assert len(pool) == nbuf
    grow = [c for c in caught if "UserBufferPool" in str(c.message)]
    assert not grow, f"unexpected growth warnings: {[str(c.message) for c in grow]}"
    # a larger step grows the gathered buffer once, then reuses it
    x_big = _rand(80 + rank, 9, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = comm.ring_exchange_ag_gemm(x_big, _mm(w), group, pool, out_features=5)
    grow = [str(c.message) for c in caught if "UserBufferPool" in str(c.message)]
    assert len(grow) == 1, grow
    assert "ag_gemm.gathered" in grow[0] and str(world * 4 * 6 * 4) in grow[0] and str(world * 9 * 6 * 4) in grow[0]
    ref = torch.cat([_rand(80 + r, 9, 6) for r in range(world)]) @ w.t()
    _close(got, ref, "AG+GEMM after growth")


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_overlap_algorithms_match_unfused_and_float64(world: int) -> None:
    counts = run_distributed(world, _overlap_cases, timeout=90)
    assert all(c == counts[0] and c > 40 for c in counts), counts


class _LoggedWork:
    def __init__(self, work, log: list[str], tag: str) -> None:
        self._work, self._log, self._tag = work, log, tag

    def wait(self) -> bool:
        self._log.append(f"wait {self._tag}")
        return self._work.wait()


def _issue_order_cases(rank: int, world: int) -> None:
    """The GEMM of step s is issued after step s's communication is posted and before it
    is waited on (the definition of overlap), checked by logging the calls."""
    from tp_fuse import comm

    group = dist.group.WORLD
    pool = comm.UserBufferPool()
    log: list[str] = []
    real = {n: getattr(dist, n) for n in ("batch_isend_irecv", "all_to_all_single", "all_reduce")}

    def logged(name: str):
        def call(*args, **kwargs):
            res = real[name](*args, **kwargs)
            log.append(f"post {name}")
            if isinstance(res, list):
                return [_LoggedWork(w, log, name) for w in res]
            return _LoggedWork(res, log, name) if res is not None else None
        return call

    def gemm(w):
        def g(chunk, out):
            log.append("gemm")
            return torch.matmul(chunk, w.t(), out=out)
        return g

    w = _rand(1, 3, 4)
    expected = {
        # ring AG, tp=2: post exchange, GEMM on the held block, wait, GEMM on the received one
        "ag": ["post batch_isend_irecv", "gemm", "wait batch_isend_irecv", "wait batch_isend_irecv", "gemm"],
        # pipelined RS, 2 chunks: chunk 1's GEMM runs while chunk 0's all-to-all is in flight,
        # and chunk 1's all-to-all starts before chunk 0's is waited on
        "rs_pipe": ["gemm", "post all_to_all_single", "gemm", "post all_to_all_single",
                    "wait all_to_all_single", "wait all_to_all_single"],
        # ring RS, tp=2: the final GEMM runs while the partial sum travels
        "rs_ring": ["gemm", "post batch_isend_irecv", "gemm", "wait batch_isend_irecv", "wait batch_isend_irecv"],
        # chunked AR, 2 chunks: chunk 1's GEMM runs while chunk 0's all-reduce is in flight
        "ar": ["gemm", "post all_reduce", "gemm", "post all_reduce", "wait all_reduce", "wait all_reduce"],
    }  # fmt: skip
    runs = {
        "ag": lambda: comm.ring_exchange_ag_gemm(_rand(2 + rank, 2, 4), gemm(w), group, pool, out_features=3),
        "rs_pipe": lambda: comm.gemm_reduce_scatter_pipelined(
            _rand(3 + rank, 4, 4), gemm(w), group, pool, num_splits=2, out_features=3, impl="all_to_all"),
        "rs_ring": lambda: comm.gemm_reduce_scatter_ring(_rand(3 + rank, 4, 4), gemm(w), group, pool, out_features=3),
        "ar": lambda: comm.gemm_all_reduce_chunked(_rand(4 + rank, 4, 4), gemm(w), group, num_splits=2,
                                                   out_features=3),
    }  # fmt: skip
    try:
        for n in real:
            setattr(dist, n, logged(n))
        for key, run in runs.items():
            log.clear()
            run()
            want = expected[key]
            if strict_cuda_enabled():
                # Strict mode first sends a shape descriptor along each ring edge (and waits).
                check = ["post batch_isend_irecv", "wait batch_isend_irecv", "wait batch_isend_irecv"]
                want = [e for item in want for e in ((check if item == "post batch_isend_irecv" else []) + [item])]
            assert log == want, f"{key}: issue order {log}"
    finally:
        for n, f in real.items():
            setattr(dist, n, f)


def _bytes_reuse_and_order_cases(rank: int, world: int) -> None:
    _bytes_and_reuse_cases(rank, world)
    _issue_order_cases(rank, world)


@pytest.mark.multirank
def test_uint8_payloads_userbuffer_reuse_and_issue_order() -> None:
    run_distributed(2, _bytes_reuse_and_order_cases, timeout=60)


def _identity_cases(rank: int, world: int) -> None:
    from tp_fuse import comm

    assert world == 1
    group = dist.group.WORLD
    pool = comm.UserBufferPool()
    x = _rand(1, 3, 7)
    w = _rand(2, 5, 7)
    ref = x @ w.t()
    assert comm.all_gather_dim0(x, group) is x
    assert comm.reduce_scatter_dim0(x, group) is x
    assert comm.all_reduce(x, group) is x
    out, gathered = comm.ring_exchange_ag_gemm(x, _mm(w), group, pool, out_features=5, return_gathered=True)
    assert gathered is x and torch.equal(out, ref)
    assert torch.equal(comm.gemm_reduce_scatter_pipelined(x, _mm(w), group, pool, num_splits=3, out_features=5), ref)
    assert torch.equal(comm.gemm_reduce_scatter_ring(x, _mm(w), group, pool, out_features=5), ref)
    assert torch.equal(comm.gemm_all_reduce_chunked(x, _mm(w), group, num_splits=2, out_features=5), ref)
    assert len(pool) == 0, "TP size 1 must not allocate communication buffers"
    _expect_value_error(lambda: comm.gemm_all_reduce_chunked(x, _mm(w), group, num_splits=4, out_features=5),
                        "num_splits=4")  # fmt: skip


@pytest.mark.multirank
def test_world_size_one_is_identity() -> None:
    run_distributed(1, _identity_cases, timeout=60)
