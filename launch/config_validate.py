"""Cross-field checks of a :class:`tp_fuse.launch.config.TrainConfig` against the world size.

:func:`validate` runs before any process group exists (the world size comes from
torchrun's ``WORLD_SIZE``) and returns the resolved :class:`ParallelLayout`. Every error
is a ``ValueError`` naming the field, the expected and the actual value; files the run
will read (data, overlap and debug YAML, the checkpoint and export directories) are
checked here too, so that a bad one fails before any process starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import torch

from tp_fuse.debug import DebugSession
from tp_fuse.overlap.config import OverlapConfig as TPOverlapConfig

from .checkpoint.hf_export import check_export_target
from .config import MEGATRON_NEEDS_CUDA, ParallelConfig, ParallelLayout, TrainConfig
from .tokenizer import check_tokenizer_choice

__all__ = ["validate"]


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive(name: str, value: int) -> None:
    _need(value > 0, f"{name} must be > 0, got {value}")


def _gpu_missing(device: str) -> Optional[str]:
    """Why ``trainer.device`` gives no GPU here, or None when it does."""
    if device == "cpu":
        return "trainer.device=cpu"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


def _check_cuda_graphs(cfg: TrainConfig, tp: int) -> None:
    """``trainer.cuda_graphs`` and ``optim.capturable``: a GPU, and the features the
    per-layer graphs keep right (each refusal names the field to change)."""
    tr = cfg.trainer
    if cfg.optim.capturable:
        why = _gpu_missing(tr.device)
        _need(why is None, f"optim.capturable=true keeps AdamW's state for CUDA graph capture and needs a GPU "
                           f"({why}); drop optim.capturable")
    if not tr.cuda_graphs:
        return
    why = _gpu_missing(tr.device)
    _need(why is None, f"trainer.cuda_graphs=true records CUDA graphs, which need a GPU ({why}); "
                       f"drop trainer.cuda_graphs")
    gpt = cfg.model.gpt
    refusals = [
        (tr.compile, "trainer.compile=true (torch.compile's own graphs: use trainer.compile_mode instead)"),
        (tr.activation_checkpointing != "none",
         f"trainer.activation_checkpointing={tr.activation_checkpointing} (recompute inside a graph)"),
        (tp > 1, f"parallel.tp={tp} (tensor-parallel collectives inside the layer graphs are not verified yet)"),
        (cfg.parallel.dp_shard > 1, f"parallel.dp_shard={cfg.parallel.dp_shard} (FSDP2 hooks run Python per layer)"),
        (cfg.model.name != "gpt", f"+model={cfg.model.name} (only tp-fuse's GPT layers are graphed)"),
        (gpt.hidden_dropout > 0 or gpt.attention_dropout > 0,
         "model dropout > 0 (tp-fuse's dropout RNG streams are not registered with the graphs)"),
        (cfg.fp8.recipe not in ("none", "delayed", "current"),
         f"fp8={cfg.fp8.recipe} (graphs keep delayed and current scaling static)"),
        (cfg.fp8.recipe != "none" and cfg.fp8.stats, "fp8.stats=true (its observers run Python at every cast, "
                                                      "which a replay skips): add fp8.stats=false"),
        (cfg.fp8.recipe != "none" and cfg.fp8.gemms == "auto", "fp8.gemms=auto (measured in the first forward)"),
        (cfg.debug.config is not None, "debug.config (debug hooks run Python at every cast)"),
    ]
    for refused, what in refusals:
        _need(not refused, f"trainer.cuda_graphs=true does not support {what}")


def validate(cfg: TrainConfig, world_size: int) -> ParallelLayout:
    """Check every cross-field constraint; return the resolved parallel layout.

    Runs before any process group exists. Errors name the field, the expected and
    the actual value.
    """
    _need(world_size >= 1, f"world size must be >= 1, got {world_size}")
    par, gpt, tr = cfg.parallel, cfg.model.gpt, cfg.trainer
    tp = world_size if par.tp == "auto" else par.tp
    _need(tp >= 1, f"parallel.tp must be >= 1 or 'auto', got {tp}")
    _need(world_size % tp == 0, f"parallel.tp ({tp}) must divide the world size ({world_size})")
    dp = world_size // tp
    _need(not (par.sequence_parallel and tp == 1),
          "parallel.sequence_parallel=true needs parallel.tp > 1 (got tp=1): there is no sequence to split")
    if cfg.model.name == "hf":
        # Family plans shard attention and MLP; embeddings and lm_head stay replicated, so
        # the vocabulary need not divide by TP (vocab_size=tp below only skips that check).
        # Every plan gives each rank whole key/value heads (replicating them would break the
        # query-to-KV-head grouping: tp_fuse.layers.wrap.hf_plans._heads_check), so say so in
        # config.json's words here, not after the process group has started.
        _need(gpt.kv_groups % tp == 0,
              f"parallel.tp ({tp}) must divide model.num_query_groups ({gpt.kv_groups}) (num_key_value_heads in "
              f"{cfg.model.path}/config.json): every rank needs whole key/value heads; use a parallel.tp "
              f"that divides {gpt.kv_groups}")
        # alibi: Bloom's ALiBi, built by transformers (tp-fuse's own models refuse it).
        dataclasses.replace(gpt, vocab_size=tp).validate(tp, alibi=True)
    else:
        gpt.validate(tp)  # tp vs heads, query groups, hidden, ffn, vocab -- names the field

    for name in ("max_steps", "log_interval", "global_batch_size", "micro_batch_size"):
        _positive(f"trainer.{name}", getattr(tr, name))
    _need(tr.val_interval >= 0, f"trainer.val_interval must be >= 0 (0 = off), got {tr.val_interval}")
    _need(tr.val_tokens >= 1, f"trainer.val_tokens must be >= 1, got {tr.val_tokens}")
    per_step = tr.micro_batch_size * dp
    _need(tr.global_batch_size % per_step == 0,
          f"trainer.global_batch_size ({tr.global_batch_size}) must be a multiple of "
          f"trainer.micro_batch_size ({tr.micro_batch_size}) * dp ({dp}) = {per_step}")
    _need(-world_size <= tr.fail_rank < world_size,
          f"trainer.fail_rank must be in [-{world_size}, {world_size}), got {tr.fail_rank}")
    # A mode without compiling would be silently ignored: say so instead.
    _need(tr.compile or tr.compile_mode == "default",
          f"trainer.compile_mode={tr.compile_mode} needs trainer.compile=true (it is torch.compile's mode); "
          f"add trainer.compile=true or drop trainer.compile_mode")
    _check_cuda_graphs(cfg, tp)
    if tr.exit_at_step is not None:
        _need(1 <= tr.exit_at_step <= tr.max_steps,
              f"trainer.exit_at_step must be in [1, trainer.max_steps={tr.max_steps}], got {tr.exit_at_step}")
    if tr.fail_at_step is not None:
        _need(1 <= tr.fail_at_step <= tr.max_steps,
              f"trainer.fail_at_step must be in [1, trainer.max_steps={tr.max_steps}], got {tr.fail_at_step}")

    seq = cfg.seq_len
    _need(1 < seq <= gpt.max_seq_len,
          f"data.seq_len ({seq}) must be in [2, model.max_seq_len={gpt.max_seq_len}]")
    _need(0.0 < cfg.data.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.source in ("text", "bin"):
        _need(bool(cfg.data.paths), f"data.paths must list at least one file for data.source={cfg.data.source}")
        _check_data_files(cfg)
    # megatron-core allocates its buffers and RNG states with torch.cuda: say so before start-up.
    if cfg.model.name == "megatron_gpt" and not torch.cuda.is_available():
        _need(cfg.model.spec == "te", MEGATRON_NEEDS_CUDA)
        _need(gpt.position_embedding == "learned", "+model=megatron_gpt model.spec=te on CPU needs "
              "model.position_embedding=learned (megatron-core's RoPE allocates on torch.cuda)")
        _need(not par.sequence_parallel, "+model=megatron_gpt model.spec=te on CPU needs "
              "parallel.sequence_parallel=false (megatron-core's SP collectives allocate on torch.cuda)")
    if cfg.model.name == "hf":  # tokenized with the model directory's tokenizer.json; no SP for [b, s, h] models
        _need(not par.sequence_parallel, "parallel.sequence_parallel=true does not apply to +model=hf "
              "(Hugging Face activations are [batch, seq, hidden])")
    else:
        check_tokenizer_choice(cfg.data.tokenizer, cfg.data.source, gpt.vocab_size)  # vs model.vocab_size
    if par.sequence_parallel:
        _need(seq % tp == 0, f"data.seq_len ({seq}) must be divisible by parallel.tp ({tp}) with sequence parallel")

    _need(math.isfinite(par.timeout_s) and par.timeout_s > 0,
          f"parallel.timeout_s must be a finite number > 0, got {par.timeout_s}")
    _need(tr.max_nonfinite_steps >= 0, f"trainer.max_nonfinite_steps must be >= 0, got {tr.max_nonfinite_steps}")
    if isinstance(tr.peak_flops, float):
        _need(math.isfinite(tr.peak_flops) and tr.peak_flops > 0,
              f"trainer.peak_flops must be a finite number of FLOP/s > 0 (one rank's peak, e.g. 989e12), "
              f"'remeasure' or null, got {tr.peak_flops}")

    opt = cfg.optim
    for name in ("lr", "min_lr", "weight_decay", "eps", "grad_clip", "beta1", "beta2"):
        v = getattr(opt, name)
        _need(math.isfinite(v), f"optim.{name} must be a finite number, got {v}")
    _need(opt.lr > 0, f"optim.lr must be > 0, got {opt.lr}")
    _need(opt.eps > 0, f"optim.eps must be > 0, got {opt.eps}")
    _need(opt.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {opt.weight_decay}")
    _need(0 <= opt.min_lr <= opt.lr, f"optim.min_lr must be in [0, optim.lr={opt.lr}], got {opt.min_lr}")
    _need(opt.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {opt.warmup_steps}")
    _need(opt.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 = off), got {opt.grad_clip}")
    for name in ("beta1", "beta2"):
        v = getattr(opt, name)
        _need(0.0 <= v < 1.0, f"optim.{name} must be in [0, 1), got {v}")

    fp8 = cfg.fp8
    if fp8.enabled:
        _need(fp8.margin >= 0, f"fp8.margin must be >= 0, got {fp8.margin}")
        _need(fp8.amax_history_len >= 1, f"fp8.amax_history_len must be >= 1, got {fp8.amax_history_len}")
        _check_fp8_dims(cfg, tp)
        block = {"blockwise": 128, "mxfp8": 32, "nvfp4": 16}.get(fp8.recipe)
        if block is not None and cfg.overlap.enabled and par.sequence_parallel and tp > 1:
            # The overlapped all-gathers move each rank's rows with their block scales; the
            # wgrad copy has blocks along those rows, so a block must not straddle two ranks.
            local = cfg.trainer.micro_batch_size * seq // tp
            _need(local % block == 0,
                  f"fp8.recipe={fp8.recipe} with overlap and sequence parallel needs the rows per TP rank "
                  f"(trainer.micro_batch_size * data.seq_len / parallel.tp = {local}) to be a multiple of "
                  f"the {block}-row block of the column-wise copy")

    ck = cfg.checkpoint
    _need(ck.interval >= 0, f"checkpoint.interval must be >= 0 (0 = off), got {ck.interval}")
    _need(ck.keep >= 1, f"checkpoint.keep must be >= 1, got {ck.keep}")
    if ck.dir is not None:
        _check_writable_dir("checkpoint.dir", ck.dir)

    dp_shard, dp_replicate = _check_dp_split(par, dp)
    if ck.export_hf is not None:
        _need(cfg.model.name == "hf", f"checkpoint.export_hf writes a Hugging Face directory: it needs +model=hf "
                                      f"(model.name is {cfg.model.name!r})")
        _need(dp_shard == 1, f"checkpoint.export_hf needs parallel.dp_shard=1 (got {dp_shard}): resume the "
                             f"checkpoint with dp_shard=1 to export it (checkpoints reshard on load)")
        check_export_target(ck.export_hf)  # not there, no partial export beside it, creatable

    if cfg.overlap.enabled:
        _need(tp > 1, "overlap=on needs parallel.tp > 1 (got tp=1): there is no TP communication to overlap")
        if cfg.overlap.config is not None:
            _check_overlap_yaml(cfg.overlap.config)
    if cfg.debug.config is not None:
        _check_debug_config(cfg)
    return ParallelLayout(world_size=world_size, tp=tp, dp=dp, grad_accum_steps=tr.global_batch_size // per_step,
                          dp_shard=dp_shard, dp_replicate=dp_replicate)


def _check_dp_split(par: ParallelConfig, dp: int) -> tuple[int, int]:
    """``(dp_shard, dp_replicate)`` with ``dp_shard * dp_replicate == dp`` (the DP size)."""
    _need(par.dp_shard >= 1, f"parallel.dp_shard must be >= 1, got {par.dp_shard}")
    _need(dp % par.dp_shard == 0,
          f"parallel.dp_shard ({par.dp_shard}) must divide the data-parallel size ({dp} = world size / parallel.tp)")
    replicate = dp // par.dp_shard if par.dp_replicate == "auto" else par.dp_replicate
    _need(replicate >= 1, f"parallel.dp_replicate must be >= 1 or 'auto', got {par.dp_replicate}")
    _need(replicate * par.dp_shard == dp,
          f"parallel.dp_replicate ({replicate}) x parallel.dp_shard ({par.dp_shard}) must equal the data-parallel "
          f"size ({dp} = world size / parallel.tp)")
    return par.dp_shard, replicate


def _check_data_files(cfg: TrainConfig) -> None:
    """Every data file exists, is readable and non-empty, and together they hold enough
    tokens for one training and one validation window (checked from file sizes)."""
    data, seq = cfg.data, cfg.seq_len
    itemsize = {"uint16": 2, "uint32": 4}[data.bin_dtype] if data.source == "bin" else 1
    tokens = 0
    for i, path in enumerate(data.paths):
        field_name = f"data.paths[{i}]"
        _need(os.path.exists(path), f"{field_name}: no such file: {path!r}")
        _need(os.path.isfile(path), f"{field_name}: {path!r} is not a file")
        _need(os.access(path, os.R_OK), f"{field_name}: {path!r} is not readable (permissions)")
        size = os.path.getsize(path)
        _need(size > 0, f"{field_name}: {path!r} is empty")
        _need(size % itemsize == 0,
              f"{field_name}: {path!r} has {size} bytes, not a multiple of {itemsize} "
              f"(data.bin_dtype={data.bin_dtype}); wrong dtype?")
        tokens += size // itemsize
    if data.source == "text":
        tokens += 2 * (len(data.paths) - 1)  # files are joined with a blank line
    n_val = max(int(tokens * data.val_fraction), seq + 1)
    _need(tokens - n_val >= 2 * (seq + 1),
          f"data.paths: the corpus has {tokens} tokens; data.seq_len={seq} with data.val_fraction="
          f"{data.val_fraction} needs at least {n_val + 2 * (seq + 1)}")


def _check_writable_dir(name: str, path: str) -> None:
    """``path`` is a writable directory, or can be created as one."""
    path = os.path.abspath(path)
    _need(not os.path.exists(path) or os.path.isdir(path), f"{name}: {path} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    _need(os.path.isdir(parent), f"{name}: {path} cannot be created: {parent} is not a directory")
    _need(os.access(parent, os.W_OK | os.X_OK),
          f"{name}: {path} is not writable ({parent} does not allow writing for this user)")


def _check_overlap_yaml(path: str) -> None:
    """Parse the Megatron overlap YAML now: a bad file fails before any process starts."""
    _need(os.path.exists(path), f"overlap.config: no such file: {path!r}")  # a FIFO: from_yaml names it
    try:
        TPOverlapConfig.from_yaml(path, warn_ignored=False)
    except ValueError as exc:
        raise ValueError(f"overlap.config={path}: {exc}") from None


def _check_debug_config(cfg: TrainConfig) -> None:
    """Parse the debug feature YAML now (every key, feature and option is checked);
    only matching layer names has to wait for the model."""

    try:
        session = DebugSession(cfg.debug.config)
    except ValueError as exc:
        raise ValueError(f"debug.config={cfg.debug.config}: {exc}") from exc
    _need(not ("LogFp8TensorStats" in session.feature_names() and not cfg.fp8.enabled),
          f"debug.config={cfg.debug.config} enables LogFp8TensorStats, which needs FP8: "
          "use fp8=delayed or fp8=current")


def _check_fp8_dims(cfg: TrainConfig, tp: int) -> None:
    """FP8 GEMMs (``torch._scaled_mm`` on CUDA) need every GEMM dimension % 16 == 0.

    Checked on CPU too, so that a config that trains here also runs on a GPU.
    The dimensions are per TP rank: hidden and FFN shards, the QKV output shard, and
    the token count of a micro-batch (the K dimension of the wgrad GEMM).
    """
    gpt = cfg.model.gpt
    head_dim = gpt.head_dim
    qkv = (gpt.num_heads + 2 * gpt.kv_groups) * head_dim
    tokens = cfg.trainer.micro_batch_size * cfg.seq_len
    dims = {
        "model.hidden_size": gpt.hidden_size,
        "model.ffn_hidden_size (effective)": gpt.ffn_size,
        "model.hidden_size / parallel.tp": gpt.hidden_size // tp,
        "model.ffn_hidden_size / parallel.tp": gpt.ffn_size // tp,
        "QKV output size / parallel.tp ((num_heads + 2*num_query_groups) * head_dim / tp)": qkv // tp,
        "trainer.micro_batch_size * data.seq_len (tokens per micro-batch)": tokens,
    }
    if gpt.activation == "swiglu":
        dims["2 * model.ffn_hidden_size / parallel.tp (SwiGLU fc1 output)"] = 2 * gpt.ffn_size // tp
    for name, value in dims.items():
        _need(value % 16 == 0,
              f"fp8.recipe={cfg.fp8.recipe} needs GEMM dimensions divisible by 16: {name} = {value}")
