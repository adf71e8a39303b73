"""CPU speed of tp_fuse, side by side in one process: FP8 GEMMs, host overhead, the default GPT.

Three tables, each a ratio to plain torch measured alternately in this one run (A, B, A, B,
...), so that machine noise hits both sides alike; the CPU model, its FP8-relevant flags,
the torch thread count and the load average (before and after) are printed first.

1. **FP8 GEMM vs fp32 GEMM** at the default GPT's shapes (fc1 fprop, fc2 fprop, fc1 wgrad
   at 2048 tokens) for every FP8 dtype pair: tp_fuse's CPU FP8 GEMM (the exact emulation,
   ``tp_fuse/kernels/fp8_emulation.py``) and ``torch._scaled_mm`` two ways: as torch runs
   it by default (oneDNN where the CPU has oneDNN FP8 kernels) and with oneDNN off (torch's
   own fallback, the path of CPUs without them). A ``_scaled_mm`` call slower than 0.5 s is
   timed once and marked ``*``.
2. **Host time per step at tiny shapes** (LayerNorm -> Linear -> GELU -> Linear, hidden
   64, 16 tokens, forward + backward): plain ``torch.nn.functional`` vs ``tp_fuse.ops``
   in fp32 and under each FP8/FP4 recipe. At this size the GEMMs cost microseconds, so
   the ratio is the fuser's per-call Python and bookkeeping.
3. **The default GPT** (``+model=gpt``, one process, default config): wall time of
   ``--gpt-steps`` steps with ``fp8=none`` and ``fp8=delayed`` (start-up included: data,
   model, the MFU probe), and the median of the step times the run logs (every
   ``trainer.log_interval`` = 10 steps).

    python examples/bench_cpu_speed.py [--repeats 200] [--gpt-steps 20] [--skip-gpt]

Runs in about a minute on 2 idle cores. Medians; no thresholds (this is a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tp_fuse
from tp_fuse import kernels, ops
from tp_fuse.launch.api import train
from tp_fuse.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]
NAMES = {E4M3: "e4m3", E5M2: "e5m2"}
SLOW_S = 0.5


def machine() -> str:
    model, flags = platform.processor() or "?", set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", "", "x86_64"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    isa = ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8") if f in flags)
    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"CPU: {model} ({os.cpu_count()} logical; {isa or 'no AVX flags read'}); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; load average {load}")


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scaled_mm_s(a: torch.Tensor, b: torch.Tensor, one: torch.Tensor, repeats: int, onednn: bool) -> tuple[float, bool]:
    """Median seconds of ``torch._scaled_mm`` (once only if one call is slower than SLOW_S)."""
    with torch.backends.mkldnn.flags(enabled=onednn):
        call = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)  # noqa: E731
        start = time.perf_counter()
        call()
        first = time.perf_counter() - start
        if first > SLOW_S:
            return first, True
        return median_s(call, repeats), False


def gemm_table(tokens: int, repeats: int) -> None:
    h = 128  # the default GPT's hidden size; fc1 is [4h, h]
    shapes = {"fc1 fprop": (tokens, 4 * h, h), "fc2 fprop": (tokens, h, 4 * h), "fc1 wgrad": (4 * h, h, tokens)}
    one = torch.ones(())
    # Warm the fp32 GEMM (thread pool, packing buffers) first: otherwise the first row's
    # fp32 time is 2x the others' and its ratio reads too low.
    warm_x, warm_w = torch.randn(tokens, h), torch.randn(4 * h, h)
    for _ in range(20):
        warm_x @ warm_w.t()
    print("\n1. FP8 GEMM [M,K] x [N,K]^T -> fp32, as a multiple of the fp32 matmul (ms: fp32 matmul)")
    print(f"{'GEMM':<10} {'M,N,K':<15} {'pair':<11} {'fp32 ms':>8} {'tp_fuse':>8} {'_scaled_mm':>11} {'oneDNN off':>11}")
    for name, (m, n, k) in shapes.items():
        torch.manual_seed(0)
        x, w = torch.randn(m, k), torch.randn(n, k)
        for da, db in PAIRS:
            a, b = x.to(da), w.to(db)
            t32 = median_s(lambda: x @ w.t(), repeats)
            tfuse = median_s(lambda: kernels.fp8_gemm(a, b, one, one, torch.float32), repeats)
            tsmm, slow = scaled_mm_s(a, b, one, repeats, onednn=True)
            toff, slow_off = scaled_mm_s(a, b, one, repeats, onednn=False)
            pair = f"{NAMES[da]}x{NAMES[db]}"
            print(f"{name:<10} {f'{m},{n},{k}':<15} {pair:<11} {t32 * 1e3:>8.3f} {tfuse / t32:>7.2f}x "
                  f"{tsmm / t32:>9.1f}x{'*' if slow else ' '} {toff / t32:>9.2f}x{'*' if slow_off else ' '}")
    with kernels.record_kernel_paths() as log:
        kernels.fp8_gemm(a, b, one, one, torch.float32)
    call = log.last("fp8_gemm")
    print(f"tp_fuse's CPU FP8 GEMM: variant {call.variant!r} ({call.reason})")


class TorchBlock(torch.nn.Module):
    """The same math as the tp_fuse block, in plain torch.nn.functional, sharing its parameters."""

    def __init__(self, seq: ops.Sequential) -> None:
        super().__init__()
        self.ln, self.fc1, _, self.fc2 = list(seq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, x.shape[-1:], self.ln.weight, self.ln.bias, self.ln.eps)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias), approximate="tanh")
        return F.linear(h, self.fc2.weight, self.fc2.bias)


RECIPES = {
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "blockwise": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "rowwise": Float8RowwiseScaling,
    "nvfp4": NVFP4BlockScaling,
}


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (autograd's C++ backward ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops(fn: Callable[[], None]) -> int:
    """aten ops of one call of ``fn``: the per-step op count, which (unlike time) does not
    depend on the machine's load."""
    with _OpCounter() as counter:
        fn()
    return counter.count


def alternate(variants: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each call of each variant, ``repeats`` rounds after ``warmup``, the
    variants alternating (A, B, A, B, ...) so that load changes hit them alike."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def host_table(hidden: int, tokens: int, repeats: int) -> None:
    torch.manual_seed(0)
    seq = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, 4 * hidden), ops.GELU(),
                         ops.Linear(4 * hidden, hidden))
    ref = TorchBlock(seq)
    x = torch.randn(tokens, hidden, requires_grad=True)
    dy = torch.randn(tokens, hidden)
    fp32_seq = copy.deepcopy(seq)
    variants: dict[str, Callable[[], None]] = {"torch": lambda: ref(x).backward(dy),
                                               "tp_fuse fp32": lambda: fp32_seq(x).backward(dy)}
    for name, make in RECIPES.items():
        # One model per recipe: the variants alternate step by step (so that machine noise
        # hits all alike), and one model switching recipes every step would re-plan and
        # rebuild its quantizers every step, which no training run does.
        recipe, model = make(), copy.deepcopy(seq)

        def step(recipe=recipe, model=model) -> None:
            with tp_fuse.autocast(recipe=recipe):
                y = model(x)
            y.backward(dy)

        variants[f"tp_fuse {name}"] = step
    times = alternate(variants, repeats, warmup=3)  # warm-up: first-call planning, quantizer creation
    base = statistics.median(times["torch"])
    print(f"\n2. host time per step, LayerNorm -> Linear -> GELU -> Linear, hidden {hidden}, {tokens} tokens, fwd+bwd")
    print(f"{'variant':<18} {'median us':>10} {'/ torch':>8} {'aten ops':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<18} {med * 1e6:>10.1f} {med / base:>7.2f}x {aten_ops(variants[name]):>9}")


def gpt_steps(fp8: str, steps: int) -> tuple[float, float, float]:
    """(median step s, wall s, final loss) of the default GPT with ``fp8=<fp8>``, quietly."""
    quiet = io.StringIO()
    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        start = time.perf_counter()
        # The default config (its log_interval: FP8 statistics are computed at log steps only).
        result = train(["+model=gpt", f"fp8={fp8}", f"trainer.max_steps={steps}", "logger=none",
                        "trainer.progress=false"], run_dir=run_dir)
        wall = time.perf_counter() - start
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            step_times = [json.loads(line)["step_time_s"] for line in f if '"step_time_s"' in line]
    return statistics.median(step_times), wall, result.final_loss


def gpt_table(steps: int) -> None:
    print(f"\n3. default GPT (+model=gpt, 1 process), {steps} steps")
    print(f"{'fp8':<8} {'logged step ms':>15} {'wall s':>8} {'final loss':>11}")
    rows = {fp8: gpt_steps(fp8, steps) for fp8 in ("none", "delayed")}
    for fp8, (step, wall, loss) in rows.items():
        print(f"{fp8:<8} {step * 1e3:>15.1f} {wall:>8.2f} {loss:>11.4f}")
    (s0, w0, _), (s1, w1, _) = rows["none"], rows["delayed"]
    print(f"fp8=delayed / fp8=none: step time {s1 / s0:.2f}x, wall time {w1 / w0:.2f}x")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="repeats of the host-time table")
    parser.add_argument("--gemm-repeats", type=int, default=7)
    parser.add_argument("--gemm-tokens", type=int, default=2048)
    parser.add_argument("--gpt-steps", type=int, default=20)
    parser.add_argument("--skip-gpt", action="store_true")
    args = parser.parse_args(argv)
    print(machine())
    gemm_table(args.gemm_tokens, args.gemm_repeats)
    host_table(64, 16, args.repeats)
    if not args.skip_gpt:
        gpt_table(args.gpt_steps)
    print(f"\nload average at the end: {'/'.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
