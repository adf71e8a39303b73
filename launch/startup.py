"""What the trainer does and says once, before the first step.

* :func:`presize_overlap_buffers` -- with comm/GEMM overlap and FP8, training moves FP8
  bytes (1 per element) through the overlap workspaces, and validation (high precision)
  needs 4x larger forward workspaces: every validation used to grow them, with a
  ``UserBufferPool`` warning per buffer and rank. One high-precision forward pass of a
  training micro-batch at start-up (no gradients, eval mode, debug features paused, no
  FP8 statistics) registers every forward workspace at its largest size, computed by the
  same code that uses it. It changes no state: no parameter, optimizer, FP8 scale, RNG
  stream or data position (resumed runs still repeat uninterrupted ones exactly).
* :func:`announce` -- which GEMMs run FP8 (``fp8.gemms``; with ``auto`` the choices per
  shape follow after the first step, :func:`fp8_gemm_choice_lines`), parameter counts,
  the resolved configuration, the validation set,
  the MFU formula and peak (and where the peak comes from: ``tp_fuse.launch.logging.peak``),
  and the W&B mode, printed by rank 0; returns the
  :class:`tp_fuse.launch.logging.report.StepMeter` for the log lines.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Optional

import torch
import yaml

from tp_fuse.debug import name_linears
from tp_fuse.quantization.gemm_choice import decision_of

from .config import TrainConfig
from .data import BatchLoader
from .models.hf_config import attention_head_dim, moe_note
from .logging.report import PeakFlops, StepMeter, count_parameters, flops_per_token
from .runtime import Runtime

__all__ = ["announce", "fp8_gemm_choice_lines", "fp8_gemms_line", "presize_overlap_buffers", "say"]


def say(text: str) -> None:
    """One ``[tp-fuse]`` line on stderr (callers print on rank 0 only)."""
    print(f"[tp-fuse] {text}", file=sys.stderr, flush=True)


@torch.no_grad()
def presize_overlap_buffers(cfg: TrainConfig, model: torch.nn.Module, loader: BatchLoader,
                            fp8_stats: Any = None, debug: Any = None) -> bool:
    """Register the overlap workspaces at their high-precision size (see module docstring).

    Returns True if it ran (overlap and FP8 on), False otherwise.
    """
    if not (cfg.overlap.enabled and cfg.fp8.enabled):
        return False
    tokens, labels = loader.micro_batch(0)  # reads data only: the loader's position is unchanged
    was_active = getattr(fp8_stats, "active", None)
    if fp8_stats is not None:
        fp8_stats.active = False
    paused = debug.paused() if debug is not None else contextlib.nullcontext()
    model.eval()
    try:
        with paused:
            model(tokens, labels)
    finally:
        model.train()
        if fp8_stats is not None:
            fp8_stats.active = was_active
    return True


def fp8_gemms_line(cfg: TrainConfig, device: torch.device) -> Optional[str]:
    """The start-up line saying which GEMMs run FP8 (None with ``fp8=none``)."""
    if not cfg.fp8.enabled:
        return None
    gemms = cfg.fp8.gemms_on(device.type)
    setting = f"fp8.gemms={gemms}" if cfg.fp8.gemms == gemms else f"fp8.gemms=device: {gemms} on {device.type}"
    if gemms == "all":
        return (f"FP8 GEMMs ({setting}): every Linear's forward, dgrad and wgrad GEMMs run {cfg.fp8.recipe} FP8 "
                "(fp8.gemms=auto: only where FP8 is faster at the shape)")
    how = ("measured once per shape at the first step (CUDA events, casts included), torchao's tensorwise rule "
           "as the prior" if device.type == "cuda" else
           f"torchao's tensorwise rule (the prior: nothing is measured on {device.type}, it has no FP8 hardware)")
    return (f"FP8 GEMMs ({setting}): each Linear's GEMMs run {cfg.fp8.recipe} FP8 only where FP8 is faster "
            f"at its shape, else in high precision; decided by {how}; the choices follow after the first step")


def fp8_gemm_choice_lines(model: torch.nn.Module) -> list[str]:
    """What ``fp8.gemms=auto`` chose, after the first step: a summary line, then one line per
    decision (shape, precision, why) naming the Linears that took it."""
    groups: dict[Any, list[str]] = {}
    total = 0
    for name in name_linears(model):
        d = decision_of(name.op)
        if d is None:
            continue
        total += 1
        groups.setdefault(d, []).append(name.layer_name)
    fp8 = sum(len(names) for d, names in groups.items() if d.fp8)
    lines = [f"FP8 GEMMs chosen (fp8.gemms=auto): FP8 for {fp8} of {total} Linears, high precision for {total - fp8}"]
    for d, names in groups.items():
        lines.append(f"  {d.describe()}: {', '.join(names)}")
    return lines


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _fmt_params(n: int) -> str:
    """``124.44M (exactly 124,439,808)``; small counts are exact already: ``842,496``."""
    short = _fmt_count(n)
    return short if short == f"{n:,}" else f"{short} (exactly {n:,})"


def model_flops_per_token(cfg: TrainConfig) -> float:
    """The FLOP/token of the MFU line (``flops_per_token``); for ``+model=hf`` with the
    attention head width the model has (config.json's ``head_dim``: Gemma, Qwen3), which
    need not be hidden / heads."""
    head_dim = None
    if cfg.model.name == "hf":
        head_dim = attention_head_dim(cfg.model.path)
    return flops_per_token(cfg.model.gpt, cfg.seq_len, head_dim)


def announce(cfg: TrainConfig, rt: Runtime, model: torch.nn.Module, loader: BatchLoader,
             start_step: int, wandb_line: Optional[str], tokenizer: Any = None) -> StepMeter:
    """Print the start-of-run report on rank 0 (collectives on every rank); the step meter."""
    topo = rt.topology
    total, per_rank = count_parameters(model, topo.tp_group if rt.layout.tp > 1 else None, rt.layout.tp)
    # torchrun's LOCAL_WORLD_SIZE: the ranks sharing this machine's cores (the CPU peak's cache key).
    peak = PeakFlops.detect(rt.device, rt.dtype, topo.world_group, rt.layout.world_size,
                            user_peak=cfg.trainer.peak_flops,
                            ranks_on_machine=int(os.environ.get("LOCAL_WORLD_SIZE", rt.layout.world_size)),
                            local_rank=int(os.environ.get("LOCAL_RANK", rt.rank)))
    fpt = model_flops_per_token(cfg)
    tokens_per_step = cfg.trainer.global_batch_size * cfg.seq_len
    if rt.is_rank0:
        print("[tp-fuse] resolved config:\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
              file=sys.stderr, flush=True)
        gemms = fp8_gemms_line(cfg, rt.device)
        if gemms is not None:
            say(gemms)
        say(f"parameters: {_fmt_params(total)} in the model, {_fmt_params(per_rank)} on each rank "
            f"(layout TP={rt.layout.tp} x DP={rt.layout.dp}: tensor-parallel weights are split over the TP ranks)")
        if tokenizer is not None:
            say(f"tokenizer: {tokenizer.name}, {tokenizer.vocab_size:,} tokens for model.vocab_size="
                f"{cfg.model.gpt.vocab_size:,}; corpus {loader.data.train.numel() + loader.data.val.numel():,} tokens")
        n_val = loader.val_windows(cfg.trainer.val_tokens)
        say(f"validation set: {n_val} sequences x {cfg.seq_len} tokens = {n_val * cfg.seq_len:,} tokens "
            f"(trainer.val_tokens={cfg.trainer.val_tokens}, validation split {loader.data.val.numel():,} tokens), "
            "the same for every layout")
        say(f"MFU = tokens/s x {fpt / 1e6:.2f} MFLOP/token / peak; FLOP/token = 6 x GEMM weights "
            "(L x (qkv+proj+fc1+fc2) + vocab x hidden) + 12 x L x heads x head_dim x seq_len; "
            f"peak = {peak.source}")
        if cfg.model.name == "hf":
            note = moe_note(cfg.model.path)  # the routed experts: what FLOP/token and the sharding do with them
            if note:
                say(note)
        if wandb_line:
            say(wandb_line)
    return StepMeter(tokens_per_step, fpt, peak, cfg.trainer.max_steps, start_step, say if rt.is_rank0 else None)
