"""No host synchronization in the FP8 amax reduction, nor in a compiled FP8 training step.

On a GPU, ``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``.cpu()`` and tensors built
from Python lists on the device wait for the device: one of them per step serializes host
and GPU (and breaks CUDA graphs). CI has no GPU, so the rule is checked on CPU by refusing
those calls (they raise) while the code under test runs:

* the once-per-step delayed-scaling reduction and scale update (forward: at the autocast
  exit; backward: the end-of-pass callback), after the first step (which builds the
  per-recipe constant tensors once);
* a whole ``torch.compile``'d FP8 step of a ``TransformerLayer``: forward, backward, both
  reductions (the compiled casts run the eager quantizers).

* the same compiled step under a block-scaled recipe (MXFP8: ``tp_fuse::block_cast`` /
  ``block_gemm``), and under ``torch.compile(mode="reduce-overhead")`` -- the CUDA-graph
  mode; on CPU inductor falls back to its default mode (no CUDA graphs), but dynamo must
  trace the same one graph, which ``torch._dynamo.explain`` and ``fullgraph=True`` check;
* the whole eager training step of a GPT -- embedding (its token-range check), layers,
  cross-entropy (its label checks), backward, both FP8 reductions -- in bf16/fp32, FP8
  delayed and current (the range and label checks run on the device with
  ``torch._assert_async``);
* the overlap auto-tuner once a GEMM's choice is measured: later look-ups are dictionary
  reads, no agreement all-reduce and no ``.tolist()``.

Outside the step by design, one host read per step: the launcher's non-finite guard
(``launch/health.py``: it decides on the host whether to skip the optimizer step, after
forward and backward, outside any compiled region; the loss and gradient norm ride in the
same read) -- counted in ``test_health_syncs.py``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from typing import Iterator

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import tp_fuse
from tolerances import tols
from tp_fuse import ops
from tp_fuse.kernels.launch_count import simulated_cuda_env
from tp_fuse.layers import GPT, GPTConfig, TransformerLayer
from tp_fuse.quantization import AmaxReductionBuffer
from tp_fuse.overlap.auto import OverlapAutoTuner
from tp_fuse.recipe import DelayedScaling, MXFP8BlockScaling

SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@contextlib.contextmanager
def refuse_host_syncs() -> Iterator[None]:
    """Make the host-synchronizing tensor calls raise while the block runs."""
    saved = {name: getattr(torch.Tensor, name) for name in SYNCING}
    saved_tensor = torch.tensor

    def refuse(name: str):
        def call(*args, **kwargs):
            raise AssertionError(f"host sync inside a step: {name}")
        return call

    for name in SYNCING:
        setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
    torch.tensor = refuse("torch.tensor (a host-to-device copy on a GPU)")
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = saved_tensor


class _Guard:
    """Counts the reductions run while ``armed``; those run under refuse_host_syncs."""

    def __init__(self) -> None:
        self.armed = False
        self.calls = 0


@pytest.fixture
def guarded_reduction(monkeypatch) -> _Guard:
    guard = _Guard()
    original = AmaxReductionBuffer.reduce_and_update

    def guarded(self):
        if not guard.armed:
            return original(self)
        with refuse_host_syncs():
            original(self)
        guard.calls += 1

    monkeypatch.setattr(AmaxReductionBuffer, "reduce_and_update", guarded)
    return guard


def _step(model: torch.nn.Module, x: torch.Tensor, recipe=None) -> None:
    with tp_fuse.autocast(recipe=recipe or DelayedScaling()):
        y = model(x)
    y.float().square().mean().backward()


def test_amax_reduction_does_not_sync(guarded_reduction) -> None:
    model = ops.Sequential(ops.Linear(16, 32), ops.GELU(), ops.Linear(32, 16))
    x = torch.randn(8, 16, requires_grad=True)
    _step(model, x)  # builds quantizers and the cached per-recipe constants
    guarded_reduction.armed = True
    _step(model, x)
    assert guarded_reduction.calls == 2  # forward (autocast exit) and backward (end of pass)


def test_compiled_fp8_step_does_not_sync(guarded_reduction) -> None:
    torch._dynamo.reset()
    layer = TransformerLayer(32, 64, 2, seed=1)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 2, 32, requires_grad=True)
    _step(compiled, x)  # compiles; first-step setup
    guarded_reduction.armed = True
    with refuse_host_syncs():
        _step(compiled, x)
    assert guarded_reduction.calls == 2


def test_compiled_block_scaled_step_does_not_sync() -> None:
    """MXFP8 (no amax reduction: the block scales come from the data, on the device)."""
    torch._dynamo.reset()
    compiled = torch.compile(TransformerLayer(32, 64, 2, seed=1), fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 2, 32, requires_grad=True)
    _step(compiled, x, MXFP8BlockScaling())  # compiles; builds the quantizers
    with refuse_host_syncs():
        _step(compiled, x, MXFP8BlockScaling())


# fp32 passes too (one more inductor compile, ~100 s on the 2-core CI machine: not run here).
@pytest.mark.parametrize("recipe", [DelayedScaling(), MXFP8BlockScaling()], ids=["delayed", "mxfp8"])
def test_reduce_overhead_mode_traces_one_graph(recipe) -> None:
    """``mode="reduce-overhead"`` (CUDA graphs; on CPU inductor's default code, no graphs):
    one graph with 0 graph breaks (``fullgraph=True`` raises on a break), compiled == eager
    (FP8: the recipe's tolerance), and after the first step no host sync (the precondition
    of capturing it on a GPU)."""
    torch._dynamo.reset()
    ctx = (lambda: tp_fuse.autocast(recipe=recipe)) if recipe is not None else contextlib.nullcontext
    x = torch.randn(8, 2, 32)
    eager = TransformerLayer(32, 64, 2, seed=1)
    compiled = torch.compile(copy.deepcopy(eager), mode="reduce-overhead", fullgraph=True)
    outs = []
    for fn in (eager, compiled, compiled):
        xs = x.clone().requires_grad_()
        if len(outs) == 2:
            with refuse_host_syncs():  # the second compiled step
                with ctx():
                    y = fn(xs)
                y.square().mean().backward()
        else:
            with ctx():
                y = fn(xs)
            y.square().mean().backward()
        outs.append((y.detach(), xs.grad))
    tol = dict(rtol=1e-5, atol=1e-5) if recipe is None else tols("fp8_hybrid")
    for y, dx in outs[1:2]:
        torch.testing.assert_close(y, outs[0][0], **tol)
        torch.testing.assert_close(dx, outs[0][1], **tol)


class _Clock:
    def measure(self, label, fn):
        fn()
        return {"unfused": 2e-3}.get(label, 1e-3)


def test_auto_tuner_does_not_sync_after_its_first_measurement() -> None:
    # A one-rank gloo world: the first decision agrees over its group (one all-reduce + .tolist()).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _tuner_decides_twice()
    finally:
        dist.destroy_process_group()


def _tuner_decides_twice() -> None:
    tuner = OverlapAutoTuner(_Clock(), warmup=0, repeats=1)
    candidates = {"unfused": lambda: None, "ring_exchange": lambda: None}
    first = tuner.decide("fc1_fprop", "sig", candidates, None, torch.device("cpu"))
    with refuse_host_syncs():
        assert tuner.decide("fc1_fprop", "sig", candidates, None, torch.device("cpu")) == first == "ring_exchange"


# The CUDA path, simulated in a subprocess (tp_fuse.kernels.launch_count): on the CPU path
# some kernels branch on the data where CUDA runs Triton (the torch dGELU's tail check).
_GPT_STEP_SYNCS = """
import json
import torch
import tp_fuse
from tp_fuse.kernels.launch_count import count_launches
from tp_fuse.layers import GPT, GPTConfig
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling
out = {}
for name, recipe in (("bf16", None), ("delayed", DelayedScaling()), ("current", Float8CurrentScaling())):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=1, num_heads=2)
    model = GPT(cfg, dtype=torch.bfloat16)
    tokens, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    def step():
        with tp_fuse.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(tokens, labels)
        loss.backward()
    step()  # first-step set-up (quantizers, constants, groups); the second step is steady state
    c = count_launches(step)
    out[name] = {"syncs": c.syncs, "cuda_path": c.cuda_path, "kernels": dict(c.by_kernel)}
print("RESULT " + json.dumps(out))
"""


def test_whole_gpt_step_does_not_sync_on_the_cuda_path() -> None:
    """Embedding (token-range check), layers, cross-entropy (label checks), backward and
    both FP8 reductions of a GPT step, bf16 and FP8 delayed/current, on the CUDA path
    counted on CPU: no device-to-host read (main had 4: the embedding's two ``.item()``,
    the loss's ``bool`` and ``int``)."""
    env = {**os.environ, **simulated_cuda_env()}
    proc = subprocess.run([sys.executable, "-c", _GPT_STEP_SYNCS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for name, entry in result.items():
        assert entry["cuda_path"], name
        assert entry["syncs"] == 0, f"{name}: a device-to-host read in the step: {entry['kernels']}"
        assert entry["kernels"].get("aten._assert_async", 0) >= 2, name  # the range and label checks ran


def test_bad_token_ids_and_labels_are_clear_value_errors_on_cpu() -> None:
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=1, num_heads=2))
    good = torch.randint(0, 64, (2, 16))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\), got min \d+ max 70"):
        model(good.clone().index_fill_(1, torch.tensor([3]), 70).clamp_(min=0), good)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 64\) or ignore_index=-100 \(got \[99\]\)"):
        model(good, good.clone().index_fill_(1, torch.tensor([5]), 99))
    with pytest.raises(ValueError, match="every label equals ignore_index"):
        model(good, torch.full_like(good, -100))
