"""``GPT``: vocab-parallel embedding, N TransformerLayers, final norm, vocab-parallel output and loss.

This is the model the launcher builds (``launch/``): ``GPT(config, tp_group=...,
sequence_parallel=..., dtype=..., device=..., seed=..., overlap=...)``; the training loop
calls ``loss = model(tokens, labels)`` inside ``tp_fuse.autocast(...)`` when FP8 is on
(one autocast around the whole forward gives one amax all-reduce per direction per step
for all layers together).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.ops import BasicLinear, Sequential
from tp_fuse.overlap.config import TPOverlap
from tp_fuse.quantization import active_autocast, autocast

from ._common import (
    ParallelContext,
    check_fp8_amax_group,
    column_input_comm,
    full_init,
    hidden_dropout_stream,
    linear_op,
    norm_op,
)
from .config import GPTConfig
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import PositionEmbedding, VocabParallelEmbedding
from .random import DropoutRNG, maybe_fork
from .sharding import ShardSpec, normal_init
from .transformer import TransformerLayer

__all__ = ["GPT"]


class GPT(torch.nn.Module):
    """Decoder-only transformer, tensor-parallel over ``tp_group``.

    Data flow (``s`` sequence, ``b`` batch, ``h`` hidden, ``V`` vocab, ``tp`` TP size)::

        tokens [b, s] -> transpose -> [s, b]
        VocabParallelEmbedding        -> [s, b, h]  (all-reduce) | [s/tp, b, h] (SP: reduce-scatter)
        + learned positions (if any), dropout
        N x TransformerLayer          -> same shape
        final norm                    -> same shape
        output layer [AllGather (SP) | Copy, BasicLinear(V/tp x h)]  -> logits [s, b, V/tp]
        vocab-parallel cross-entropy  -> scalar loss (mean over tokens, same on all TP ranks)

    The output layer's weight is the embedding table when ``config.tie_embeddings``
    (one Parameter, used twice). The embedding and output layer run in high precision
    even inside ``tp_fuse.autocast`` (FP8 logits hurt accuracy; Transformer Engine and
    Megatron keep them in BF16/FP32 too).

    Initialization is independent of the TP size: every parameter's full (TP=1) tensor
    is drawn from a seed derived from ``seed`` and the parameter's name, then sliced, so
    a TP=2 model is exactly the TP=1 model split in two (see ``tp_fuse.layers.sharding``).

    Args:
        config: architecture (global sizes); validated against the TP size (ValueError
            naming the field).
        tp_group: TP process group (None: no tensor parallelism).
        sequence_parallel: split activations outside the TP blocks along the sequence.
        dtype, device: parameter dtype and device.
        seed: initialization seed.
        overlap: communication-overlap configuration, handed to every comm op
            (``overlap=``), the one carrier of a window's overlap settings.
        dropout_seed: seed of the dropout streams (default ``seed``); give each
            data-parallel replica its own if their masks should differ.
        ignore_index: label value excluded from the loss.
    """

    def __init__(
        self,
        config: GPTConfig,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        seed: int = 0,
        overlap: Optional[TPOverlap] = None,
        dropout_seed: Optional[int] = None,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"GPT: config must be a tp_fuse.layers.GPTConfig, got {type(config).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"GPT: seed must be an int, got {seed!r}")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed)
        config.validate(ctx.tp_size)
        self.config = config
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = ctx.tp_size, ctx.tp_rank
        self.sequence_parallel = sequence_parallel
        self.ignore_index = ignore_index
        self.dropout_rng = DropoutRNG(seed if dropout_seed is None else dropout_seed, ctx.tp_rank, ctx.device)
        self._hidden_stream = hidden_dropout_stream(ctx)
        init = normal_init(config.init_std)

        self.embedding = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_group=tp_group, sequence_parallel=sequence_parallel,
            init_method=init, seed=ctx.child("embedding.word").seed, dtype=dtype, device=device,
        )
        self.position: Optional[PositionEmbedding] = None
        if config.position_embedding == "learned":
            self.position = PositionEmbedding(
                config.max_seq_len, config.hidden_size, tp_group=tp_group, sequence_parallel=sequence_parallel,
                init_method=init, seed=ctx.child("embedding.position").seed, dtype=dtype, device=device,
            )
        self.layers = torch.nn.ModuleList(
            TransformerLayer.from_config(
                config, tp_group=tp_group, sequence_parallel=sequence_parallel,
                seed=ctx.child(f"layers.{i}").seed, overlap=overlap, rng=self.dropout_rng,
                dtype=dtype, device=device,
            )
            for i in range(config.num_layers)
        )
        self.final_norm = norm_op(ctx, config.normalization, config.hidden_size, config.layernorm_eps)

        out_ctx = ctx.child("output")
        comm = column_input_comm(out_ctx)
        full = full_init(out_ctx, (config.vocab_size, config.hidden_size), "weight", init)
        linear: BasicLinear = linear_op(out_ctx, full, ShardSpec(dim=0), None)
        if config.tie_embeddings:
            # One Parameter in two places: both uses accumulate into the same .grad.
            linear.weight = self.embedding.weight
        self.output = Sequential(OrderedDict([*comm.items(), ("linear", linear)]))

    def set_activation_checkpointing(self, mode: str) -> None:
        """Activation recompute for every TransformerLayer: ``"none"``, ``"selective"``
        (core attention, Megatron's selective granularity) or ``"full"`` (whole layers).
        Under FP8 the recompute replays the first forward's scales (``tp_fuse.checkpoint``)."""
        for layer in self.layers:
            layer.set_activation_checkpointing(mode)

    @property
    def output_weight(self) -> torch.nn.Parameter:
        return self.output.linear.weight

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``[s, b, h]`` (``[s/tp, b, h]`` under SP) for ``tokens [b, s]``."""
        if tokens.dim() != 2:
            raise ValueError(f"GPT: tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        b, s = tokens.shape
        check_fp8_amax_group(self.tp_group, self.sequence_parallel)
        if s > self.config.max_seq_len:
            raise ValueError(f"GPT: sequence length {s} exceeds model.max_seq_len ({self.config.max_seq_len})")
        if self.sequence_parallel and s % self.tp_size != 0:
            raise ValueError(f"GPT: with sequence parallelism the sequence length ({s}) must be divisible "
                             f"by the tensor-parallel size ({self.tp_size})")
        with _high_precision():
            x = self.embedding(tokens.t())  # [s, b] -> [s(/tp), b, h]
            if self.position is not None:
                x = self.position(x, s)
        p = self.config.hidden_dropout
        with maybe_fork(self.dropout_rng, self._hidden_stream, self.training and p > 0):
            x = F.dropout(x, p, self.training)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Loss (scalar, mean over non-ignored tokens) if ``labels [b, s]`` is given, else
        this rank's vocab-parallel logits ``[s, b, V/tp]``."""
        x = self.hidden_states(tokens)
        with _high_precision():
            logits = self.output(x)  # [s, b, V/tp]
        if labels is None:
            return logits
        if labels.shape != tokens.shape:
            raise ValueError(f"GPT: labels shape {tuple(labels.shape)} must equal tokens shape {tuple(tokens.shape)}")
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group if self.tp_size > 1 else None,
                                            ignore_index=self.ignore_index)


def _high_precision() -> contextlib.AbstractContextManager:
    """Turn FP8 off inside an enclosing ``tp_fuse.autocast`` (joins its state, adds no collective)."""
    state = active_autocast()
    if state is None:
        return contextlib.nullcontext()
    return autocast(enabled=False, recipe=state.recipe, amax_reduction_group=state.amax_reduction_group)
