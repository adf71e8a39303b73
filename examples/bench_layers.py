"""Training-step throughput of a TransformerLayer stack under tensor parallelism.

Run (2 ranks, CPU/gloo; also works with NCCL on GPUs)::

    torchrun --nproc-per-node=2 examples/bench_layers.py            # 4 layers, h=512, seq 512, batch 4
    torchrun --nproc-per-node=2 examples/bench_layers.py --seq 256  # smaller, faster

Compares, in ONE run with the configurations interleaved step by step (so that machine
noise hits all of them alike), medians over ``--iters`` timed steps after ``--warmup``:

    (a) tp-fuse TransformerLayers, sequence parallel, comm/GEMM overlap ON
        (TPOverlap(save_gathered_input=True): like (b) and (c), keep the all-gathered
        input of column-parallel GEMMs for the weight gradient)
    (a') overlap ON with Megatron's default (re-gather the input in backward, behind the
        dgrad GEMM: 1/tp of the activation memory, one more all-gather per GEMM)
    (auto) overlap ON with ``OverlapConfig(auto=True)`` (and save_gathered_input=True, as
        (a)): every GEMM stage measures its methods and "unfused" at the first step (outside
        the timed steps; the measuring time is printed) and runs the fastest
    (b) the same model with overlap OFF (TPOverlap(OverlapConfig(enabled=False)))
    (c) the same math with PyTorch DTensor tensor parallelism: ColwiseParallel /
        RowwiseParallel / SequenceParallel on plain nn.Linear / nn.LayerNorm modules
    (a8) model (a) under tp_fuse.autocast(DelayedScaling()) -- FP8 GEMMs

A step is zero_grad + forward + backward (loss = mean(y^2) of the local output) + SGD
step. All models start from the same weights; the first step's outputs are compared
across (a), (b), (c) as a sanity check; "auto/b [q1, q3]" are the quartiles of the
per-step ratio step_b / step_auto (both run back to back in each iteration). Tokens/s counts the ``seq * batch`` tokens the
TP group processes per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 configuration (a8)")
    return p.parse_args()


class TorchBlock(nn.Module):
    """The same pre-norm GPT block from plain modules (for DTensor TP).

    Fused QKV with tp-fuse's layout (per head ``[q, k, v] x d`` rows), so that a
    ColwiseParallel row shard holds whole heads; local head count from the shard width.
    """

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.d = hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))  # [s, b, 3h/tp]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, -1, 3, self.d)  # [s, b, n/tp, 3, d]
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, n/tp, s, d]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def build_ours(args: argparse.Namespace, group: dist.ProcessGroup, overlap) -> nn.Module:
    from tp_fuse.layers import TransformerLayer

    return nn.Sequential(*[
        TransformerLayer(args.hidden, 4 * args.hidden, args.heads, tp_group=group, sequence_parallel=True,
                         num_layers=args.layers, seed=100 + i, overlap=overlap)
        for i in range(args.layers)
    ])


def build_dtensor(args: argparse.Namespace, ours: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from tp_fuse.layers import full_state_dict

    mesh = init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda", (dist.get_world_size(),))
    blocks = nn.Sequential(*[TorchBlock(args.hidden, args.heads) for _ in range(args.layers)])
    full = full_state_dict(ours, group)
    names = {"ln1.weight": "attention.qkv.ops.norm.weight", "ln1.bias": "attention.qkv.ops.norm.bias",
             "qkv.weight": "attention.qkv.ops.linear.weight", "qkv.bias": "attention.qkv.ops.bias.bias",
             "proj.weight": "attention.proj.linear.weight", "proj.bias": "attention.proj.bias.bias",
             "ln2.weight": "mlp.fc1.norm.weight", "ln2.bias": "mlp.fc1.norm.bias",
             "fc1.weight": "mlp.fc1.linear.weight", "fc1.bias": "mlp.fc1.bias.bias",
             "fc2.weight": "mlp.fc2.linear.weight", "fc2.bias": "mlp.fc2.bias.bias"}
    with torch.no_grad():
        for i, block in enumerate(blocks):
            for ours_name, param in block.named_parameters():
                param.copy_(full[f"{i}.{names[ours_name]}"])
    plan = {
        "ln1": SequenceParallel(sequence_dim=0), "ln2": SequenceParallel(sequence_dim=0),
        "qkv": ColwiseParallel(input_layouts=Shard(0)), "fc1": ColwiseParallel(input_layouts=Shard(0)),
        "proj": RowwiseParallel(output_layouts=Shard(0)), "fc2": RowwiseParallel(output_layouts=Shard(0)),
    }
    for block in blocks:
        parallelize_module(block, mesh, plan)
    return blocks


def make_step(model: nn.Module, x: torch.Tensor, fp8: bool = False) -> Callable[[], torch.Tensor]:
    import tp_fuse
    from tp_fuse.recipe import DelayedScaling

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    recipe = DelayedScaling() if fp8 else None

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if fp8:
            with tp_fuse.autocast(recipe=recipe):
                y = model(x)
        else:
            y = model(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        opt.step()
        return y.detach()

    return step


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    if args.seq % world:
        raise ValueError(f"--seq ({args.seq}) must be divisible by the number of ranks ({world})")
    x_full = torch.randn(args.seq, args.batch, args.hidden, generator=torch.Generator().manual_seed(0))
    x = x_full.chunk(world)[rank].contiguous()  # sequence parallel: [s/tp, b, h]

    ours_on = build_ours(args, group, TPOverlap(save_gathered_input=True))
    ours_regather = build_ours(args, group, TPOverlap())
    ours_off = build_ours(args, group, TPOverlap(OverlapConfig(enabled=False)))
    auto_overlap = TPOverlap(OverlapConfig(auto=True), save_gathered_input=True)
    ours_auto = build_ours(args, group, auto_overlap)
    torch_tp = build_dtensor(args, ours_on, group)
    configs = {
        "a: tp-fuse, overlap on": make_step(ours_on, x),
        "a': overlap on, re-gather": make_step(ours_regather, x),
        "auto: tp-fuse, overlap auto": make_step(ours_auto, x),
        "b: tp-fuse, overlap off": make_step(ours_off, x),
        "c: DTensor TP": make_step(torch_tp, x),
    }
    if not args.no_fp8:
        ours_fp8 = build_ours(args, group, TPOverlap(save_gathered_input=True))
        configs["a8: tp-fuse, overlap on, FP8"] = make_step(ours_fp8, x, fp8=True)

    first = {}
    first_s = {}
    for name, step in configs.items():
        t0 = time.perf_counter()
        first[name] = step()
        first_s[name] = time.perf_counter() - t0
    ref = first["c: DTensor TP"]
    agree = {name: ((y - ref).abs().max() / ref.abs().max()).item() for name, y in first.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for it in range(args.warmup - 1 + args.iters):
        for name, step in configs.items():  # interleaved: noise hits every config alike
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if it >= args.warmup - 1:
                times[name].append(time.perf_counter() - t0)

    if rank == 0:
        tokens = args.seq * args.batch
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"TransformerLayer x{args.layers}, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
              f"batch {args.batch}, fp32 params, TP={world} (sequence parallel), backend "
              f"{dist.get_backend()}, {torch.get_num_threads()} thread(s)/rank; "
              f"median of {args.iters} steps after {args.warmup} warm-up")
        load = os.getloadavg()
        print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
              f"(1/5/15 min; above the CPU count, other processes share the cores and timings are noisy)")
        print(f"{'configuration':32s} {'step ms':>9s} {'tokens/s':>10s}  first-step max rel diff vs c")
        for name, t in med.items():
            print(f"{name:32s} {1e3 * t:9.1f} {tokens / t:10.0f}  {agree[name]:.2e}")
        a, b, c = (med[k] for k in ("a: tp-fuse, overlap on", "b: tp-fuse, overlap off", "c: DTensor TP"))
        au = med["auto: tp-fuse, overlap auto"]
        ratios = [tb / ta for tb, ta in zip(times["b: tp-fuse, overlap off"], times["auto: tp-fuse, overlap auto"])]
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        print(f"overlap auto: measuring took {auto_overlap.tuner.measure_seconds:.2f} s (rank 0) in the first "
              f"step ({first_s['auto: tp-fuse, overlap auto']:.2f} s; overlap off: "
              f"{first_s['b: tp-fuse, overlap off']:.2f} s); choices:")
        for d in auto_overlap.tuner.decisions:
            print(f"  {d.describe()}")
        print(f"throughput ratios: auto/b = {b / au:.3f} [q1 {q[0]:.3f}, q3 {q[2]:.3f}]   auto/a = {a / au:.3f}")
        print(f"throughput ratios: a/c = {c / a:.3f}   a/b = {b / a:.3f}", end="")
        if "a8: tp-fuse, overlap on, FP8" in med:
            print(f"   FP8/fp32 (a8/a) = {a / med['a8: tp-fuse, overlap on, FP8']:.3f}")
        else:
            print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
