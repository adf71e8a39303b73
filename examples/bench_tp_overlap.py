"""Benchmark: the tensor-parallel overlap fusions (fused ops) vs the unfused ops, fp32 and FP8.

Run:
    torchrun --standalone --nproc-per-node=2 examples/bench_tp_overlap.py
    torchrun --standalone --nproc-per-node=2 examples/bench_tp_overlap.py --rs-splits 4 --repeats 21

Measures the forward pass of two tp_fuse.ops.Sequential models (no autograd graph):

    AG+GEMM   [AllGather, BasicLinear 'fc1']    -> UserbuffersForwardLinear, ring_exchange
    GEMM+RS   [BasicLinear 'fc2', ReduceScatter] -> UserbuffersForwardLinear, pipeline / ring

in high precision and under ``tp_fuse.autocast`` (delayed scaling, HYBRID), and prints

    t_gemm     the fused op with its communication calls replaced by no-ops: the same
               chunked GEMMs, copies and FP8 casts, nothing on the wire
    t_comm     the collective alone (tp_fuse.comm.all_gather_dim0 of what the fused op sends:
               fp32 rows, or FP8 bytes; tp_fuse.comm.reduce_scatter_dim0 of the fp32 GEMM output)
    t_unfused  the same Sequential with overlap switched off in its OverlapConfig
               (FP8: the unfused AllGather moves fp32 and BasicLinear quantizes after it)
    t_fused    the Sequential with the overlap fusion
    exposed    (t_fused - t_gemm) / t_comm      (0: communication fully hidden)
    fused/unf  t_fused / t_unfused
    t_auto     the Sequential with ``OverlapConfig(auto=True)``: at its first call (before
               timing) the tuner measured the methods that apply and ``unfused`` and picked
               one (``choice``); auto/unf = t_auto / t_unfused, and [q1, q3] the quartiles of
               the per-repeat ratios (auto and unfused run back to back in each repeat), the
               spread that says what "equal within noise" means in this run

Timing (medians after warm-up, variants interleaved, slowest rank per sample) reuses
``_timed`` from ``bench_comm_overlap.py`` (the raw-algorithm benchmark of ``comm``).
Shapes default to ones where communication is at least 20% of the GEMM for each precision
(FP8 moves 1/4 of the bytes and ``torch._scaled_mm`` is slower than fp32 matmul on CPU,
hence a narrower FP8 all-gather GEMM). On CPU the GEMMs and gloo's transfer threads share
the cores; see the closing note printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch

from tp_fuse import comm
import tp_fuse
from tp_fuse.ops import AllGather, BasicLinear, ReduceScatter, Sequential
from tp_fuse.overlap.config import OverlapConfig, TPOverlap
from tp_fuse.recipe import DelayedScaling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_comm_overlap import _timed  # noqa: E402 - shared timing helper of the comm benchmark


def _shape(s: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in s.split(","))
    return m, k, n


@contextlib.contextmanager
def no_comm() -> Iterator[None]:
    """Replace the transfers of the ring all-gather and the pipelined/ring reduce-scatter
    by no-ops, so that the fused op runs only its compute (for t_gemm)."""
    ag = importlib.import_module("tp_fuse.comm.overlap.ag_gemm")
    rs = importlib.import_module("tp_fuse.comm.overlap.gemm_rs_pipelined")
    ring = importlib.import_module("tp_fuse.comm.overlap.gemm_rs_ring")
    from tp_fuse.comm.overlap.collectives import PendingCollective

    saved = (ag.exchange, rs._start_reduce_scatter, ring.exchange)
    ag.exchange = ring.exchange = lambda *a, **k: []
    rs._start_reduce_scatter = lambda partial, dst, *a, **k: PendingCollective([], dst)
    try:
        yield
    finally:
        ag.exchange, rs._start_reduce_scatter, ring.exchange = saved


def compute_only(seq: Sequential, x: torch.Tensor) -> Callable[[], None]:
    """``seq(x)`` without communication (t_gemm)."""

    def run() -> None:
        with no_comm():
            seq(x)

    return run


def _measure(variants: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, Any]:
    """Median wall time (slowest rank) per variant, variants interleaved, plus the quartiles
    of the per-repeat ratio auto/unfused (``auto_q``)."""
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            wall, _ = _timed(fn)
            if i >= warmup:
                samples[name].append(wall)
    res: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    ratios = [a / u for a, u in zip(samples["auto"], samples["unfused"])]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    res["auto_q"] = (q[0], q[2])
    return res


def _trio(make: Callable[[TPOverlap], Sequential], cfg: OverlapConfig) -> tuple[Sequential, Sequential, Sequential]:
    """(fused, unfused, auto) copies of one model with the same weights."""
    torch.manual_seed(0)
    fused = make(TPOverlap(cfg))
    torch.manual_seed(0)
    unfused = make(TPOverlap(OverlapConfig(enabled=False)))
    torch.manual_seed(0)
    auto = make(TPOverlap(OverlapConfig(auto=True)))
    return fused, unfused, auto


def _choice(seq: Sequential) -> str:
    ov = seq.fusers()[0].forward_ops
    plans = [op.plan for op, _ in ov if hasattr(op, "plan")]
    return ",".join(d.choice for p in plans for d in p.overlap.tuner.decisions_for(p.key)) or "?"


def _check_fused(seq: Sequential, name: str) -> None:
    types = [type(op).__name__ for op, _ in seq.fusers()[0].forward_ops]
    if "UserbuffersForwardLinear" not in types:
        raise RuntimeError(f"{name}: the overlap fusion did not happen:\n{seq.explain()}")


def _shape_check_cost(group, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds of the comm ops' shape-agreement check: a new signature (collective)
    and an agreed one (cached lookup, averaged over 1000 calls)."""
    w = torch.empty(x.shape[1], x.shape[1])
    first, cached = [], []
    for _ in range(repeats):
        agreement = comm.ShapeAgreement()
        t0 = time.perf_counter()
        agreement.check(group, "bench", [x, w], ("input", "weight"))
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(1000):
            agreement.check(group, "bench", [x, w], ("input", "weight"))
        cached.append((time.perf_counter() - t0) / 1000)
    return statistics.median(first), statistics.median(cached)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ag-shape", type=_shape, default=(2048, 1024, 160), help="fp32 m_local,k,n: x_local [m,k], W [n,k]")
    p.add_argument("--ag-shape-fp8", type=_shape, default=(2048, 1024, 32), help="FP8 m_local,k,n")
    p.add_argument("--rs-shape", type=_shape, default=(1024, 160, 1024), help="m_local,k,n: x [tp*m,k], W [n,k]")
    p.add_argument("--rs-splits", type=int, default=2, help="num_splits of the pipelined GEMM+RS")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    ctx = comm.init_distributed()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    topo = comm.ParallelTopology(tp="auto")
    group, tp, rank = topo.tp_group, topo.tp_size, topo.tp_rank
    gen = torch.Generator().manual_seed(1234 + rank)
    rows = []

    for fp8 in (False, True):
        prec = "fp8" if fp8 else "fp32"
        recipe = DelayedScaling()
        autocast = (lambda: tp_fuse.autocast(recipe=recipe)) if fp8 else contextlib.nullcontext

        # ---------------- AllGather + GEMM (column parallel) ----------------
        m, k, n = args.ag_shape_fp8 if fp8 else args.ag_shape
        fused, unfused, auto = _trio(
            lambda ov: Sequential(AllGather(group, overlap=ov), BasicLinear(k, n, userbuffers_options={"comm_name": "fc1"})),
            OverlapConfig(),
        )
        x = torch.randn(m, k, generator=gen)
        lin = fused[1]
        with torch.no_grad(), autocast():
            fused(x)  # decides the fusion (and the FP8 quantizers) before timing
            auto(x)  # measures and decides the auto choice before timing
            _check_fused(fused, "AG+GEMM")
            _check_fused(auto, "AG+GEMM auto")
            wire = x
            if fp8:  # what the fused op sends: this rank's FP8 bytes
                wire = lin.fp8_quantizers()["input"].quantize(x)._fp8.view(torch.uint8)
            t = _measure(
                {
                    "gemm": compute_only(fused, x),
                    "comm": lambda: comm.all_gather_dim0(wire, group),
                    "unfused": lambda: unfused(x),
                    "fused": lambda: fused(x),
                    "auto": lambda: auto(x),
                },
                args.warmup,
                args.repeats,
            )
        rows.append(("AG+GEMM ring", prec, f"{m}x{k}->{tp * m}x{n}", t, _choice(auto)))

        # ---------------- GEMM + ReduceScatter (row parallel) ----------------
        m, k, n = args.rs_shape
        x = torch.randn(tp * m, k, generator=gen)
        pool = comm.UserBufferPool()
        for method in ("pipeline", "ring_exchange"):
            cfg = OverlapConfig().with_entry("fc2_fprop", method=method, num_splits=args.rs_splits)
            fused, unfused, auto = _trio(
                lambda ov: Sequential(BasicLinear(k, n, userbuffers_options={"comm_name": "fc2"}), ReduceScatter(group, overlap=ov)),
                cfg,
            )
            with torch.no_grad(), autocast():
                y_full = torch.randn(tp * m, n, generator=gen)
                fused(x)
                auto(x)
                _check_fused(fused, "GEMM+RS")
                _check_fused(auto, "GEMM+RS auto")
                t = _measure(
                    {
                        "gemm": compute_only(fused, x),
                        "comm": lambda: comm.reduce_scatter_dim0(y_full, group, pool=pool),
                        "unfused": lambda: unfused(x),
                        "fused": lambda: fused(x),
                        "auto": lambda: auto(x),
                    },
                    args.warmup,
                    args.repeats,
                )
            label = f"GEMM+RS pipeline/{args.rs_splits}" if method == "pipeline" else "GEMM+RS ring"
            rows.append((label, prec, f"{tp * m}x{k}->{m}x{n}", t, _choice(auto)))

    check_first, check_cached = _shape_check_cost(group, torch.randn(args.rs_shape[0] * tp, args.rs_shape[1]),
                                                  args.repeats)
    if ctx.rank == 0:
        print(
            f"\ntp={tp} backend={ctx.backend} threads/rank={args.threads} torch={torch.__version__} "
            f"cpus={os.cpu_count()} load(1 min) {load_before:.1f} -> {os.getloadavg()[0]:.1f}; "
            f"forward pass, median of {args.repeats} after {args.warmup} warm-up (ms)"
        )
        hdr = (f"{'fused op':<20}{'prec':<6}{'shape':<22}{'t_gemm':>8}{'t_comm':>8}{'comm/gemm':>10}"
               f"{'t_unfused':>10}{'t_fused':>9}{'exposed':>9}{'fused/unf':>10}"
               f"{'t_auto':>8}{'auto/unf':>9}  {'[q1, q3]':<14}choice")
        print(hdr)
        print("-" * len(hdr))
        for name, prec, shape, r, choice in rows:
            exposed = (r["fused"] - r["gemm"]) / r["comm"]
            print(
                f"{name:<20}{prec:<6}{shape:<22}{r['gemm'] * 1e3:>8.2f}{r['comm'] * 1e3:>8.2f}"
                f"{r['comm'] / r['gemm']:>10.2f}{r['unfused'] * 1e3:>10.2f}{r['fused'] * 1e3:>9.2f}"
                f"{exposed:>9.2f}{r['fused'] / r['unfused']:>10.2f}"
                f"{r['auto'] * 1e3:>8.2f}{r['auto'] / r['unfused']:>9.2f}  "
                f"{'[%.2f, %.2f]' % r['auto_q']:<14}{choice}"
            )
        fastest = min(r["fused"] for _, _, _, r, _ in rows)
        print(f"cross-rank shape check (every TP comm op, by default): first call per shape signature "
              f"{check_first * 1e3:.3f} ms (one all-gather of 20 int64), then {check_cached * 1e6:.2f} us per call "
              f"= {check_cached / fastest * 100:.4f}% of the fastest fused op above")
        print("targets: exposed <= 0.15, fused/unf <= 0.9. On a CPU box the GEMM of each rank and")
        print("gloo's copy/transfer threads compete for the same cores, so communication can only")
        print("hide behind a GEMM when idle cores exist (cpus > ranks * threads).")
    ctx.shutdown()


if __name__ == "__main__":
    main()
