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
    every checkpoint.interval: atomic distributed checkpoint ("saved checkpoint step N -> path")
    SIGTERM/SIGUSR1/SIGINT (agreed in the health all-reduce): checkpoint, stop (tp_fuse.launch.preemption)

Deterministic: batches depend only on the step (``tp_fuse.launch.data``), initialization only
on the seed, and all reductions run in a fixed order, so a resumed run repeats the
uninterrupted one exactly (same layout) -- see ``tests/test_checkpoint*.py``.

A run that ends normally (or stops on a signal after saving) ends with a summary block on
rank 0 (``tp_fuse.launch.logging.summary``).
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

from tp_fuse.layers.fsdp import reduce_sequence_parallel_grads, sequence_parallel_params
from tp_fuse import FP8WeightCache
from tp_fuse.debug import DebugSession, Fp8StatsCollector

from .checkpoint.manager import CheckpointManager
from .checkpoint.training_state import TrainingState
from .config import TrainConfig
from .cuda_graphs import graph_layers, make_grads_static
from .data import BatchLoader, TokenData, make_tokenizer
from .fsdp import make_sharded_dp
from .grads import allreduce_dp_grads, clip_grads, global_grad_norm
from .health import NonfiniteGuard, TrainingDivergedError
from .logging.wandb_logger import WandbLogger
from .logging.metrics import MetricsSink
from .checkpoint.hf_export import export_hf_directory
from .models.hf import load_tokenizer
from .models.build import CUDA_GRAPH_MODES, ModelFactory, build_model, build_recipe, fp8_autocast, fp8_quantizers
from .optim import build_optimizer, lr_at, set_lr
from .logging.progress import Progress
from .logging.report import format_eta, peak_memory_bytes
from .logging.summary import RunSummary, summary_lines
from .preemption import StopSignals, signal_name
from .runtime import Runtime, job_key, restart_count
from .startup import announce, fp8_gemm_choice_lines, presize_overlap_buffers, say

__all__ = ["TrainResult", "Trainer", "TrainingDivergedError"]


@dataclasses.dataclass
class TrainResult:
    """What :meth:`Trainer.fit` returns (same on every rank)."""

    start_step: int
    last_step: int
    losses: dict[int, float]  # step -> training loss (mean over micro-batches and DP ranks)
    val_losses: dict[int, float]
    run_dir: str
    checkpoint: Optional[str]  # last checkpoint written, if any
    resumed_loss: Optional[float] = None  # loss of the resumed checkpoint's step (from its manifest)
    stopped_by: Optional[str] = None  # "SIGTERM", ...: stopped early by a signal, after saving (tp_fuse.launch.preemption)

    @property
    def already_complete(self) -> bool:
        """The run resumed a checkpoint at (or past) ``trainer.max_steps``: nothing was trained."""
        return not self.losses

    @property
    def final_loss(self) -> Optional[float]:
        """Loss of the last step; for an already complete run, the loss its checkpoint recorded."""
        return self.losses[self.last_step] if self.losses else self.resumed_loss


class Trainer:
    """Builds everything for one run from the typed config and trains.

    Args:
        cfg: validated configuration.
        rt: the runtime (process groups, device, run directory).
        model_factory: builds the model (default ``tp_fuse.layers.GPT``); same signature.
    """

    def __init__(self, cfg: TrainConfig, rt: Runtime, model_factory: Optional[ModelFactory] = None) -> None:
        self.cfg = cfg
        self.rt = rt
        tr, topo = cfg.trainer, rt.topology
        if rt.is_rank0:  # runtime.start printed it before train.log existed: repeat it there
            say(f"run dir: {rt.run_dir}")
        torch.manual_seed(tr.seed)
        if cfg.model.name == "hf":  # the model directory's tokenizer.json
            self.tokenizer = load_tokenizer(cfg.model.path)
        else:  # a trained BPE is built by rank 0 (and cached beside the data); the others wait
            self.tokenizer = make_tokenizer(cfg.data, cfg.model.gpt.vocab_size, rt.is_rank0, rt.barrier)
        self.data = TokenData.build(cfg.data, cfg.seq_len, cfg.model.gpt.vocab_size, self.tokenizer)
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
        self.model = build_model(cfg, rt, model_factory, say if rt.is_rank0 else None, self.sharded_dp)
        self.compile_stats = None
        if cfg.trainer.compile:
            # Imported only when compiling (it loads torch._dynamo; eager runs do not).
            from .logging.compile_stats import CompileStats

            self.compile_stats = CompileStats.start()  # the layers compile at their first call
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._sp_params = sequence_parallel_params(self.model) if self.sharded_dp is not None else []
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.recipe = build_recipe(cfg.fp8)
        self.fp8_group = topo.fp8_group(cfg.fp8.group) if self.recipe is not None else None
        # fp8.gemms with "device" resolved (auto on CUDA, all elsewhere), decided once.
        self.fp8_gemms = cfg.fp8.gemms_on(rt.device.type)
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

        # Overlap workspaces at their largest (high-precision) size before training.
        presize_overlap_buffers(cfg, self.model, self.loader, self.fp8_stats, self.debug)

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
        rt.add_cleanup(self.ckpt.release)  # the directory's lock is held until the job ends
        self.start_step = self._maybe_resume()
        # trainer.cuda_graphs (launch/cuda_graphs.py): static .grad buffers, then each layer
        # captured, after the resume (loads write in place: the graphs see them).
        # torch.compile's CUDA-graph modes get them too (refused on CUDA until verified there:
        # static grads are the remedy for their failure, launch/models/build.py).
        self.static_grads = tr.cuda_graphs or (tr.compile and tr.compile_mode in CUDA_GRAPH_MODES)
        if self.static_grads:
            make_grads_static(self.params)
        if tr.cuda_graphs:
            graph_layers(self.model, seq_len=cfg.seq_len, micro_batch_size=tr.micro_batch_size, dtype=rt.dtype,
                         device=rt.device, recipe=self.recipe, fp8_group=self.fp8_group)
        self._quantizer_map: dict[str, object] = {}
        self.guard = NonfiniteGuard(tr.max_nonfinite_steps, topo.world_group, rt.device, self._watched_quantizers)
        if self.debug is not None:
            self.debug.iteration = self.start_step + 1

        wandb = None
        if rt.is_rank0 and cfg.logger.kind == "wandb":
            wandb = WandbLogger(cfg.logger, rt.run_dir, {**cfg.to_dict(), "layout": dataclasses.asdict(rt.layout)})
        self.wandb = wandb
        # Records after the start step (a crashed attempt's, or an older run's in a reused
        # run directory) are dropped: the files hold one trajectory.
        self.sink = MetricsSink(rt.run_dir, rt.is_rank0, wandb, resume_step=self.start_step)
        self.meter = announce(cfg, rt, self.model, self.loader, self.start_step,
                              wandb.describe() if wandb is not None else None, self.tokenizer)

    # ---- resume --------------------------------------------------------------------

    def _maybe_resume(self) -> int:
        """Claim the checkpoint directory for this run and resume what it decides (run_identity)."""
        ck = self.cfg.checkpoint
        path = self.ckpt.start(ck.resume, restarted=restart_count() > 0, job=job_key(self.rt), overwrite=ck.overwrite)
        if path is None:
            return 0
        step = self.ckpt.load(path, self.state)
        if self.rt.is_rank0:
            print(f"[tp-fuse] resumed from {path} at step {step}", file=sys.stderr, flush=True)
        return step

    def _watched_quantizers(self) -> dict[str, object]:
        """Every FP8 quantizer, by ``<module>/<role>`` (cached once they exist)."""
        if not self._quantizer_map and self.recipe is not None:
            self._quantizer_map = {
                f"{qualname}/{role}": q
                for qualname, qs in fp8_quantizers(self.model, self.recipe, self.fp8_group).items()
                for role, q in qs.items()
            }
        return self._quantizer_map

    # ---- one step --------------------------------------------------------------------

    def _forward_backward(self) -> torch.Tensor:
        """All micro-batches of one step; returns the summed mean loss (device tensor)."""
        accum = self.loader.grad_accum_steps
        total = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        # FP8 weights are cast by the first micro-batch and reused by the others; the
        # cache lives for this step only (the optimizer step changes the weights).
        cache = FP8WeightCache() if self.recipe is not None and accum > 1 else None
        for micro in range(accum):
            if self.sharded_dp is not None:
                # FSDP2 reduce-scatters gradients once, after the last micro-batch.
                self.model.set_requires_gradient_sync(micro == accum - 1)
            tokens, labels = self.loader.micro_batch(micro)
            with fp8_autocast(self.recipe, self.fp8_group, self.fp8_gemms, cache):
                loss = self.model(tokens, labels)
            (loss / accum).backward()
            total += loss.detach().float()
        return total / accum

    def _validate(self) -> float:
        """Mean validation loss over the fixed validation set (``trainer.val_tokens``).

        Every layout evaluates the same sequences: each DP rank a share, each batch's mean
        weighted by its rows, sums and row counts added over the DP group.
        """
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.rt.device)  # [loss * rows, rows]
        batches = self.loader.val_batches(self.cfg.trainer.val_tokens)
        # Debug features observe training only (validation runs in high precision).
        paused = self.debug.paused() if self.debug is not None else contextlib.nullcontext()
        with torch.no_grad(), paused:
            for tokens, labels in batches:
                rows = tokens.shape[0]
                sums[0] += self.model(tokens, labels).double() * rows
                sums[1] += rows
        if self.sharded_dp is not None:
            # No backward follows: FSDP2 would leave the root's parameters unsharded.
            self.model.reshard()
        self.model.train()
        if self.rt.layout.dp > 1:
            dist.all_reduce(sums, group=self.rt.topology.dp_group)
        return float(sums[0] / sums[1])

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
        stopped_by: Optional[str] = None
        exit_code = 1
        if self.start_step >= tr.max_steps:
            if rt.is_rank0:
                print(f"[tp-fuse] the run is already complete: its checkpoint is at step {self.start_step} and "
                      f"trainer.max_steps={tr.max_steps}; nothing to train (raise trainer.max_steps to continue)",
                      file=sys.stderr, flush=True)
            progress.close()
            self.sink.close(0)
            self._export_hf(self.start_step)  # e.g. a checkpoint resumed only to be exported
            return TrainResult(self.start_step, self.start_step, {}, {}, rt.run_dir, None, self.state.last_loss)
        signals = StopSignals().install()  # SIGTERM/SIGUSR1/SIGINT: finish the step, save, stop
        t_start = time.perf_counter()
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
                if step == self.start_step + 1 and rt.is_rank0 and self.recipe is not None \
                        and self.fp8_gemms == "auto":
                    for line in fp8_gemm_choice_lines(self.model):  # decided in this step's forward
                        say(line)
                t_comm = time.perf_counter()
                if self.sharded_dp is None:
                    allreduce_dp_grads(self.params, topo.dp_group, rt.layout.dp)
                else:  # FSDP2 reduced over DP in backward; SP partial sums still need the TP sum
                    reduce_sequence_parallel_grads(self._sp_params, topo.tp_group if rt.layout.tp > 1 else None)
                t_comm = time.perf_counter() - t_comm
                norm = global_grad_norm(self.model, topo.tp_group, rt.layout.tp,
                                        self.sharded_dp.shard_group if self.sharded_dp is not None else None)
                # The DP mean loss (what is logged) before the guard, so that the guard's one
                # host read returns it too: a NaN/inf on any DP rank makes the mean NaN/inf
                # (the loss is >= 0: nothing cancels), the same verdict as each rank's own.
                if rt.layout.dp > 1:
                    dist.all_reduce(loss, group=topo.dp_group)
                    loss /= rt.layout.dp
                health = self.guard.check(step, loss, norm, signals.signum)
                finite = health.finite
                if finite:
                    clip_grads(self.params, norm, cfg.optim.grad_clip, norm_value=health.grad_norm)
                    self.optimizer.step()
                else:
                    if rt.is_rank0:
                        print(f"[tp-fuse] step {step}: {'; '.join(health.reasons)}: optimizer step skipped "
                              f"({health.in_a_row} in a row, trainer.max_nonfinite_steps="
                              f"{tr.max_nonfinite_steps})", file=sys.stderr, flush=True)
                # Static grads (cuda_graphs) are zeroed in place: the same buffers every step.
                self.optimizer.zero_grad(set_to_none=not self.static_grads)
                self.loader.advance()
                self.state.step = step
                if self.debug is not None:
                    self.debug.step()
                # Every step: the progress bar shows it, and TrainResult records the trajectory
                # (read by the guard in its one transfer: no host sync of its own).
                loss_value = health.loss
                losses[step] = loss_value
                self.state.last_loss = loss_value
                step_time = time.perf_counter() - t0
                progress.update(step, loss_value, tokens_per_step / step_time)
                perf = self.meter.metrics(step, step_time, rt.device)

                if log_now:
                    metrics = {
                        "loss": loss_value,
                        "lr": lr,
                        "grad_norm": health.grad_norm,
                        **perf,  # step_time_s, tokens_per_s, eta_s, mfu (if a peak is known), peak_mem_gib
                        "comm/dp_grad_allreduce_s": t_comm,
                        "consumed_samples": float(self.loader.consumed_samples),
                    }
                    if not finite:
                        metrics["skipped_step"] = 1.0
                    if self.recipe is not None:
                        metrics["fp8_nonfinite_amax_count"] = float(health.nonfinite_amax_total)
                    if val_now:
                        val_losses[step] = metrics["val_loss"] = self._validate()
                    fp8 = self.fp8_stats.collect() if self.fp8_stats is not None else None
                    self.sink.log(step, metrics, fp8)
                    if self.debug is not None:
                        self.sink.log_debug(self.debug.collect())
                    val = f"  val {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
                    progress.line(
                        f"step {step:>6}/{tr.max_steps}  loss {loss_value:.4f}{val}  lr {lr:.2e}  "
                        f"grad_norm {health.grad_norm:.3f}  {perf['step_time_s'] * 1e3:,.0f} ms/step  "
                        f"{perf['tokens_per_s']:,.0f} tok/s  "
                        + (f"MFU {perf['mfu']:.1%}  " if "mfu" in perf else "MFU n/a  ")
                        + f"mem {perf['peak_mem_gib']:.2f} GiB  ETA {format_eta(perf['eta_s'])}"
                    )
                # After logging (the failing step is in the logs), before any save.
                self.guard.stop_if_diverged(step, health, lambda: last_ckpt or self.ckpt.latest_of_run())
                ck = cfg.checkpoint
                # All ranks agreed on the signal in the health all-reduce: stop at the same step.
                stopping = bool(health.stop_signal) and step < last_step
                exiting = (tr.exit_at_step == step and step < tr.max_steps) or stopping
                saving = bool(ck.interval and step % ck.interval == 0) or (ck.save_final and step == tr.max_steps) \
                    or exiting
                # A skipped step may be followed by good ones, but the run never ends on one nor
                # saves one as its newest checkpoint (it would resume into the same NaN).
                self.guard.stop_if_ending_nonfinite(
                    step, health, "it would be saved as the newest checkpoint" if saving else
                    "it is the run's last step" if step == last_step else None,
                    lambda: last_ckpt or self.ckpt.latest_of_run())
                if saving:
                    last_ckpt = self.ckpt.save(self.state)
                    if rt.is_rank0:
                        say(f"saved checkpoint step {step} -> {last_ckpt}")
                if stopping:
                    stopped_by = signal_name(health.stop_signal)
                    if rt.is_rank0:
                        print(f"[tp-fuse] {stopped_by}: stopped after step {step} of {tr.max_steps}; checkpoint "
                              f"saved: {last_ckpt}. Continue with checkpoint.resume=auto and the same checkpoint.dir",
                              file=sys.stderr, flush=True)
                    break
            exit_code = 0
        finally:
            signals.uninstall()
            progress.close()
            self.sink.close(exit_code)
        last = max(losses) if losses else self.start_step
        if rt.is_rank0:
            for line in summary_lines(self._summary(last, losses, val_losses, time.perf_counter() - t_start,
                                                    last_ckpt or self.ckpt.latest_of_run(), stopped_by)):
                print(line, file=sys.stderr, flush=True)
        if stopped_by is None and last == tr.max_steps:
            self._export_hf(last, last_ckpt)  # after the final checkpoint: a failed export loses no training
        elif cfg.checkpoint.export_hf is not None and rt.is_rank0:
            say(f"checkpoint.export_hf: not written, the run stopped at step {last} of {tr.max_steps}")
        return TrainResult(self.start_step, last, losses, val_losses, rt.run_dir, last_ckpt, stopped_by=stopped_by)

    def _export_hf(self, step: int, checkpoint: Optional[str] = None) -> None:
        """``checkpoint.export_hf``: the trained (or resumed) Hugging Face model as a new
        ``from_pretrained`` directory, written by the first data-parallel replica's TP
        group; every rank waits for it."""
        path = self.cfg.checkpoint.export_hf
        if path is None:
            return
        rt, topo = self.rt, self.rt.topology
        ckpt = checkpoint or self.ckpt.latest_of_run()
        next_step = (f"the checkpoint {ckpt} is kept: run the same command with checkpoint.resume=auto to export it"
                     if ckpt is not None else f"no checkpoint holds step {step} (see checkpoint.save_final)")
        export_hf_directory(self.model.model, topo.tp_group if rt.layout.tp > 1 else None, topo.dp_rank == 0, path,
                            next_step=next_step)
        if rt.dist.world_size > 1:
            dist.barrier()
        if rt.is_rank0:
            say(f"exported the model at step {step} as a Hugging Face directory -> {path}")

    def _summary(self, last: int, losses: dict[int, float], val_losses: dict[int, float], wall_s: float,
                 checkpoint: Optional[str], stopped_by: Optional[str]) -> RunSummary:
        """The end-of-run summary's contents (rank 0; tp_fuse.launch.logging.summary)."""
        cfg, meter = self.cfg, self.meter
        mem, mem_what = peak_memory_bytes(self.rt.device)
        ck = cfg.checkpoint
        return RunSummary(
            start_step=self.start_step, last_step=last, max_steps=cfg.trainer.max_steps, losses=losses,
            val_losses=val_losses, wall_s=wall_s, totals=meter.totals(), peak_source=meter.peak.short,
            mfu_note=meter.mfu_withdrawn or (
                "the peak is unknown: " + meter.peak.source.removeprefix("n/a (").removesuffix(")")
                if meter.peak.value is None else None),
            peak_mem_gib=mem / 2**30, mem_what=mem_what, run_dir=self.rt.run_dir, checkpoint=checkpoint,
            checkpoint_hint=f"checkpoint.interval={ck.interval}, checkpoint.save_final={str(ck.save_final).lower()}",
            wandb=self.wandb.summary_line() if self.wandb is not None else None, stopped_by=stopped_by,
            compile=self.compile_stats.line() if self.compile_stats is not None else None,
        )
