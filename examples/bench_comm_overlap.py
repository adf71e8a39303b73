"""Benchmark: communication/GEMM overlap vs the unfused path (CPU gloo or CUDA NCCL).

Run:
    torchrun --standalone --nproc-per-node=2 examples/bench_comm_overlap.py
    torchrun --standalone --nproc-per-node=2 examples/bench_comm_overlap.py --threads 2 --rs-splits 4

For each algorithm it measures, as medians over ``--repeats`` runs after ``--warmup``
(variants interleaved round-robin so that load drift hits all alike; each sample is the
slowest rank's time between two barriers):

    t_gemm     the fused algorithm's GEMMs (same chunks, same copies) without communication
    t_comm     the collective alone (tp_fuse.comm.all_gather_dim0 / reduce_scatter_dim0 / all_reduce,
               impl="auto": gloo -> point-to-point / all-to-all, NCCL -> native)
    t_unfused  collective then one GEMM (AG), or one GEMM then collective (RS, AR)
    t_fused    the overlap algorithm
    exposed    (t_fused - t_gemm) / t_comm   (0 = communication fully hidden)
    fused/unf  t_fused / t_unfused

Shapes are chosen so that communication is a sizeable fraction of the GEMM (comm/gemm is
printed); on CPU both ranks and gloo's threads share the machine's cores, so
``--threads`` (intra-op threads per rank, set here in the script, never in the library)
matters: see the printed configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from tp_fuse import comm


def _parse_shape(s: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in s.split(","))
    return m, k, n


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds of the slowest rank, CPU seconds of this process incl. all its threads)."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    return t.item(), cpu


def _measure(variants: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, float]:
    """Median wall time per variant, plus ``cpu:<variant>`` = median CPU-seconds per wall-second."""
    samples: dict[str, list[float]] = {k: [] for k in variants}
    util: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            wall, cpu = _timed(fn)
            if i >= warmup:
                samples[name].append(wall)
                util[name].append(cpu / wall)
    res = {k: statistics.median(v) for k, v in samples.items()}
    res.update({f"cpu:{k}": statistics.median(v) for k, v in util.items()})
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ag-shape", type=_parse_shape, default=(2048, 1024, 160),
                   help="m_local,k,n for AllGather+GEMM: x_local [m,k], weight shard [n,k]")
    p.add_argument("--rs-shape", type=_parse_shape, default=(1024, 160, 1024),
                   help="m_local,k,n for GEMM+ReduceScatter/AllReduce: x [tp*m,k], weight [n,k]")
    p.add_argument("--rs-splits", type=int, default=2, help="num_splits of the pipelined GEMM+RS")
    p.add_argument("--ar-splits", type=int, default=2, help="num_splits of the chunked GEMM+AR")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--compute", choices=("matmul", "sleep"), default="matmul",
                   help="sleep: replace each GEMM by a sleep of its calibrated duration (compute that "
                   "does not compete with communication for CPU, like a GPU's) to isolate the pipelining")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    ctx = comm.init_distributed()
    torch.set_num_threads(args.threads)
    topo = comm.ParallelTopology(tp="auto")
    group, tp, rank = topo.tp_group, topo.tp_size, topo.tp_rank
    dev = ctx.device
    pool = comm.UserBufferPool()
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev)

    rows: list[tuple[str, str, dict[str, float]]] = []

    def make_mm(w: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The GEMM every variant uses: real matmul, or a sleep of the same duration."""
        wt = w.t()

        def real(chunk: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            return torch.matmul(chunk, wt, out=o)

        if args.compute == "matmul":
            return real
        # Calibrate seconds per output row on the real GEMM, then sleep instead: compute
        # that leaves the CPU to communication, as a GPU's tensor cores would.
        probe_in = torch.randn(256, w.shape[1], device=dev)
        probe_out = torch.empty(256, w.shape[0], device=dev)
        real(probe_in, probe_out)
        t0 = time.perf_counter()
        for _ in range(5):
            real(probe_in, probe_out)
        per_row = (time.perf_counter() - t0) / (5 * 256)
        t = torch.tensor([per_row], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # same model on every rank
        per_row = t.item()

        def fake(chunk: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            time.sleep(per_row * chunk.shape[0])
            return o

        return fake

    # ---------------- AllGather + GEMM ----------------
    m, k, n = args.ag_shape
    x_local = randn(m, k)
    mm = make_mm(randn(n, k))
    out = torch.empty(tp * m, n, device=dev)
    gathered = torch.empty(tp * m, k, device=dev)

    def ag_gemm_only() -> None:
        # the ring algorithm's work minus communication: one GEMM per block (own block from
        # x_local, the others from the gathered buffer)
        for r in range(tp):
            src = x_local if r == rank else gathered[r * m : (r + 1) * m]
            mm(src, out[r * m : (r + 1) * m])

    t = _measure(
        {
            "gemm": ag_gemm_only,
            "comm": lambda: comm.all_gather_dim0(x_local, group, out=gathered),
            "comm_ring": lambda: comm.ring_exchange_ag_gemm(x_local, lambda c, o: o, group, pool, out=out),
            "comm_native": lambda: comm.all_gather_dim0(x_local, group, out=gathered, impl="collective"),
            "unfused": lambda: mm(comm.all_gather_dim0(x_local, group, out=gathered), out),
            "gemm_unfused": lambda: mm(gathered, out),
            "fused": lambda: comm.ring_exchange_ag_gemm(x_local, mm, group, pool, out=out),
        },
        args.warmup,
        args.repeats,
    )
    rows.append(("AG+GEMM ring", f"{m}x{k}->{tp * m}x{n}", t))

    # ---------------- GEMM + ReduceScatter ----------------
    m, k, n = args.rs_shape
    x = randn(tp * m, k)
    mm = make_mm(randn(n, k))
    full = torch.empty(tp * m, n, device=dev)
    rs_out = torch.empty(m, n, device=dev)
    S = args.rs_splits
    sizes = [len(c) for c in torch.arange(m).tensor_split(S)]
    xin = torch.empty(tp * sizes[0], k, device=dev)
    part = torch.empty(tp * sizes[0], n, device=dev)

    def rs_gemm_only() -> None:
        # the pipelined algorithm's work minus communication: strided copy + GEMM per chunk
        xb, lo = x.view(tp, m, k), 0
        for mi in sizes:
            ci = x
            if S > 1:
                ci = xin[: tp * mi]
                ci.view(tp, mi, k).copy_(xb[:, lo : lo + mi])
            mm(ci, part[: tp * mi])
            lo += mi

    acc, recv = torch.empty(m, n, device=dev), torch.zeros(m, n, device=dev)

    def ring_gemm_only() -> None:
        # the ring algorithm's work minus communication: one GEMM per block, plus the adds
        for s in range(tp):
            dst = rs_out if s == tp - 1 else acc
            mm(x[s * m : (s + 1) * m], dst)
            if s:
                dst.add_(recv)

    rs_common = {
        "comm": lambda: comm.reduce_scatter_dim0(full, group, out=rs_out, pool=pool),
        "comm_native": lambda: comm.reduce_scatter_dim0(full, group, out=rs_out, impl="collective"),
        "unfused": lambda: comm.reduce_scatter_dim0(mm(x, full), group, out=rs_out, pool=pool),
        "gemm_unfused": lambda: mm(x, full),
    }
    t = _measure(
        {
            "gemm": rs_gemm_only,
            **rs_common,
            "fused": lambda: comm.gemm_reduce_scatter_pipelined(x, mm, group, pool, num_splits=S, out=rs_out),
        },
        args.warmup,
        args.repeats,
    )
    rows.append((f"GEMM+RS pipelined/{S}", f"{tp * m}x{k}->{m}x{n}", t))
    t = _measure(
        {
            "gemm": ring_gemm_only,
            **rs_common,
            "fused": lambda: comm.gemm_reduce_scatter_ring(x, mm, group, pool, out=rs_out),
        },
        args.warmup,
        args.repeats,
    )
    rows.append(("GEMM+RS ring", f"{tp * m}x{k}->{m}x{n}", t))

    # ---------------- GEMM + AllReduce ----------------
    A = args.ar_splits
    ar_sizes = [len(c) for c in torch.arange(tp * m).tensor_split(A)]

    def ar_gemm_only() -> None:
        lo = 0
        for mi in ar_sizes:
            mm(x[lo : lo + mi], full[lo : lo + mi])
            lo += mi

    t = _measure(
        {
            "gemm": ar_gemm_only,
            "comm": lambda: comm.all_reduce(full, group, inplace=True),
            "unfused": lambda: comm.all_reduce(mm(x, full), group, inplace=True),
            "gemm_unfused": lambda: mm(x, full),
            "fused": lambda: comm.gemm_all_reduce_chunked(x, mm, group, num_splits=A, out=full),
        },
        args.warmup,
        args.repeats,
    )
    rows.append((f"GEMM+AR chunked/{A}", f"{tp * m}x{k}->{tp * m}x{n}", t))

    if ctx.rank == 0:
        print(
            f"\ntp={tp} backend={ctx.backend} device={dev} threads/rank={args.threads} "
            f"compute={args.compute} torch={torch.__version__} "
            f"median of {args.repeats} after {args.warmup} warm-up (ms); "
            f"load average at the end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
        hdr = f"{'algorithm':<22}{'shape':<22}{'t_gemm':>8}{'t_comm':>8}{'t_unfused':>10}{'t_fused':>9}"
        hdr += f"{'comm/gemm':>10}{'exposed':>9}{'fused/unf':>10}{'cpu gemm/comm/fused':>21}"
        print(hdr)
        print("-" * len(hdr))
        for name, shape, r in rows:
            exposed = (r["fused"] - r["gemm"]) / r["comm"]
            print(
                f"{name:<22}{shape:<22}{r['gemm'] * 1e3:>8.2f}{r['comm'] * 1e3:>8.2f}{r['unfused'] * 1e3:>10.2f}"
                f"{r['fused'] * 1e3:>9.2f}{r['comm'] / r['gemm']:>10.2f}{exposed:>9.2f}"
                f"{r['fused'] / r['unfused']:>10.2f}"
                f"{r['cpu:gemm']:>9.2f}/{r['cpu:comm']:.2f}/{r['cpu:fused']:.2f}"
            )
        for name, _, r in rows:
            parts = [f"{key}={r[key] * 1e3:.2f}" for key in ("gemm_unfused", "comm_native", "comm_ring") if key in r]
            print(f"  {name}: {', '.join(parts)} (ms)")
        print("  gemm_unfused = the unfused path's single GEMM; comm_native = torch's collective (gloo:")
        print("  all_gather_into_tensor / reduce_scatter_tensor); comm_ring = ring transport with a no-op GEMM")
        print("  cpu = rank-0 process CPU-seconds (all threads, user+sys) per wall-second")
    ctx.shutdown()


if __name__ == "__main__":
    main()
