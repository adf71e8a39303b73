"""Memory and step time of FSDP2 x TP, activation recompute and torch.compile (one run).

Run (CPU/gloo or CUDA/NCCL; the script starts its own ranks)::

    python examples/bench_fsdp.py                      # 2 ranks: TP=1, DP=2; 8 layers, h=512
    python examples/bench_fsdp.py --world 4 --tp 2     # TP=2 x (DP or FSDP)=2

Three comparisons, each printed as a ratio measured in this one invocation:

1. **Peak memory per rank, FSDP vs replicated DP.** Each layout runs in fresh processes
   (``torch.multiprocessing.spawn``), so that one layout's peak cannot hide the other's:
   on CUDA the allocator's ``max_memory_allocated``; on CPU the peak of the C heap's
   allocated bytes (glibc ``mallinfo2``, sampled after every aten op, forward and
   backward) minus its value just before the model is built (the peak resident set
   where ``mallinfo2`` is missing; it never drops, so it overstates). Also printed: the bytes of
   parameters + gradients + AdamW state each rank holds (exact, by construction).
   Both layouts build the model on ``meta`` and materialize only local shards.
2. **Step time with activation recompute** none / selective / full (FSDP layout),
   configurations interleaved step by step, medians after warm-up.
3. **Step time compiled / eager** (``torch.compile`` per TransformerLayer; fusion groups
   are graph breaks), interleaved the same way; compile time is excluded (warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--memory-only", action="store_true", help="only comparison 1")
    return p.parse_args()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_bytes() -> int:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``: ``uordblks``
    in the arenas + ``hblkhd`` in mmap'd blocks, where large tensors live)."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class _HeapPeak(TorchDispatchMode):
    """Peak of :func:`_heap_bytes` sampled after every aten op, forward and backward (CPU
    has no allocator statistics; unlike the resident set this drops when tensors are freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = _heap_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_bytes())
        return out


try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.mallinfo2.restype = _Mallinfo2
except (OSError, AttributeError):  # not glibc >= 2.33: fall back to the peak resident set
    _LIBC = None


def _build(args, fsdp: bool, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.layers.fsdp import fully_shard_gpt
    from tp_fuse.layers.meta_init import deferred_inits, materialize

    dp = args.world // args.tp
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    tp_group = mesh.get_group("tp") if args.tp > 1 else None
    cfg = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, hidden_size=args.hidden,
                    num_layers=args.layers, num_heads=args.heads)
    model = GPT(cfg, tp_group=tp_group, seed=1, device="meta")
    inits = deferred_inits(model)
    if fsdp:
        fully_shard_gpt(model, mesh["dp"])
    materialize(model, device, inits)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return model, opt, mesh


def _step(model, opt, mesh, fsdp: bool, tokens: torch.Tensor) -> None:
    from tp_fuse.launch.grads import allreduce_dp_grads

    loss = model(tokens, tokens)
    loss.backward()
    if not fsdp:
        allreduce_dp_grads(list(model.parameters()), mesh.get_group("dp"), mesh.size(0))
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state_bytes(model, opt) -> int:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    n = sum(local(p).numel() * local(p).element_size() * 2 for p in model.parameters())  # + grad
    for st in opt.state.values():
        n += sum(local(v).numel() * local(v).element_size() for v in st.values() if torch.is_tensor(v) and v.dim())
    return n


def _init(rank: int, world: int, store_file: str) -> torch.device:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _memory_worker(rank: int, args, fsdp: bool, store_file: str, out: dict) -> None:
    device = _init(rank, args.world, store_file)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before, tracker = 0, contextlib.nullcontext()
    elif _LIBC is not None:
        before, tracker = _heap_bytes(), _HeapPeak()
    else:
        before, tracker = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, contextlib.nullcontext()
    with tracker:
        model, opt, mesh = _build(args, fsdp, device)
        for _ in range(2):
            _step(model, opt, mesh, fsdp, tokens)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    elif _LIBC is not None:
        peak = tracker.peak
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out[rank] = (peak - before, _state_bytes(model, opt))
    dist.barrier()
    dist.destroy_process_group()


def _timed(configs: dict, args) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in configs}
    for it in range(args.warmup + args.iters):
        for name, fn in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _time_worker(rank: int, args, store_file: str, out: dict) -> None:
    device = _init(rank, args.world, store_file)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    configs = {}
    for mode in ("none", "selective", "full"):
        model, opt, mesh = _build(args, True, device)
        model.set_activation_checkpointing(mode)
        configs[f"recompute={mode}"] = (lambda m=model, o=opt, me=mesh: _step(m, o, me, True, tokens))
    if not args.skip_compile:
        model, opt, mesh = _build(args, True, device)
        for layer in model.layers:
            layer.compile()
        configs["compiled"] = lambda m=model, o=opt, me=mesh: _step(m, o, me, True, tokens)
    medians = _timed(configs, args)
    if rank == 0:
        out.update(medians)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.world % args.tp:
        raise ValueError(f"--tp ({args.tp}) must divide --world ({args.world})")
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    mem = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fsdp in (False, True):
            out = manager.dict()
            mp.start_processes(_memory_worker, args=(args, fsdp, os.path.join(tmp, f"m{fsdp}"), out),
                               nprocs=args.world, start_method="spawn")
            mem[fsdp] = dict(out)
        times = manager.dict()
        if not args.memory_only:
            mp.start_processes(_time_worker, args=(args, os.path.join(tmp, "t"), times), nprocs=args.world,
                               start_method="spawn")
        times = dict(times)
    dp = args.world // args.tp
    what = ("CUDA max_memory_allocated" if torch.cuda.is_available()
            else "peak heap growth" if _LIBC is not None else "peak RSS growth")
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}; "
          f"TP={args.tp} x DP={dp}, {args.world} ranks")
    for fsdp in (False, True):
        peak = max(v[0] for v in mem[fsdp].values()) / 2**20
        state = max(v[1] for v in mem[fsdp].values()) / 2**20
        print(f"  {'FSDP2 ' if fsdp else 'replicated DP'}: {what} {peak:8.1f} MiB/rank, "
              f"params+grads+AdamW {state:8.1f} MiB/rank")
    ratio_peak = max(v[0] for v in mem[True].values()) / max(v[0] for v in mem[False].values())
    ratio_state = max(v[1] for v in mem[True].values()) / max(v[1] for v in mem[False].values())
    print(f"FSDP / replicated DP: peak {ratio_peak:.2f}, model state {ratio_state:.2f} (ideal 1/{dp} = {1 / dp:.2f})")
    if not times:
        return
    base = times["recompute=none"]
    for k, v in times.items():
        print(f"  {k:20s} step {v * 1e3:8.1f} ms  ({v / base:.2f} x recompute=none)")
    if "compiled" in times:
        print(f"compiled / eager step time: {times['compiled'] / base:.2f}")


if __name__ == "__main__":
    main()
