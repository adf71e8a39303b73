"""``trainer.cuda_graphs``: refused without a GPU at the config check; its static gradient
buffers persist across micro-batches and steps (CPU); on a GPU, it trains like eager."""

from __future__ import annotations

import math

import pytest
import torch

from tp_fuse.launch import trainer as trainer_module
from tp_fuse.launch.api import compose
from tp_fuse.launch.config_validate import validate
from tp_fuse.launch.runtime import start
from tp_fuse.launch.trainer import Trainer
from test_checkpoint_resume import COMMON

# 3 steps of 2 micro-batches each (global 8 / micro 4), FP8 delayed, no FP8 observers.
RUN = [*COMMON, "trainer.max_steps=3", "trainer.log_interval=100", "optim.warmup_steps=1", "fp8.stats=false"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("override, field", [("trainer.cuda_graphs=true", "trainer.cuda_graphs"),
                                             ("optim.capturable=true", "optim.capturable")])
def test_refused_without_a_gpu_at_config_check(override, field):
    cfg = compose([*RUN, override])
    with pytest.raises(ValueError, match=rf"{field}=true .* needs? a GPU \(no CUDA device on this machine\)"):
        validate(cfg, 1)


def test_cuda_graphs_on_cpu_device_is_refused_even_with_a_gpu():
    cfg = compose([*RUN, "trainer.cuda_graphs=true", "trainer.device=cpu"])
    with pytest.raises(ValueError, match=r"trainer.cuda_graphs=true .* needs? a GPU \(trainer.device=cpu\)"):
        validate(cfg, 1)


def test_static_grads_persist_across_micro_batches_and_steps(tmp_path, monkeypatch):
    """The cuda_graphs configuration's gradients: allocated once, zeroed in place, the same
    storage at every micro-batch of every step (the graphs are CPU-less here: captured
    nothing; what is checked is the loop around them)."""
    cfg = compose(RUN)
    layout = validate(cfg, 1)
    cfg.trainer.cuda_graphs = True  # past the config check, which refuses it without a GPU
    captured = []
    monkeypatch.setattr(trainer_module, "graph_layers", lambda model, **kw: captured.append(kw))
    tr = Trainer(cfg, start(cfg, layout, str(tmp_path / "run")))
    assert len(captured) == 1 and captured[0]["micro_batch_size"] == 4
    ptrs = {id(p): p.grad.data_ptr() for p in tr.params}
    seen = []
    real = tr.loader.micro_batch

    def micro_batch(micro):
        seen.append({id(p): p.grad.data_ptr() if p.grad is not None else None for p in tr.params})
        return real(micro)

    monkeypatch.setattr(tr.loader, "micro_batch", micro_batch)
    try:
        result = tr.fit()
    finally:
        tr.rt.shutdown()  # the default group too: later tests in this worker check that none is left
    assert len(seen) == 6  # 3 steps x 2 micro-batches
    for i, now in enumerate(seen):
        assert now == ptrs, f"micro-batch call {i}: a .grad buffer was replaced"
    assert all(p.grad is not None and p.grad.data_ptr() == ptrs[id(p)] for p in tr.params)
    assert math.isfinite(result.final_loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("fp8", ["none", "delayed", "current"])
def test_cuda_graphs_trains_like_eager(tmp_path, fp8):
    runs = {}
    for graphs in (False, True):
        cfg = compose([*RUN, f"fp8={fp8}", "trainer.max_steps=10", "trainer.device=cuda",
                       f"trainer.cuda_graphs={str(graphs).lower()}", "optim.capturable=true"])
        tr = Trainer(cfg, start(cfg, validate(cfg, 1), str(tmp_path / f"run-{graphs}")))
        try:
            runs[graphs] = tr.fit()
        finally:
            tr.rt.shutdown()
    for step, loss in runs[False].losses.items():
        assert math.isclose(runs[True].losses[step], loss, rel_tol=3e-3), (step, runs[True].losses[step], loss)
