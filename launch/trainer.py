"""The training loop: micro-batches, FP8 autocast, DP reduction, clipping, AdamW, logging.

One optimizer step::

    lr = warmup/cosine(step)
    for each micro-batch:                       # gradient accumulation
        with tp_fuse.autocast(recipe, fp8 group):   # one amax all-reduce per direction
            loss = model(tokens, labels)
        (loss / accum).backward()               # SP grads are TP-reduced inside backward
    average grads over the DP group             # one bucketed all-reduce per dtype
    norm over all TP shards; clip; AdamW step
    every log_interval: metrics (+ FP8 statistics) -> metrics.jsonl / W&B
    every val_interval: validation loss (high precision: never touches FP8 state)
    every checkpoint.interval: atomic distributed checkpoint

Deterministic: batches depend only on the step (``launch.data``), initialization only
on the seed, and all reductions run in a fixed order, so a resumed run repeats the
uninterrupted one exactly (same layout) -- see ``tests/test_checkpoint*.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.debug import DebugSession, Fp8StatsCollector

from .checkpoint import CheckpointError, CheckpointManager, TrainingState
from .config import TrainConfig
from .data import BatchLoader, TokenData
from layers.fsdp import reduce_sequence_parallel_grads, sequence_parallel_params

from .fsdp import make_sharded_dp
from .grads import allreduce_dp_grads, clip_grads, global_grad_norm
from .logging_wandb import WandbLogger
from .metrics import MetricsSink
from .model import ModelFactory, build_model, build_recipe, fp8_autocast
from .optim import build_optimizer, lr_at, set_lr
from .progress import Progress
from .runtime import Runtime, restart_count

__all__ = ["TrainResult", "Trainer"]


@dataclasses.dataclass
class TrainResult:
    """What :meth:`Trainer.fit` returns (same on every rank)."""

    start_step: int
    last_step: int
    losses: dict[int, float]  # step -> training loss (mean over micro-batches and DP ranks)
    val_losses: dict[int, float]
    run_dir: str
    checkpoint: Optional[str]  # last checkpoint written, if any

    @property
    def final_loss(self) -> float:
        return self.losses[self.last_step]


class Trainer:
    """Builds everything for one run from the typed config and trains.

    Args:
        cfg: validated configuration.
        rt: the runtime (process groups, device, run directory).
        model_factory: builds the model (default ``layers.GPT``); same signature.
    """

    def __init__(self, cfg: TrainConfig, rt: Runtime, model_factory: Optional[ModelFactory] = None) -> None:
        self.cfg = cfg
        self.rt = rt
        tr, topo = cfg.trainer, rt.topology
        torch.manual_seed(tr.seed)
        self.data = TokenData.build(cfg.data, cfg.seq_len, cfg.model.gpt.vocab_size)
        self.loader = BatchLoader(
            self.data,
            global_batch_size=tr.global_batch_size,
            micro_batch_size=tr.micro_batch_size,
            dp_rank=topo.dp_rank,
            dp_size=topo.dp_size,
            seed=tr.seed,
            device=rt.device,
        )
        # parallel.dp_shard > 1: FSDP2 over the DP ranks (HSDP with dp_replicate > 1).
        self.sharded_dp = make_sharded_dp(rt.layout, rt.device.type) if rt.layout.fsdp else None
        self.model = build_model(cfg, rt, model_factory, self.sharded_dp)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._sp_params = sequence_parallel_params(self.model) if self.sharded_dp is not None else []
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.recipe = build_recipe(cfg.fp8)
        self.fp8_group = topo.fp8_group(cfg.fp8.group) if self.recipe is not None else None
        tp_group = topo.tp_group if rt.layout.tp > 1 else None

        # Observers attach before the first forward pass (fusion decisions are cached then).
        self.fp8_stats: Optional[Fp8StatsCollector] = None
        if self.recipe is not None and cfg.fp8.stats:
            self.fp8_stats = Fp8StatsCollector(reduction_group=topo.world_group)
            self.fp8_stats.attach(self.model, tp_group=tp_group)
        self.debug: Optional[DebugSession] = None
        if cfg.debug.config is not None:
            self.debug = DebugSession(cfg.debug.config, reduction_group=topo.world_group, iteration=1)
            self.debug.attach(self.model, tp_group=tp_group)

        self.state = TrainingState(
            model=self.model,
            optimizer=self.optimizer,
            loader=self.loader,
            recipe=self.recipe,
            fp8_group=self.fp8_group,
            seed=tr.seed,
            model_config=dataclasses.asdict(cfg.model.gpt),
        )
        ck = cfg.checkpoint
        self.ckpt = CheckpointManager(
            ck.dir if ck.dir is not None else os.path.join(rt.run_dir, "checkpoints"),
            rt, keep=ck.keep, verify=ck.verify,
        )
        self.start_step = self._maybe_resume()
        if self.debug is not None:
            self.debug.iteration = self.start_step + 1

        wandb = None
        if rt.is_rank0 and cfg.logger.kind == "wandb":
            wandb = WandbLogger(cfg.logger, rt.run_dir, {**cfg.to_dict(), "layout": dataclasses.asdict(rt.layout)})
        # Records after the start step (a crashed attempt's, or an older run's in a reused
        # run directory) are dropped: the files hold one trajectory.
        self.sink = MetricsSink(rt.run_dir, rt.is_rank0, wandb, resume_step=self.start_step)

    # ---- resume --------------------------------------------------------------------

    def _maybe_resume(self) -> int:
        mode = self.cfg.checkpoint.resume
        if restart_count() > 0 and mode is False:
            mode = "auto"  # an elastic restart continues from the last checkpoint
        if mode is False:
            return 0
        path = self.ckpt.latest()
        if path is None:
            if mode is True:
                raise CheckpointError(
                    f"checkpoint.resume=true but there is no complete checkpoint in {self.ckpt.root} "
                    "(set checkpoint.dir to the directory of the run to resume)"
                )
            return 0
        step = self.ckpt.load(path, self.state)
        if self.rt.is_rank0:
            print(f"[tp-fuse] resumed from {path} at step {step}", file=sys.stderr, flush=True)
        return step

    # ---- one step --------------------------------------------------------------------

    def _forward_backward(self) -> torch.Tensor:
        """All micro-batches of one step; returns the summed mean loss (device tensor)."""
        accum = self.loader.grad_accum_steps
        total = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        for micro in range(accum):
            if self.sharded_dp is not None:
                # FSDP2 reduce-scatters gradients once, after the last micro-batch.
                self.model.set_requires_gradient_sync(micro == accum - 1)
            tokens, labels = self.loader.micro_batch(micro)
            with fp8_autocast(self.recipe, self.fp8_group):
                loss = self.model(tokens, labels)
            (loss / accum).backward()
            total += loss.detach().float()
        return total / accum

    def _validate(self) -> float:
        """Mean validation loss over ``trainer.val_batches`` micro-batches and DP ranks."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        batches = self.loader.val_batches(self.cfg.trainer.val_batches)
        # Debug features observe training only (validation runs in high precision).
        paused = self.debug.paused() if self.debug is not None else contextlib.nullcontext()
        with torch.no_grad(), paused:
            for tokens, labels in batches:
                total += self.model(tokens, labels).double()
        if self.sharded_dp is not None:
            # No backward follows: FSDP2 would leave the root's parameters unsharded.
            self.model.reshard()
        self.model.train()
        total /= len(batches)
        if self.rt.layout.dp > 1:
            dist.all_reduce(total, group=self.rt.topology.dp_group)
            total /= self.rt.layout.dp
        return float(total)

    def _maybe_fail(self, step: int) -> None:
        tr = self.cfg.trainer
        if tr.fail_at_step != step or restart_count() != 0:
            return
        if self.rt.rank == tr.fail_rank % self.rt.layout.world_size:
            print(f"[tp-fuse] trainer.fail_at_step={step}: rank {self.rt.rank} exits (fault injection)",
                  file=sys.stderr, flush=True)
            os._exit(17)

    def fit(self) -> TrainResult:
        """Train from the start (or resumed) step to ``trainer.max_steps``."""
        cfg, rt = self.cfg, self.rt
        tr = cfg.trainer
        topo = rt.topology
        tokens_per_step = tr.global_batch_size * cfg.seq_len
        progress = Progress(tr.max_steps, self.start_step, rt.is_rank0, bar=tr.progress)
        losses: dict[int, float] = {}
        val_losses: dict[int, float] = {}
        last_ckpt: Optional[str] = None
        exit_code = 1
        try:
            last_step = tr.max_steps if tr.exit_at_step is None else min(tr.exit_at_step, tr.max_steps)
            for step in range(self.start_step + 1, last_step + 1):
                self._maybe_fail(step)
                val_now = bool(tr.val_interval) and (step % tr.val_interval == 0 or step == last_step)
                log_now = step % tr.log_interval == 0 or step == last_step or val_now
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.optim, tr.max_steps)
                set_lr(self.optimizer, lr)
                if self.fp8_stats is not None:
                    self.fp8_stats.active = log_now
                loss = self._forward_backward()
                t_comm = time.perf_counter()
                if self.sharded_dp is None:
                    allreduce_dp_grads(self.params, topo.dp_group, rt.layout.dp)
                else:  # FSDP2 reduced over DP in backward; SP partial sums still need the TP sum
                    reduce_sequence_parallel_grads(self._sp_params, topo.tp_group if rt.layout.tp > 1 else None)
                t_comm = time.perf_counter() - t_comm
                norm = global_grad_norm(self.model, topo.tp_group, rt.layout.tp,
                                        self.sharded_dp.shard_group if self.sharded_dp is not None else None)
                finite = bool(torch.isfinite(norm))
                if finite:
                    clip_grads(self.params, norm, cfg.optim.grad_clip)
                    self.optimizer.step()
                elif rt.is_rank0:
                    print(f"[tp-fuse] step {step}: non-finite gradient norm; optimizer step skipped",
                          file=sys.stderr, flush=True)
                self.optimizer.zero_grad(set_to_none=True)
                self.loader.advance()
                self.state.step = step
                if self.debug is not None:
                    self.debug.step()
                # Every step: the progress bar shows it, and TrainResult records the trajectory.
                if rt.layout.dp > 1:
                    dist.all_reduce(loss, group=topo.dp_group)
                    loss /= rt.layout.dp
                loss_value = float(loss)
                losses[step] = loss_value
                step_time = time.perf_counter() - t0
                progress.update(step, loss_value, tokens_per_step / step_time)

                if log_now:
                    metrics = {
                        "loss": loss_value,
                        "lr": lr,
                        "grad_norm": float(norm),
                        "tokens_per_s": tokens_per_step / step_time,
                        "step_time_s": step_time,
                        "comm/dp_grad_allreduce_s": t_comm,
                        "consumed_samples": float(self.loader.consumed_samples),
                    }
                    if not finite:
                        metrics["skipped_step"] = 1.0
                    if val_now:
                        val_losses[step] = metrics["val_loss"] = self._validate()
                    fp8 = self.fp8_stats.collect() if self.fp8_stats is not None else None
                    self.sink.log(step, metrics, fp8)
                    if self.debug is not None:
                        self.sink.log_debug(self.debug.collect())
                    val = f"  val {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
                    progress.line(
                        f"step {step:>6}/{tr.max_steps}  loss {loss_value:.4f}{val}  lr {lr:.2e}  "
                        f"grad_norm {float(norm):.3f}  {metrics['tokens_per_s']:,.0f} tok/s"
                    )
                ck = cfg.checkpoint
                exiting = tr.exit_at_step == step and step < tr.max_steps
                if (ck.interval and step % ck.interval == 0) or (ck.save_final and step == tr.max_steps) or exiting:
                    last_ckpt = self.ckpt.save(self.state)
            exit_code = 0
        finally:
            progress.close()
            self.sink.close(exit_code)
        last = max(losses) if losses else self.start_step
        return TrainResult(self.start_step, last, losses, val_losses, rt.run_dir, last_ckpt)
