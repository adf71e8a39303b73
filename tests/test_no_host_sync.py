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

Not covered, still syncing: the launcher's non-finite guard (it decides on the host
whether to skip the optimizer step) and its loss logging (``float(loss)``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
import torch._dynamo

import tp_fuse
from tp_fuse import ops
from tp_fuse.layers import TransformerLayer
from tp_fuse.quantization import AmaxReductionBuffer
from tp_fuse.recipe import DelayedScaling

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


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    with tp_fuse.autocast(recipe=DelayedScaling()):
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
