"""``trainer.compile=true`` vs eager: the default GPT's step time, compile time, recompiles.

Runs ``+model=gpt`` (one process, default config except ``--steps``) eagerly and compiled,
alternating (eager, compiled, eager, compiled, ... ``--rounds`` times) so that machine
noise hits both alike, for each ``--fp8`` recipe, and prints per run:

* the median step time of steps 3..N (every step's wall time, as the launcher measures it:
  forward, backward, gradient norm, AdamW, FP8 statistics at log steps);
* for compiled runs, the compile time: step 1's time minus the median (dynamo, AOTAutograd
  and inductor for the forward; the backward compiles inside step 1's backward too), and
  dynamo's counters: graphs (the layers share one: a second graph would be a
  recompilation) and graph breaks;
* the loss at the last step (compiled vs eager: same data, same initialization).

Inductor caches compiled code on disk (``TORCHINDUCTOR_CACHE_DIR``); the first compiled
run of a fresh cache directory is a cold compile, later ones are warm. The CPU model,
thread count and load average are printed: timings on a shared machine are noisy.

    python examples/bench_compile.py [--steps 40] [--rounds 2] [--fp8 none delayed]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import tempfile
import time
from typing import Optional

import torch
import torch._dynamo

from tp_fuse.launch.api import train
from tp_fuse.launch.logging import report


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def run(fp8: str, steps: int, compiled: bool) -> dict[str, float]:
    """One quiet training run; every step's time comes from the launcher's meter."""
    step_times: list[float] = []
    original = report.StepMeter.metrics

    def record(self, step: int, step_time: float, device: torch.device) -> dict[str, float]:
        step_times.append(step_time)
        return original(self, step, step_time, device)

    args = ["+model=gpt", f"fp8={fp8}", f"trainer.max_steps={steps}", "logger=none", "trainer.progress=false",
            "trainer.val_interval=0", "checkpoint.save_final=false"]
    if compiled:
        args.append("trainer.compile=true")
        torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    quiet = io.StringIO()
    report.StepMeter.metrics = record
    try:
        with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(quiet), \
                contextlib.redirect_stderr(quiet):
            result = train(args, run_dir=run_dir)
    finally:
        report.StepMeter.metrics = original
    counters = torch._dynamo.utils.counters
    median = statistics.median(step_times[2:])
    return {
        "median_ms": median * 1e3,
        "first_ms": step_times[0] * 1e3,
        "compile_s": step_times[0] - median if compiled else 0.0,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "loss": result.final_loss,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fp8", nargs="+", default=["none", "delayed"])
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}; load average {load()}")
    print(f"default GPT (+model=gpt), {args.steps} steps; median step time of steps 3..{args.steps}")
    print(f"{'fp8':<8} {'mode':<9} {'round':>5} {'median ms':>10} {'step 1 ms':>10} {'compile s':>10} "
          f"{'graphs':>6} {'breaks':>6} {'final loss':>11} {'load':>15}")
    for fp8 in args.fp8:
        medians: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for compiled in (False, True):
                start = time.perf_counter()
                res = run(fp8, args.steps, compiled)
                medians[compiled].append(res["median_ms"])
                mode = "compiled" if compiled else "eager"
                extra = (f"{res['compile_s']:>10.1f} {res['graphs']:>6} {res['breaks']:>6}" if compiled
                         else f"{'':>10} {'':>6} {'':>6}")
                print(f"{fp8:<8} {mode:<9} {r + 1:>5} {res['median_ms']:>10.1f} {res['first_ms']:>10.0f} {extra} "
                      f"{res['loss']:>11.5f} {load():>15}  ({time.perf_counter() - start:.0f} s)", flush=True)
        ratio = statistics.median(medians[True]) / statistics.median(medians[False])
        print(f"{fp8}: compiled / eager median step time {ratio:.2f}x")
    print(f"load average at the end: {load()}")


if __name__ == "__main__":
    main()
