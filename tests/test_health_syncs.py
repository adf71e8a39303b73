"""The launcher's non-finite guard reads the device once per step, and trains as before.

``launch/health.py`` decides on the host whether to take the optimizer step. It used to
read the loss, the gradient norm and every FP8 quantizer's non-finite counter one by one
(``float``/``int``: one device->host sync each), and the trainer read the norm again to
clip and the loss again to log: 4 + one per quantizer per step (52 for a 4-layer GPT
under FP8 delayed). Now the verdict is computed on the device and read in one transfer
that also carries the loss and the norm. These tests count the host reads of a whole
training step and check that the training is bit-identical to the step written the old
way (per-value reads, clipping on a freshly read norm).

Not counted: ``optimizer.step()`` (torch's non-capturable AdamW keeps its step counts in
host tensors and reads them with ``.item()``: host memory on a GPU, no sync), the data
loader (a host-side permutation) and the model's forward/backward: the eager model still
reads the device per micro-batch (token and label range checks, the GELU backward's tail
test), which is the model's business, not the loop's; the compiled step is checked in
``test_no_host_sync.py``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import types
from typing import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tp_fuse.launch.api import compose
from tp_fuse.launch.config_validate import validate
from tp_fuse.launch.models.build import build_model
from tp_fuse.launch.grads import clip_grads, global_grad_norm
from tp_fuse.launch.optim import build_optimizer, lr_at, set_lr
from tp_fuse.launch.runtime import start
from tp_fuse.launch.trainer import Trainer
from test_checkpoint_resume import COMMON

# 3 steps of a 2-layer GPT (32 quantizers under FP8); only the last step logs.
RUN = [*COMMON, "model.num_layers=2", "trainer.max_steps=3", "trainer.log_interval=100", "optim.warmup_steps=1"]
# Python-level host reads (what the old guard used) and the aten ops that wait for the device.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")


class _SyncCounter(TorchDispatchMode):
    """Counts host reads: Python-level (patched Tensor methods) and dispatcher-level ops."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = 0  # > 0: not counting
        self._depth = 0  # a Python read (item) reaches _local_scalar_dense too: count it once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and self._depth == 0 and func._schema.name in SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def python_reads(self) -> Iterator[None]:
        saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def counted(real):
            def call(*args, **kwargs):
                if not self.paused and self._depth == 0:
                    self.count += 1
                self._depth += 1
                try:
                    return real(*args, **kwargs)
                finally:
                    self._depth -= 1
            return call

        for name, real in saved.items():
            setattr(torch.Tensor, name, counted(real))
        try:
            yield
        finally:
            for name, real in saved.items():
                setattr(torch.Tensor, name, real)


def _trainer(tmp_path, fp8: str) -> Trainer:
    cfg = compose([*RUN, f"fp8={fp8}"])
    rt = start(cfg, validate(cfg, 1), str(tmp_path / f"run-{fp8}"))
    return Trainer(cfg, rt)


@pytest.mark.parametrize("fp8", ["none", "delayed"])
def test_one_host_read_per_step(tmp_path, fp8) -> None:
    trainer = _trainer(tmp_path, fp8)
    counter = _SyncCounter()
    per_step: list[int] = []
    real_advance, real_step = trainer.loader.advance, trainer.optimizer.step

    def advance() -> None:  # once per step, after the optimizer step: a step boundary
        per_step.append(counter.count)
        counter.count = 0
        real_advance()

    def paused(real):
        def call(*args, **kwargs):
            counter.paused += 1  # nested: the loader inside forward/backward
            try:
                return real(*args, **kwargs)
            finally:
                counter.paused -= 1
        return call

    trainer.loader.advance = advance
    trainer.optimizer.step = paused(real_step)  # AdamW's host-resident step counts (module docstring)
    trainer.loader.micro_batch = paused(trainer.loader.micro_batch)  # a host-side permutation
    # The eager model's own reads (token/label range checks, the GELU tail test: one each
    # per micro-batch) are the model's, not the loop's: counted apart, left for later.
    trainer._forward_backward = paused(trainer._forward_backward)
    try:
        with counter.python_reads(), counter:
            trainer.fit()
    finally:
        trainer.rt.shutdown()
    assert len(per_step) == 3
    # Every step, the first included (the FP8 quantizers exist after its forward): the
    # guard's one read, which also carries the loss and the norm for clipping and logging.
    assert per_step == [1, 1, 1], per_step


@pytest.mark.parametrize("fp8", ["none", "delayed"])
def test_training_is_bit_identical_to_per_value_reads(tmp_path, fp8) -> None:
    """The launcher's trained weights and losses equal the old step's: host-side reads of
    the loss and norm, ``clip_grads`` on a freshly read norm, an unconditional AdamW step."""
    trainer = _trainer(tmp_path, fp8)
    cfg = trainer.cfg
    torch.manual_seed(0)  # any init: the trainer's weights are copied in (before the first forward)
    ref_model = build_model(cfg, trainer.rt)
    ref_model.load_state_dict(trainer.model.state_dict())
    ref = types.SimpleNamespace(model=ref_model, loader=copy.deepcopy(trainer.loader), sharded_dp=None,
                                recipe=trainer.recipe, fp8_group=trainer.fp8_group, fp8_gemms=trainer.fp8_gemms,
                                rt=trainer.rt)
    ref_opt = build_optimizer(ref_model, cfg.optim)
    ref_params = [p for p in ref_model.parameters() if p.requires_grad]
    try:
        result = trainer.fit()
    finally:
        trainer.rt.shutdown()
    ref_losses = {}
    for step in range(1, cfg.trainer.max_steps + 1):
        set_lr(ref_opt, lr_at(step, cfg.optim, cfg.trainer.max_steps))
        loss = Trainer._forward_backward(ref)
        norm = global_grad_norm(ref_model, None, 1)
        assert math.isfinite(float(loss)) and math.isfinite(float(norm))
        clip_grads(ref_params, norm, cfg.optim.grad_clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref.loader.advance()
        ref_losses[step] = float(loss)
    assert result.losses == ref_losses
    for (name, p), q in zip(trainer.model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
