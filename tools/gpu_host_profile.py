"""Where an FP8 step's time goes on a GPU: host time vs device time, per variant (step 8
of ``tools/gpu_check.py``).

The first GPU run measured the default GPT at 0.19x (delayed) and 0.25x (current) of
bf16's tokens/s. This tells host-bound from device-bound. For one block (LayerNorm ->
Linear -> GELU -> Linear, bf16 parameters) at a small and a medium shape, side by side in
one process (variants alternate step by step):

- ``host_us``: median time until the forward+backward call returns (no synchronize):
  the Python/dispatch work the CPU does for one step. With an idle GPU queue this is
  what a host-bound step costs.
- ``wall_us``: median time until the step's kernels have finished (``synchronize``).
- ``kernels``: CUDA kernels launched per step, ``syncs``: host-device synchronizations
  per step (a ``.item()``/``.cpu()`` stalls the queue; the count includes the profile's own
  closing synchronize: plain torch shows 2 on an H200, so compare with its row), and the
  top CPU ops by self time (``torch.profiler``), for each variant.

A step is host bound when ``host_us`` is close to ``wall_us``. Variants: plain
``torch.nn.functional`` in bf16, ``tp_fuse`` without FP8, and FP8 delayed, current and
block (1x128/128x128) scaling.

Usage: ``python tools/gpu_host_profile.py [--device cuda] [--repeats 50] [--json out.json]``
(``--device cpu`` runs the same on CPU; ``tests/test_gpu_check.py`` does, with tiny shapes).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tp_fuse  # noqa: E402 - after the repo path
from tp_fuse import ops  # noqa: E402
from tp_fuse.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402

RECIPES = {"fp8 delayed": DelayedScaling, "fp8 current": Float8CurrentScaling, "fp8 block": Float8BlockScaling}


def make_variants(hidden: int, tokens: int, device: str, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """One forward+backward step per variant, each with its own copy of the same block."""
    torch.manual_seed(0)
    seq = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, 4 * hidden), ops.GELU(),
                         ops.Linear(4 * hidden, hidden)).to(device=device, dtype=dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
    ln, fc1, _, fc2 = list(copy.deepcopy(seq))

    def torch_step() -> None:
        h = F.layer_norm(x, (hidden,), ln.weight, ln.bias, ln.eps)
        h = F.gelu(F.linear(h, fc1.weight, fc1.bias), approximate="tanh")
        F.linear(h, fc2.weight, fc2.bias).backward(dy)

    plain = copy.deepcopy(seq)
    variants: dict[str, Callable[[], None]] = {"torch": torch_step, "tp_fuse": lambda: plain(x).backward(dy)}
    for name, make in RECIPES.items():
        recipe, model = make(), copy.deepcopy(seq)

        def step(recipe=recipe, model=model) -> None:
            with tp_fuse.autocast(recipe=recipe):
                y = model(x)
            y.backward(dy)

        variants[name] = step
    return variants


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_variants(variants: dict[str, Callable[[], None]], device: str, repeats: int) -> dict[str, dict]:
    """Median host and wall microseconds per step, variants alternating."""
    for fn in variants.values():  # first-call planning, quantizer creation, autotuning
        for _ in range(3):
            fn()
    _sync(device)
    host: dict[str, list[float]] = {k: [] for k in variants}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            host[name].append(time.perf_counter() - start)
            _sync(device)
            wall[name].append(time.perf_counter() - start)
    return {k: {"host_us": statistics.median(host[k]) * 1e6, "wall_us": statistics.median(wall[k]) * 1e6}
            for k in variants}


def profile_variant(fn: Callable[[], None], device: str, top: int) -> dict:
    """Kernels and device-to-host copies of one step, and the top CPU ops by self time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    # A device-to-host copy (``.item()``, ``.cpu()``, ``.tolist()``) shows as aten::_local_scalar_dense
    # or a copy whose destination is the host; count both by name.
    syncs = sum(1 for e in events if e.name in ("aten::_local_scalar_dense", "cudaStreamSynchronize",
                                               "cudaDeviceSynchronize"))
    table = prof.key_averages()
    rows = sorted(table, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    cpu_ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::"))
    return {"kernels": kernels, "syncs": syncs, "aten_calls": cpu_ops,
            "top_cpu": [{"name": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1)} for e in rows]}


def run(shapes: list[tuple[int, int]], device: str, dtype: torch.dtype, repeats: int, top: int) -> dict:
    report: dict = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                    "dtype": str(dtype), "shapes": []}
    for hidden, tokens in shapes:
        variants = make_variants(hidden, tokens, device, dtype)
        times = time_variants(variants, device, repeats)
        base = times["torch"]["wall_us"]
        rows = {}
        for name, t in times.items():
            rows[name] = {**{k: round(v, 1) for k, v in t.items()}, "wall_vs_torch": round(t["wall_us"] / base, 2),
                          "host_fraction": round(t["host_us"] / t["wall_us"], 2),
                          **profile_variant(variants[name], device, top)}
        report["shapes"].append({"hidden": hidden, "tokens": tokens, "variants": rows})
    return report


def print_report(report: dict) -> None:
    print(f"device {report['device']}, {report['dtype']}")
    for shape in report["shapes"]:
        print(f"\nhidden {shape['hidden']}, {shape['tokens']} tokens: LN -> Linear -> GELU -> Linear, fwd+bwd")
        print(f"{'variant':<12} {'host us':>9} {'wall us':>9} {'/ torch':>8} {'host/wall':>9} {'kernels':>8} "
              f"{'syncs':>6} {'aten':>6}")
        for name, r in shape["variants"].items():
            print(f"{name:<12} {r['host_us']:>9.1f} {r['wall_us']:>9.1f} {r['wall_vs_torch']:>7.2f}x "
                  f"{r['host_fraction']:>9.2f} {r['kernels']:>8} {r['syncs']:>6} {r['aten_calls']:>6}")
        for name in ("fp8 delayed", "fp8 current"):
            tops = ", ".join(f"{t['name']} {t['self_cpu_us']:.0f}us/{t['calls']}"
                             for t in shape["variants"][name]["top_cpu"][:6])
            print(f"  top CPU ({name}): {tops}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--shapes", default="256x512,1024x4096", help="hiddenxtokens,...")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dtype = torch.bfloat16
    report = run(shapes, args.device, dtype, args.repeats, args.top)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
