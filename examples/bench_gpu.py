"""One GPU benchmark users can believe (issue 35, point 5): step time, host time, kernels,
TFLOP/s and parity of plain torch vs tp_fuse in bf16 and four FP8 recipes.

Shapes (forward + backward of one step):

- ``host_bound``: LayerNorm -> Linear -> GELU -> Linear, hidden 1024, FFN 4096, 4096 tokens;
- ``gemm_bound``: the same block at hidden 4096, FFN 16384, 16384 tokens;
- ``llama_layer``: one ``tp_fuse.layers.TransformerLayer`` the way ``+model=llama`` builds
  it (RMSNorm, GQA attention through SDPA with RoPE, SwiGLU, no biases), hidden 4096,
  32 heads / 8 KV groups, FFN 14336, 4 x 2048 tokens;
- ``gpt_default`` / ``gpt_1b``: whole optimizer steps of the launcher (``train()`` in this
  process, as ``examples/bench_compile.py --launcher`` runs it): the default GPT
  (``+model=gpt``) and a 1.2B GPT (hidden 2048, 24 layers, 16 heads, 1024 tokens per
  sequence; byte vocabulary, so that no BPE is trained at start-up).

Variants: ``torch_bf16`` (plain ``torch.nn`` / ``torch.nn.functional`` with its own copy of
the same initial weights; for the GPT shapes a plain-torch GPT given to the launcher as its
``model_factory``; both in ``examples/bench_gpu_torch.py``), ``tp_fuse_bf16`` (no recipe),
and ``fp8_delayed``, ``fp8_current``, ``fp8_rowwise``, ``fp8_blockwise``
(``tp_fuse.autocast(recipe=...)``). A variant this device
cannot run (``tp_fuse.availability``) is a ``skipped`` row with the reason; one that raises
is an ``error`` row (and the exit status is 1); rows never disappear.

Each row: ``wall_us`` and ``host_us`` per step, ``kernels`` per step, ``tflops`` (GEMM FLOPs
counted analytically: 2*M*N*K per GEMM, x3 for forward + backward; attention's two matmuls
counted whole, as the launcher's MFU does), ``ratio_vs_torch_bf16`` (step time over
torch_bf16's at that shape) and ``parity`` (blocks: relative L2 error of the output against
torch_bf16's on the same input and weights; GPT shapes: relative difference of the final
loss after the same steps from the same init).

Timing on CUDA: warm-up steps first (FP8 scales, Triton compilation, cuBLAS handles), then
rounds in which the variants take turns (so that host load hits all alike); per round,
``wall`` = CUDA events around N back-to-back steps / N (the host may run ahead, as in
training); then ``host`` = per step, after a synchronize, the host time until the step's
call returns (the issue cost; a step that syncs inside pays its wait here). Medians. Block
gradients accumulate into the existing ``.grad`` in every variant alike (a later
micro-batch's backward; docs/gpu.md's host-profile rows were measured the same way).

GPT shapes: the launcher's own step timer (its health guard reads the loss once per step,
so a step's time is a wall time; the step includes the optimizer) and host = step time minus
the time spent in that read; medians of steps 3..N-1 (step 2 is counted and profiled, the
last one logs).

Kernels per step: ``torch.profiler``'s CUDA events of one forward + backward on CUDA (GPT
shapes: all micro-batches of one step, 2 by default; not the optimizer), and
:func:`count_kernels` (the host-side count: the seam for tp_fuse's launch counter) always.

    python examples/bench_gpu.py [--json out.json] [--shapes host_bound,gemm_bound] [--budget-s 270]
    python examples/bench_gpu.py --smoke --json out.json   # every row, tiny, on CPU (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import tp_fuse
from bench_compile import launcher_steps  # examples/: the launcher runs the way bench_compile times them
from bench_gpu_torch import TorchBlock, TorchLayer, torch_gpt_factory  # examples/: the torch_bf16 references
from tp_fuse import ops
from tp_fuse.availability import is_bf16_available, is_fp8_available, is_fp8_block_scaling_available
from tp_fuse.kernels.launch_count import count_launches
from tp_fuse.launch.api import compose
from tp_fuse.launch.logging.report import flops_per_token
from tp_fuse.layers import TransformerLayer
from tp_fuse.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling

SHAPES = ("host_bound", "gemm_bound", "llama_layer", "gpt_default", "gpt_1b")
VARIANTS = ("torch_bf16", "tp_fuse_bf16", "fp8_delayed", "fp8_current", "fp8_rowwise", "fp8_blockwise")
RECIPES = {"fp8_delayed": DelayedScaling, "fp8_current": Float8CurrentScaling,
           "fp8_rowwise": Float8RowwiseScaling, "fp8_blockwise": Float8BlockScaling}
LAUNCHER_FP8 = {"torch_bf16": "none", "tp_fuse_bf16": "none", "fp8_delayed": "delayed", "fp8_current": "current",
                "fp8_rowwise": "rowwise", "fp8_blockwise": "blockwise"}
BLOCKS = {"host_bound": dict(hidden=1024, ffn=4096, tokens=4096),
          "gemm_bound": dict(hidden=4096, ffn=16384, tokens=16384),
          "llama_layer": dict(hidden=4096, ffn=14336, heads=32, groups=8, seq=2048, batch=4)}
SMOKE_BLOCKS = {"host_bound": dict(hidden=64, ffn=256, tokens=32),
                "gemm_bound": dict(hidden=128, ffn=512, tokens=64),
                "llama_layer": dict(hidden=64, ffn=128, heads=4, groups=2, seq=16, batch=2)}
GPT_1B = ["model.hidden_size=2048", "model.num_layers=24", "model.num_heads=16", "model.max_seq_len=1024"]
LAUNCHER = {"gpt_default": [], "gpt_1b": GPT_1B}
SMOKE_LAUNCHER = {"gpt_default": ["model.num_layers=1", "model.hidden_size=64", "model.max_seq_len=32"],
                  "gpt_1b": ["model.num_layers=2", "model.hidden_size=64", "model.max_seq_len=32"]}


@dataclasses.dataclass
class Plan:
    """Steps per row: block warm-up, timed rounds x steps per round, host-time repeats;
    launcher steps per GPT shape (medians of steps 3..N)."""

    warmup: int = 5
    rounds: int = 5
    steps: int = 10
    host_repeats: int = 10
    launcher_steps: dict = dataclasses.field(default_factory=lambda: {"gpt_default": 20, "gpt_1b": 8})


# Launcher runs of 4 steps: step 3 is the one timed.
SMOKE_PLAN = Plan(warmup=1, rounds=2, steps=2, host_repeats=2, launcher_steps={"gpt_default": 4, "gpt_1b": 4})


# ------------------------------------------------------------------ kernels per step


def count_kernels(step_fn: Callable[[], object]) -> int:
    """Kernels one call of ``step_fn`` launches, counted on the host by tp_fuse's launch
    counter (``tp_fuse.kernels.launch_count``: ATen ops by what they launch on CUDA, each
    Triton call and each ``_scaled_mm`` as one). In a process that simulates CUDA
    (``TP_FUSE_SIMULATE_CUDA=1``, ``tools/count_launches.py``) that is the CUDA path's
    count; elsewhere the CPU path's."""
    return count_launches(step_fn).total


def cuda_kernels(step_fn: Callable[[], object]) -> int:
    """CUDA kernels (and memsets/copies) of one call of ``step_fn``: torch.profiler's device events."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_fields(step_fn: Callable[[], object], device: str) -> dict:
    """``kernels`` (measured on CUDA, else counted) and ``kernels_counted`` (always counted),
    from one call of ``step_fn`` (a launcher step must not run twice)."""
    if device != "cuda":
        counted = count_kernels(step_fn)
        return {"kernels": counted, "kernels_source": "tp_fuse launch counter (CPU path)", "kernels_counted": counted}
    box: dict[str, int] = {}
    kernels = cuda_kernels(lambda: box.setdefault("counted", count_kernels(step_fn)))
    return {"kernels": kernels, "kernels_source": "torch.profiler CUDA events", "kernels_counted": box["counted"]}


# ------------------------------------------------------------------ rows


def availability(variant: str, device: str) -> Optional[str]:
    """Why ``variant`` cannot run on ``device`` (None: it can). On CPU every recipe runs (the
    exact emulations); tp_fuse.availability answers for the GPU when one is present."""
    if device == "cpu":
        return None
    if variant in ("torch_bf16", "tp_fuse_bf16"):
        ok, why = is_bf16_available(return_reason=True)
        return None if ok else why
    if variant == "fp8_blockwise":
        ok, why = is_fp8_block_scaling_available(return_reason=True)
        return None if ok else why
    if variant in RECIPES:
        ok, why = is_fp8_available(return_reason=True)
        return None if ok else why
    return None


def block_flops(shape: str, sz: dict) -> float:
    """GEMM FLOPs of one forward + backward: 3 x 2*M*N*K per GEMM (+ attention's matmuls)."""
    h, f = sz["hidden"], sz["ffn"]
    if shape != "llama_layer":
        return 6.0 * sz["tokens"] * 2 * h * f
    d = h // sz["heads"]
    weights = h * (sz["heads"] + 2 * sz["groups"]) * d + sz["heads"] * d * h + h * 2 * f + f * h
    tokens = sz["seq"] * sz["batch"]
    return 6.0 * weights * tokens + 12.0 * sz["heads"] * d * sz["seq"] * tokens


def build_block(shape: str, sz: dict, device: str, dtype: torch.dtype) -> nn.Module:
    """The tp_fuse module of a block shape, from seed 0: every call builds the same weights,
    so each variant gets its own copy (and its own gradients) without deep-copying."""
    torch.manual_seed(0)
    h = sz["hidden"]
    if shape == "llama_layer":  # as +model=llama builds each layer (launch/models/build.py -> GPT)
        return TransformerLayer(h, sz["ffn"], sz["heads"], num_query_groups=sz["groups"], normalization="RMSNorm",
                                activation="swiglu", bias=False, position_embedding="rope", seed=0,
                                dtype=dtype, device=device)
    return ops.Sequential(ops.LayerNorm(h), ops.Linear(h, sz["ffn"]), ops.GELU(),
                          ops.Linear(sz["ffn"], h)).to(device=device, dtype=dtype)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _window_us(fn: Callable[[], object], device: str, steps: int) -> float:
    """Microseconds per step of ``steps`` back-to-back calls, from an empty queue to the last
    kernel's end (CUDA events; on CPU every call is synchronous)."""
    _sync(device)
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps  # elapsed_time is in ms


def _host_us(fn: Callable[[], object], device: str) -> float:
    """Host microseconds until one call returns, started on an empty queue (the issue cost)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def time_rounds(fns: dict[str, Callable[[], object]], device: str,
                plan: Plan) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """``({variant: {"wall_us", "host_us"}}, {variant: error})``: median wall and host
    microseconds per step, the variants taking turns each round. A variant that raises
    leaves the turns with its error; the others go on."""
    wall: dict[str, list[float]] = {k: [] for k in fns}
    host: dict[str, list[float]] = {k: [] for k in fns}
    failed: dict[str, str] = {}
    measurements = [(wall, lambda fn: _window_us(fn, device, plan.steps))] * plan.rounds
    measurements += [(host, lambda fn: _host_us(fn, device))] * plan.host_repeats
    for into, measure in measurements:
        for name, fn in fns.items():
            if name in failed:
                continue
            try:
                into[name].append(measure(fn))
            except Exception as exc:  # noqa: BLE001 - reported as this variant's row
                failed[name] = f"{type(exc).__name__}: {exc}"[:1000]
    _sync(device)
    times = {k: {"wall_us": statistics.median(wall[k]), "host_us": statistics.median(host[k])}
             for k in fns if k not in failed}
    return times, failed


def block_step(model: nn.Module, recipe, x: torch.Tensor,
               dy: torch.Tensor) -> tuple[Callable[[], torch.Tensor], Callable[[], None]]:
    """(forward, forward + backward) of ``model`` on ``x``, under ``recipe`` when it is not None."""
    def forward() -> torch.Tensor:
        if recipe is None:
            return model(x)
        with tp_fuse.autocast(recipe=recipe):
            return model(x)

    def step() -> None:
        forward().backward(dy)

    return forward, step


def block_rows(shape: str, sz: dict, variants: list[str], device: str, dtype: torch.dtype, plan: Plan) -> list[dict]:
    """Rows of one block shape: every runnable variant warmed up, timed in turns, counted, compared."""
    gen = torch.Generator(device=device).manual_seed(1)
    in_shape = (sz["seq"], sz["batch"], sz["hidden"]) if shape == "llama_layer" else (sz["tokens"], sz["hidden"])
    x0 = torch.randn(in_shape, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(in_shape, device=device, dtype=dtype, generator=gen)
    rows: dict[str, dict] = {}
    steps: dict[str, Callable[[], object]] = {}
    forwards: dict[str, Callable[[], torch.Tensor]] = {}
    for variant in variants:
        why = availability(variant, device)
        if why is not None:
            rows[variant] = {"status": "skipped", "reason": why}
            continue
        recipe = RECIPES[variant]() if variant in RECIPES else None
        try:
            model = build_block(shape, sz, device, dtype)
            if variant == "torch_bf16":
                model = TorchLayer(model, dtype) if shape == "llama_layer" else TorchBlock(model, dtype)
            # A leaf input per variant: its .grad is its own.
            fwd, step = block_step(model, recipe, x0.clone().requires_grad_(), dy)
            for _ in range(plan.warmup):  # first calls: planning, FP8 scales, Triton compiles, cuBLAS handles
                step()
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - reported as this variant's row
            rows[variant] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:1000]}
            continue
        steps[variant], forwards[variant] = step, fwd
    times, failed = time_rounds(steps, device, plan)
    for variant, why in failed.items():
        rows[variant] = {"status": "error", "reason": why}
        del steps[variant], forwards[variant]
    flops = block_flops(shape, sz)
    with torch.no_grad():
        y_ref = forwards["torch_bf16"]().float() if "torch_bf16" in forwards else None
    for variant, step in steps.items():
        wall = times[variant]["wall_us"]
        row = rows[variant] = {"status": "ok", **times[variant], "tflops": flops / (wall * 1e-6) / 1e12}
        try:  # the timings stand even if counting or the parity forward fails
            row.update(kernel_fields(step, device))
            if y_ref is not None:
                with torch.no_grad():
                    y = forwards[variant]().float()
                row.update(parity_metric="output_rel_l2_vs_torch_bf16",
                           parity=((y - y_ref).norm() / y_ref.norm()).item())
        except Exception as exc:  # noqa: BLE001 - reported in this variant's row
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:1000])
    return [{"variant": v, "size": sz, "gemm_flops_per_step": flops, **rows[v]} for v in variants]


def launcher_overrides(shape: str, variant: str, device: str, dtype: torch.dtype, smoke: bool, steps: int) -> list[str]:
    model = (SMOKE_LAUNCHER if smoke else LAUNCHER)[shape]
    batch = ["trainer.global_batch_size=4", "trainer.micro_batch_size=2"] if smoke else []
    return ["+model=gpt", *model, *batch, f"fp8={LAUNCHER_FP8[variant]}", f"trainer.max_steps={steps}",
            "trainer.log_interval=1000", "trainer.val_interval=0", "logger=none", "trainer.progress=false",
            "checkpoint.save_final=false", f"trainer.device={device}", f"trainer.dtype={str(dtype).split('.')[-1]}"]


def launcher_rows(shape: str, variants: list[str], device: str, dtype: torch.dtype, smoke: bool, plan: Plan,
                  deadline: float) -> list[dict]:
    """Rows of one GPT shape: one launcher run per variant (same seed, data and steps)."""
    steps = plan.launcher_steps[shape]
    rows = []
    for variant in variants:
        overrides = launcher_overrides(shape, variant, device, dtype, smoke, steps)
        cfg = compose(overrides)
        tokens = cfg.trainer.global_batch_size * cfg.seq_len
        flops = flops_per_token(cfg.model.gpt, cfg.seq_len) * tokens
        row = {"variant": variant, "gemm_flops_per_step": flops,
               "size": {"model": (SMOKE_LAUNCHER if smoke else LAUNCHER)[shape], "tokens_per_step": tokens,
                        "steps": steps}}
        why = availability(variant, device)
        if why is None and time.monotonic() > deadline:
            why = "the time budget (--budget-s) was spent before this row"
        if why is not None:
            rows.append({**row, "status": "skipped", "reason": why})
            continue
        try:
            run = launcher_steps(overrides, model_factory=torch_gpt_factory if variant == "torch_bf16" else None,
                                 probe=lambda fn: kernel_fields(fn, device))
        except Exception as exc:  # noqa: BLE001 - reported as this variant's row
            rows.append({**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:1000]})
            continue
        finally:  # the run's model and optimizer state go before the next run allocates its own
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        # Steps 3..N-1: step 1 starts up, step 2 is the one counted/profiled, and the last
        # step logs (metrics, FP8 statistics), which the others do not.
        timed = slice(2, -1)
        wall = statistics.median(run["step_s"][timed]) * 1e6
        host = statistics.median(s - w for s, w in zip(run["step_s"][timed], run["wait_s"][timed])) * 1e6
        rows.append({**row, "status": "ok", "wall_us": wall, "host_us": host, **run["probe"],
                     "tflops": flops / (wall * 1e-6) / 1e12, "final_loss": run["result"].final_loss})
    base = next((r for r in rows if r["variant"] == "torch_bf16" and r["status"] == "ok"), None)
    for r in rows:
        if base is not None and r["status"] == "ok":
            r.update(parity_metric="final_loss_rel_diff_vs_torch_bf16",
                     parity=(r["final_loss"] - base["final_loss"]) / base["final_loss"])
    return rows


def write_json(rows: list[dict], path: Optional[str]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def run(shapes: list[str], variants: list[str], smoke: bool, budget_s: float,
        json_path: Optional[str] = None) -> list[dict]:
    """Every (shape, variant) row, in order, with the device, torch version and date on each.
    ``json_path`` is rewritten after every shape: a run killed at its time limit keeps its rows."""
    device = "cpu" if smoke else "cuda"
    # Smoke in float32: CI checks that tp_fuse and the plain-torch references agree to fp32
    # rounding (bf16 runs on CPU too, but would hide a wrong reference in bf16 noise).
    dtype = torch.float32 if smoke else torch.bfloat16
    plan = SMOKE_PLAN if smoke else Plan()
    info = {"device": "cpu" if smoke else torch.cuda.get_device_name(),
            "capability": None if smoke else "sm_%d%d" % torch.cuda.get_device_capability(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dtype": str(dtype).split(".")[-1], "smoke": smoke}
    deadline = time.monotonic() + budget_s
    rows: list[dict] = []
    for shape in shapes:
        if shape in LAUNCHER:
            shape_rows = launcher_rows(shape, variants, device, dtype, smoke, plan, deadline)
        elif time.monotonic() > deadline:
            shape_rows = [{"variant": v, "status": "skipped",
                           "reason": "the time budget (--budget-s) was spent before this shape"} for v in variants]
        else:
            shape_rows = block_rows(shape, (SMOKE_BLOCKS if smoke else BLOCKS)[shape], variants, device, dtype, plan)
        base = next((r.get("wall_us") for r in shape_rows if r["variant"] == "torch_bf16"), None)
        for r in shape_rows:
            for key in ("wall_us", "host_us", "kernels", "tflops", "parity"):
                r.setdefault(key, None)
            r["ratio_vs_torch_bf16"] = r["wall_us"] / base if base and r["wall_us"] is not None else None
            r["host_fraction"] = r["host_us"] / r["wall_us"] if r["wall_us"] else None
            rows.append({"shape": shape, **r, **info})
        write_json(rows, json_path)
        gc.collect()  # this shape's models before the next shape's
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"[bench_gpu] {shape} done at {budget_s - (deadline - time.monotonic()):.1f} s", file=sys.stderr,
              flush=True)
    return rows


def render(rows: list[dict]) -> str:
    """The table: one line per row, skipped and failed rows with their reason."""
    def num(v: Optional[float], fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    head = rows[0] if rows else {}
    lines = [f"{head.get('device')} ({head.get('capability') or 'cpu'}), torch {head.get('torch')}, "
             f"{head.get('dtype')}, {head.get('date')}{' [smoke: tiny sizes on CPU]' if head.get('smoke') else ''}",
             "| shape | variant | wall us | host us | host/wall | kernels | TFLOP/s | x torch_bf16 | parity |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['shape']} | {r['variant']} | {r['status']}: {r['reason'][:120]} |||||||")
            continue
        lines.append(f"| {r['shape']} | {r['variant']} | {num(r['wall_us'], '.1f')} | {num(r['host_us'], '.1f')} | "
                     f"{num(r['host_fraction'], '.2f')} | {r['kernels']} | {num(r['tflops'], '.3g')} | "
                     f"{num(r['ratio_vs_torch_bf16'], '.2f')} | {num(r['parity'], '.2e')} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="every row at tiny sizes on CPU (CI)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="seconds; rows not started by then are skipped rows (the row in flight finishes: 5 min in all)")
    args = p.parse_args(argv)
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    for name, got, known in (("--shapes", shapes, SHAPES), ("--variants", variants, VARIANTS)):
        if set(got) - set(known):
            p.error(f"{name}: unknown {sorted(set(got) - set(known))}; expected names from {list(known)}")
    if "torch_bf16" not in variants:
        variants.insert(0, "torch_bf16")  # every ratio and parity is against it
    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; --smoke runs every row at tiny sizes on CPU", file=sys.stderr)
        return 2
    rows = run(shapes, variants, args.smoke, args.budget_s, args.json)
    print(render(rows))
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
