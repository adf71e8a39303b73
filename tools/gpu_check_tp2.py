"""TP=2 against TP=1 on GPUs (step 6 of ``tools/gpu_check.py``).

Two ranks, NCCL, one GPU each: the TP=2 GPT (sequence parallel, overlap on) is compared
with TP=1 on the same data: loss and gradient norm over 3 SGD steps, in fp32 without FP8
(must agree to 1e-4) and with FP8 delayed scaling (within 2e-2: FP8 rounding differs
between TP layouts). This runs the CUDA code paths of every comm/overlap op (ring
exchanges, pipelined reduce-scatters, FP8 byte all-gathers), and then measures PyTorch's
symm_mem fused AG+GEMM / GEMM+RS ops against the unfused windows
(``tools/gpu_check_symm_mem.py``; report key ``symm_mem``).

It needs two GPUs. Two ranks sharing one GPU is no substitute: NCCL refuses a GPU
shared by two ranks, and gloo cannot send CUDA tensors point-to-point (the first GPU
run, on an H200, died in gloo with "writev: Bad address"). With one GPU the check
reports itself skipped, with that reason.

Usage: ``python tools/gpu_check_tp2.py [--device cuda] [--json out.json]``. With
``--device cpu`` it runs the same on CPU through gloo (what ``tests/test_gpu_check.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tp_fuse  # noqa: E402 - after the repo path
from tp_fuse.layers import GPT, GPTConfig, grad_norm  # noqa: E402
from tp_fuse.overlap.config import TPOverlap  # noqa: E402
from tp_fuse.recipe import DelayedScaling  # noqa: E402
from gpu_check_symm_mem import measure_symm_mem  # noqa: E402 - tools/ is the script's directory

CONFIG = dict(vocab_size=256, max_seq_len=64, hidden_size=128, num_layers=2, num_heads=4)
BATCH, STEPS = 2, 3  # 2 x 64 tokens: every FP8 GEMM dimension % 16 == 0
TOL = {"fp32": 1e-4, "fp8_delayed": 2e-2}


def _train(model: GPT, group, device: torch.device, fp8: bool) -> list[tuple[float, float]]:
    """3 SGD steps on fixed data; (loss, grad norm) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    vocab, seq = model.config.vocab_size, model.config.max_seq_len
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (BATCH, seq), generator=gen).to(device)
        labels = torch.randint(0, vocab, (BATCH, seq), generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        with tp_fuse.autocast(enabled=fp8, recipe=DelayedScaling(), amax_reduction_group=group):
            loss = model(tokens, labels)
        loss.backward()
        out.append((loss.item(), grad_norm(model, group).item()))
        opt.step()
    return out


def _rank(rank: int, world: int, store_dir: str, device_name: str, config: dict, queue) -> None:
    try:
        store = dist.FileStore(os.path.join(store_dir, "store"), world)
        device = torch.device(device_name)
        if device.type == "cuda":
            device = torch.device("cuda", rank)  # one GPU per rank (set_device wants an index)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
        group = dist.group.WORLD
        cfg = GPTConfig(**config)
        report = {}
        for name, fp8 in (("fp32", False), ("fp8_delayed", True)):
            ref = _train(GPT(cfg, seed=5, device=device), None, device, fp8)
            tp = _train(GPT(cfg, tp_group=group, sequence_parallel=True, overlap=TPOverlap(), seed=5, device=device),
                        group, device, fp8)
            rel = max(max(abs(a - b) / abs(b) for a, b in zip(t, r)) for t, r in zip(tp, ref))
            report[name] = {"tp1": ref, "tp2": tp, "max_rel_diff": rel, "ok": rel <= TOL[name]}
        if device.type == "cuda":
            # PyTorch's symm_mem fused ops, measured against the unfused windows on the same ranks.
            report["symm_mem"] = measure_symm_mem(group, device)
        queue.put((rank, report, None))
    except Exception:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def skip_reason(gpus: int) -> str:
    return (f"TP=2 on CUDA needs two GPUs (this machine has {gpus}): NCCL refuses a GPU shared by two "
            "ranks, and gloo cannot send CUDA tensors point-to-point")


def run_tp2(device: str, timeout_s: float = 240.0, **config_overrides) -> dict:
    """Two ranks on ``device`` (CUDA: NCCL, one GPU each; CPU: gloo); returns rank 0's
    report (``ok``, per precision), or ``{"skipped": reason}`` with fewer than two GPUs.
    ``config_overrides`` change :data:`CONFIG` (the CPU test uses a smaller model)."""
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < 2:
        return {"ok": True, "device": device, "skipped": skip_reason(torch.cuda.device_count())}
    config = {**CONFIG, **config_overrides}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="tp_fuse_gpu_check_") as store_dir:
        procs = [ctx.Process(target=_rank, args=(r, 2, store_dir, device, config, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in procs:
                rank, report, err = queue.get(timeout=timeout_s)
                results[rank] = (report, err)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    errors = {r: e for r, (rep, e) in results.items() if e}
    if errors:
        return {"ok": False, "device": device, "errors": errors}
    report = results[0][0]
    return {"ok": all(v["ok"] for v in report.values()), "device": device, **report}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    report = run_tp2(args.device)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
