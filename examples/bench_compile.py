"""``trainer.compile=true`` vs eager: the default GPT's step time and compile time, on CPU.

Two measurements (both print the CPU, thread count and load average; a shared machine
makes any single timing noisy, hence the alternation):

1. **Interleaved steps** (default). Two copies of the default GPT (``+model=gpt``: its
   config, AdamW, batch 16 as 2 micro-batches of 8 x 128 tokens), one with the launcher's
   ``compile_layers`` applied; their training steps alternate (eager, compiled, eager, ...)
   in one process, so that load changes hit both alike. A step is what the launcher's step
   computes: per micro-batch ``autocast`` forward + backward, then gradient norm, clipping
   and AdamW (no data loading or logging, the same in both modes). Reported: the median of
   steps 3..N per copy and their ratio; the compile time = the compiled copy's first step
   minus its median (dynamo + AOTAutograd + inductor; the backward compiles inside that
   step too); dynamo's graph and graph-break counts (the layers share one graph: a second
   one would be a recompilation).
2. ``--launcher``: whole ``train()`` runs alternating eager / ``trainer.compile=true``,
   median step time of steps 3..N from the launcher's own timer, and the final losses.

    python examples/bench_compile.py [--steps 30] [--fp8 none delayed] [--launcher --rounds 2]

Inductor caches compiled code on disk (``TORCHINDUCTOR_CACHE_DIR``): the first compile in
a fresh cache directory is cold, later ones warm.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import platform
import statistics
import tempfile
import time
from typing import Callable, Optional

import torch
import torch._dynamo

import tp_fuse
from tp_fuse.launch.api import compose, train
from tp_fuse.launch.health import NonfiniteGuard
from tp_fuse.launch.logging import report
from tp_fuse.launch.models.build import build_recipe, compile_layers
from tp_fuse.launch.trainer import Trainer
from tp_fuse.layers import GPT, GPTConfig


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"CPU: {model}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}; load average {load()}")


def load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def _stepper(model: GPT, fp8: str, cfg) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step of ``model`` as the launcher runs it (2 micro-batches)."""
    recipe = build_recipe(cfg.fp8) if fp8 != "none" else None
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                              weight_decay=cfg.optim.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> None:
        for micro in range(2):
            rows = slice(8 * micro, 8 * micro + 8)
            with tp_fuse.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
                loss = model(tokens[rows], labels[rows])
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)

    return step


def interleaved(fp8: str, steps: int) -> None:
    cfg = compose(["+model=gpt", f"fp8={fp8}"])
    eager = GPT(GPTConfig(**vars(cfg.model.gpt)), seed=cfg.trainer.seed)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_layers(compiled)
    runs = {"eager": _stepper(eager, fp8, cfg), "compiled": _stepper(compiled, fp8, cfg)}
    seq = cfg.model.gpt.max_seq_len
    times: dict[str, list[float]] = {name: [] for name in runs}
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.gpt.vocab_size, (16, seq + 1), generator=gen)
        for name, step in runs.items():
            start = time.perf_counter()
            step(tokens[:, :-1], tokens[:, 1:])
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts[2:]) for name, ts in times.items()}
    counters = torch._dynamo.utils.counters
    print(f"fp8={fp8:<8} eager {med['eager'] * 1e3:8.1f} ms   compiled {med['compiled'] * 1e3:8.1f} ms   "
          f"compiled/eager {med['compiled'] / med['eager']:.2f}x   compile {times['compiled'][0] - med['compiled']:6.1f} s   "
          f"graphs {counters['stats']['unique_graphs']}  breaks {sum(counters['graph_break'].values())}   "
          f"load {load()}", flush=True)


def launcher_steps(overrides: list[str], model_factory: Optional[Callable[..., torch.nn.Module]] = None,
                   probe: Optional[Callable[[Callable[[], object]], object]] = None,
                   probe_call: int = 2) -> dict:
    """One quiet in-process ``train(overrides)``, with each step's times read from the
    launcher's own timer (``StepMeter.metrics``): ``{"step_s": [...], "wait_s": [...],
    "probe": ..., "result": TrainResult}``.

    ``wait_s``: per step, the seconds spent in the health guard's single device-to-host
    read (``NonfiniteGuard.check``): the time the host waited for the device, so that
    ``step_s - wait_s`` is the host's own time for the step. ``probe``: called as
    ``probe(fn)`` around the ``probe_call``-th ``Trainer._forward_backward`` call (all
    micro-batches of one step; ``fn()`` runs it) to count or profile that step; its
    return value is kept in ``"probe"``. ``model_factory``: as ``train``'s.
    """
    step_s: list[float] = []
    wait_s: list[float] = []
    probed: dict = {}
    calls = [0]
    originals = (report.StepMeter.metrics, NonfiniteGuard.check, Trainer._forward_backward)

    def record(self, step: int, step_time: float, device: torch.device) -> dict[str, float]:
        step_s.append(step_time)
        return originals[0](self, step, step_time, device)

    def timed_check(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return originals[1](self, *args, **kwargs)
        finally:
            wait_s.append(time.perf_counter() - start)

    def forward_backward(self):
        calls[0] += 1
        if probe is None or calls[0] != probe_call:
            return originals[2](self)
        box: list = []
        probed["probe"] = probe(lambda: box.append(originals[2](self)))
        return box[0]

    torch._dynamo.reset()
    report.StepMeter.metrics, NonfiniteGuard.check, Trainer._forward_backward = record, timed_check, forward_backward
    try:
        with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            result = train(overrides, run_dir=run_dir, model_factory=model_factory)
    finally:
        report.StepMeter.metrics, NonfiniteGuard.check, Trainer._forward_backward = originals
    return {"step_s": step_s, "wait_s": wait_s, "probe": probed.get("probe"), "result": result}


def launcher_run(fp8: str, steps: int, compiled: bool) -> tuple[float, float, float]:
    """(median step ms of steps 3..N, step 1 ms, final loss) of one quiet ``train()``."""
    args = ["+model=gpt", f"fp8={fp8}", f"trainer.max_steps={steps}", "logger=none", "trainer.progress=false",
            "trainer.val_interval=0", "checkpoint.save_final=false"] + (["trainer.compile=true"] if compiled else [])
    run = launcher_steps(args)
    step_times = run["step_s"]
    return statistics.median(step_times[2:]) * 1e3, step_times[0] * 1e3, run["result"].final_loss


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fp8", nargs="+", default=["none", "delayed"])
    parser.add_argument("--launcher", action="store_true", help="whole train() runs instead of interleaved steps")
    parser.add_argument("--rounds", type=int, default=2, help="--launcher: eager/compiled alternations")
    args = parser.parse_args(argv)
    print(machine())
    print(f"default GPT (+model=gpt), {args.steps} steps, median of steps 3..{args.steps}")
    for fp8 in args.fp8:
        if not args.launcher:
            interleaved(fp8, args.steps)
            continue
        for r in range(args.rounds):
            for compiled in (False, True):
                med, first, loss = launcher_run(fp8, args.steps, compiled)
                print(f"fp8={fp8:<8} {'compiled' if compiled else 'eager':<9} round {r + 1}: median {med:8.1f} ms  "
                      f"step 1 {first:8.0f} ms  final loss {loss:.5f}  load {load()}", flush=True)
    print(f"load average at the end: {load()}")


if __name__ == "__main__":
    main()
