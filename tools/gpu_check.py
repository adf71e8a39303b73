"""``make gpu-check``: everything worth knowing after tp-fuse's first minutes on a GPU.

One command, under 14 minutes on one GPU, writing ``<out>/gpu_check.json`` and
``<out>/gpu_check.md``. Steps (each with its own time limit, all within ``--budget``):

1. ``bench_gpu``: ``examples/bench_gpu.py --json`` first, in at most 5 minutes: plain torch
   vs tp_fuse bf16 vs FP8 delayed/current/rowwise/blockwise at the host-bound and
   GEMM-bound blocks, a Llama layer, the default and a 1B GPT (wall and host time per
   step, kernels, TFLOP/s, ratio to torch bf16, parity); its rows in ``bench_gpu.json``,
   its table in ``bench_gpu.md``. On a 15-minute lease, ``--steps bench_gpu`` runs it alone.
2. ``gpu_tests``: ``pytest -m gpu tests`` (Triton kernels and the CUDA paths).
3. ``triton_bitexact``: every Triton kernel compiled for this GPU against the torch path
   on the same inputs: FP8 outputs compared byte for byte (the casts must be identical;
   the fused norm/activation kernels are reported with their largest FP8 step
   distance), amaxes exactly; the Triton FP8 GEMM against ``torch._scaled_mm``.
4. ``bench_kernels``: ``examples/bench_kernels.py --json`` (GB/s as a fraction of the
   device copy bandwidth; FP8 GEMM TFLOP/s: Triton vs ``torch._scaled_mm`` vs bf16 at
   transformer shapes).
5. ``gpt_fp8``: 100 steps of the default GPT (``launch/train.py +model=gpt``) in bf16,
   FP8 delayed and FP8 current scaling: final-loss parity and tokens/s ratios.
6. ``tp2``: ``tools/gpu_check_tp2.py``: TP=2 (NCCL, one GPU per rank) with sequence
   parallelism, overlap and FP8 delayed scaling against TP=1: exercises the CUDA paths of
   the comm/overlap ops. Skipped, with the reason, on a one-GPU machine.
7. ``gpt_compiled``: the default GPT with ``trainer.compile=true`` (torch.compile's
   default mode; the CUDA-graph modes are refused on CUDA, see docs/fsdp.md) vs eager, in
   bf16 and FP8 delayed scaling, 60 steps each: tokens/s ratios to eager bf16 (first
   logged row, with the compile, left out) and final losses.
8. ``host_profile``: ``tools/gpu_host_profile.py``: host time vs device time per step of
   one block (bf16 torch, tp_fuse, FP8 delayed/current/block), kernels and device syncs
   per step, the top CPU ops: tells whether FP8 steps are host bound.

Without CUDA it prints one line saying so and exits 0. The orchestration (time budget,
summary files) is plain Python, tested on CPU by ``tests/test_gpu_check.py``.
Usage::

    python tools/gpu_check.py [--out gpu_check_out] [--budget 540] [--steps gpu_tests,gpt_fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 840.0  # 14 minutes


@dataclasses.dataclass
class Step:
    """One check: ``fn(out_dir, timeout_s) -> (ok, summary dict)``; may raise."""

    name: str
    timeout_s: float
    fn: Callable[[str, float], tuple[bool, dict]]


@dataclasses.dataclass
class StepResult:
    name: str
    status: str  # "passed" | "failed" | "error" | "skipped"
    seconds: float
    summary: dict
    detail: str = ""


def run_steps(steps: Sequence[Step], out_dir: str, budget_s: float,
              clock: Callable[[], float] = time.monotonic) -> list[StepResult]:
    """Run ``steps`` in order. Each gets ``min(step.timeout_s, budget left)``; once the
    budget is spent the rest are skipped (with the reason). A step that raises is an
    "error" with its traceback; the others still run."""
    start = clock()
    results = []
    for step in steps:
        left = budget_s - (clock() - start)
        if left <= 1.0:
            results.append(StepResult(step.name, "skipped", 0.0, {}, f"time budget of {budget_s:.0f} s spent"))
            continue
        t0 = clock()
        try:
            ok, summary = step.fn(out_dir, min(step.timeout_s, left))
            status, detail = ("passed" if ok else "failed"), ""
            if ok and summary.get("skipped"):  # the step cannot run on this machine, and says why
                status, detail = "skipped", str(summary["skipped"])
        except subprocess.TimeoutExpired as exc:
            status, summary, detail = "error", {}, f"timed out after {exc.timeout:.0f} s"
        except Exception:  # noqa: BLE001 - one broken step must not hide the others
            status, summary, detail = "error", {}, traceback.format_exc(limit=8)
        results.append(StepResult(step.name, status, clock() - t0, summary, detail))
    return results


def device_info() -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False, "torch": torch.__version__}
    cap = torch.cuda.get_device_capability()
    return {"cuda": True, "name": torch.cuda.get_device_name(), "capability": f"sm_{cap[0]}{cap[1]}",
            "torch": torch.__version__, "cuda_version": torch.version.cuda}


def render_markdown(results: Sequence[StepResult], info: dict) -> str:
    """The Markdown summary: one table of steps, then each step's numbers."""
    head = info.get("name", "no CUDA device")
    lines = [f"# tp-fuse GPU check: {head}", "",
             f"torch {info.get('torch')}, CUDA {info.get('cuda_version', '-')}, {info.get('capability', '-')}", "",
             "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} |" for r in results]
    for r in results:
        lines += ["", f"## {r.name}: {r.status}", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in r.summary.items()]
        if r.detail:
            lines += ["", "```", r.detail.strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return "`" + json.dumps(v, default=str)[:2000] + "`"
    return str(v)


def write_summary(results: Sequence[StepResult], info: dict, out_dir: str) -> tuple[str, str]:
    """Write ``gpu_check.json`` and ``gpu_check.md`` into ``out_dir``; return both paths."""
    os.makedirs(out_dir, exist_ok=True)
    payload = {"device": info, "ok": all(r.status == "passed" for r in results),
               "steps": [dataclasses.asdict(r) for r in results]}
    jpath, mpath = os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.md")
    with open(jpath, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    with open(mpath, "w") as f:
        f.write(render_markdown(results, info))
    return jpath, mpath


# ------------------------------------------------------------------ parsing (CPU-testable)


def parse_pytest_counts(output: str) -> dict[str, int]:
    """``{"passed": 3, "skipped": 2, ...}`` from pytest's final summary line."""
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed)", tail)}


def read_metrics(run_dir: str) -> list[dict]:
    """The launcher's ``metrics.jsonl`` rows (train rows only: those with a ``loss``)."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row and "tokens_per_s" in row:
                rows.append(row)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no training rows")
    return rows


def compare_runs(runs: dict[str, list[dict]], baseline: str = "bf16", skip_first: int = 1) -> dict:
    """Final loss of each run, its relative difference to ``baseline``'s, and the median
    tokens/s ratio to the baseline (the first ``skip_first`` logged rows, which include
    compilation and autotuning, left out)."""
    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2]

    base_loss = runs[baseline][-1]["loss"]
    base_tps = med([r["tokens_per_s"] for r in runs[baseline][skip_first:]] or [runs[baseline][-1]["tokens_per_s"]])
    out: dict[str, Any] = {}
    for name, rows in runs.items():
        tps = med([r["tokens_per_s"] for r in rows[skip_first:]] or [rows[-1]["tokens_per_s"]])
        out[f"{name}_final_loss"] = rows[-1]["loss"]
        out[f"{name}_tokens_per_s"] = tps
        if name != baseline:
            out[f"{name}_loss_rel_diff"] = (rows[-1]["loss"] - base_loss) / base_loss
            out[f"{name}_tokens_per_s_ratio"] = tps / base_tps
    return out


# ------------------------------------------------------------------ the steps


def _run(cmd: list[str], timeout_s: float, log_path: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    with open(log_path, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc


def summarize_bench_gpu(rows: list[dict]) -> dict:
    """``{shape: {variant: "1.23x torch, 456 us, 78 kernels" | "skipped: why" | "error: why"}}``."""
    out: dict[str, dict[str, str]] = {}
    for r in rows:
        if r["status"] != "ok":
            text = f"{r['status']}: {r.get('reason', '')[:200]}"
        else:
            ratio = "-" if r["ratio_vs_torch_bf16"] is None else f"{r['ratio_vs_torch_bf16']:.2f}x"
            text = f"{ratio} torch bf16, {r['wall_us']:.0f} us, {r['kernels']} kernels, {r['tflops']:.3g} TFLOP/s"
        out.setdefault(r["shape"], {})[r["variant"]] = text
    return out


def step_bench_gpu(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    path = os.path.join(out_dir, "bench_gpu.json")
    # Rows not started 30 s before the limit are skipped rows: the row in flight has time to finish.
    cmd = [sys.executable, os.path.join(REPO, "examples", "bench_gpu.py"), "--json", path,
           "--budget-s", f"{max(1.0, timeout_s - 30):.0f}"]
    if os.path.exists(path):  # an earlier check's rows must not pass for this one's
        os.remove(path)
    try:
        proc = _run(cmd, timeout_s, os.path.join(out_dir, "bench_gpu.log"))
    except subprocess.TimeoutExpired:  # the rows of the shapes it finished are in the JSON
        if not os.path.exists(path):
            raise
        with open(path) as f:
            return False, {"timed_out_after_s": round(timeout_s), **summarize_bench_gpu(json.load(f))}
    with open(os.path.join(out_dir, "bench_gpu.md"), "w") as f:
        f.write(proc.stdout)  # the table (progress lines go to stderr, in the log)
    if not os.path.exists(path):
        return False, {"returncode": proc.returncode}
    with open(path) as f:
        rows = json.load(f)
    return proc.returncode == 0, summarize_bench_gpu(rows)


def step_gpu_tests(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                timeout_s, os.path.join(out_dir, "gpu_tests.log"))
    counts = parse_pytest_counts(proc.stdout)
    return proc.returncode == 0 and counts.get("passed", 0) > 0, {"counts": counts, "returncode": proc.returncode}


def step_triton_bitexact(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    proc = _run([sys.executable, os.path.join(REPO, "tools", "gpu_check_kernels.py"), "--json",
                 os.path.join(out_dir, "triton_bitexact.json")], timeout_s, os.path.join(out_dir, "triton_bitexact.log"))
    with open(os.path.join(out_dir, "triton_bitexact.json")) as f:
        report = json.load(f)
    return proc.returncode == 0 and report["ok"], report


def step_bench_kernels(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    path = os.path.join(out_dir, "bench_kernels.json")
    cmd = [sys.executable, os.path.join(REPO, "examples", "bench_kernels.py"), "--tokens", "8192", "--hidden", "4096",
           "--gemm-hidden", "4096", "--gemm-m", "512", "4096", "--warmup", "5", "--repeats", "20", "--json", path]
    proc = _run(cmd, timeout_s, os.path.join(out_dir, "bench_kernels.log"))
    if proc.returncode != 0:
        return False, {"returncode": proc.returncode}
    with open(path) as f:
        bench = json.load(f)
    return True, {
        "fraction_of_copy": {r["kernel"]: round(r["fraction_of_copy"], 3) for r in bench["memory_bound"]},
        "fp8_gemm_tflops": {f"{r['shape']} {r['M']}x{r['N']}x{r['K']}": {
            "triton": round(r["triton_tflops"]), "scaled_mm": round(r["scaled_mm_tflops"]),
            "bf16": round(r["bf16_tflops"])} for r in bench["fp8_gemm"]},
    }


def step_gpt_fp8(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    runs = {}
    deadline = time.monotonic() + timeout_s
    for name, fp8 in (("bf16", "none"), ("fp8_delayed", "delayed"), ("fp8_current", "current")):
        run_dir = os.path.join(out_dir, f"gpt_{name}")
        cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "+model=gpt", f"fp8={fp8}",
               "trainer.max_steps=100", "trainer.log_interval=10", "trainer.val_interval=0", "trainer.dtype=bfloat16",
               "trainer.device=cuda", "trainer.progress=false", "logger=none", f"hydra.run.dir={run_dir}"]
        proc = _run(cmd, max(1.0, deadline - time.monotonic()), os.path.join(out_dir, f"gpt_{name}.log"))
        if proc.returncode != 0:
            return False, {"failed_run": name, "returncode": proc.returncode}
        runs[name] = read_metrics(run_dir)
    summary = compare_runs(runs)
    # FP8 should train like bf16 over 100 steps: final losses within 5 %.
    ok = all(abs(summary[f"{n}_loss_rel_diff"]) < 0.05 for n in ("fp8_delayed", "fp8_current"))
    return ok, summary


def step_tp2(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    path = os.path.join(out_dir, "tp2.json")
    proc = _run([sys.executable, os.path.join(REPO, "tools", "gpu_check_tp2.py"), "--json", path], timeout_s,
                os.path.join(out_dir, "tp2.log"))
    with open(path) as f:
        report = json.load(f)
    return proc.returncode == 0 and report["ok"], report


def step_gpt_compiled(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    runs = {}
    deadline = time.monotonic() + timeout_s
    variants = (("bf16", "none", False), ("bf16_compiled", "none", True),
                ("fp8_delayed", "delayed", False), ("fp8_delayed_compiled", "delayed", True))
    for name, fp8, compiled in variants:
        run_dir = os.path.join(out_dir, f"compiled_{name}")
        cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "+model=gpt", f"fp8={fp8}",
               "trainer.max_steps=60", "trainer.log_interval=10", "trainer.val_interval=0", "trainer.dtype=bfloat16",
               "trainer.device=cuda", "trainer.progress=false", "logger=none", f"hydra.run.dir={run_dir}",
               f"trainer.compile={str(compiled).lower()}"]
        proc = _run(cmd, max(1.0, deadline - time.monotonic()), os.path.join(out_dir, f"compiled_{name}.log"))
        if proc.returncode != 0:
            return False, {"failed_run": name, "returncode": proc.returncode, **(compare_runs(runs) if runs else {})}
        runs[name] = read_metrics(run_dir)
    summary = compare_runs(runs)
    ok = all(abs(summary[f"{n}_loss_rel_diff"]) < 0.05 for n in runs if n != "bf16")
    return ok, summary


def step_host_profile(out_dir: str, timeout_s: float) -> tuple[bool, dict]:
    path = os.path.join(out_dir, "host_profile.json")
    proc = _run([sys.executable, os.path.join(REPO, "tools", "gpu_host_profile.py"), "--json", path], timeout_s,
                os.path.join(out_dir, "host_profile.log"))
    if proc.returncode != 0:
        return False, {"returncode": proc.returncode}
    with open(path) as f:
        report = json.load(f)
    return True, {f"{s['hidden']}x{s['tokens']}": {name: {k: r[k] for k in ("host_us", "wall_us", "wall_vs_torch",
                                                                            "kernels", "syncs")}
                                                   for name, r in s["variants"].items()} for s in report["shapes"]}


STEPS = [
    Step("bench_gpu", 300, step_bench_gpu),  # first: the numbers users read (issue 35)
    Step("gpu_tests", 120, step_gpu_tests),
    Step("triton_bitexact", 30, step_triton_bitexact),
    Step("bench_kernels", 90, step_bench_kernels),
    Step("gpt_fp8", 80, step_gpt_fp8),
    Step("tp2", 40, step_tp2),
    Step("gpt_compiled", 120, step_gpt_compiled),
    Step("host_profile", 40, step_host_profile),
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "gpu_check_out"))
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps together")
    p.add_argument("--steps", default=",".join(s.name for s in STEPS), help="comma-separated subset")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing to check on this machine")
        return 0
    wanted = args.steps.split(",")
    unknown = set(wanted) - {s.name for s in STEPS}
    if unknown:
        p.error(f"--steps: unknown {sorted(unknown)}; expected names from {[s.name for s in STEPS]}")
    os.makedirs(args.out, exist_ok=True)
    info = device_info()
    results = run_steps([s for s in STEPS if s.name in wanted], args.out, args.budget)
    jpath, mpath = write_summary(results, info, args.out)
    for r in results:
        print(f"{r.name:<16} {r.status:<8} {r.seconds:6.1f} s")
    print(f"summary: {mpath} and {jpath}")
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
