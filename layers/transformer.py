"""``TransformerLayer``: pre-norm attention block + pre-norm MLP block, both with residuals."""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.distributed as dist

from tp_fuse.distributed import checkpoint
from tp_fuse.overlap.config import TPOverlap

from ._common import Normalization, ParallelContext, check_fp8_amax_group, dropout_rng
from .attention import MultiheadAttention
from .config import GPTConfig
from .layernorm_mlp import Activation, LayerNormMLP
from .random import DropoutRNG
from .sharding import normal_init

__all__ = ["ActivationCheckpointing", "TransformerLayer"]

#: ``"none"``; ``"selective"``: recompute the core attention (softmax(QK^T)V, Megatron's
#: ``recompute_granularity=selective``); ``"full"``: recompute the whole layer.
ActivationCheckpointing = Literal["none", "selective", "full"]


class TransformerLayer(torch.nn.Module):
    """GPT block: ``h = x + attn(norm1(x))``; ``y = h + mlp(norm2(h))`` (dropout before each add).

    Each half is one :class:`~tp_fuse.layers.attention.MultiheadAttention` /
    :class:`~tp_fuse.layers.layernorm_mlp.LayerNormMLP` with ``residual_connection=True``: the
    residual leaves the first ``Sequential`` of the block through ``MakeExtraOutput``
    and re-enters the last one through ``AddExtraInput``. With sequence parallelism the
    TP blocks are ``[norm, AllGather, Linear] ... [Linear, ReduceScatter, Bias, Dropout,
    AddExtraInput]``; without it ``[norm, Copy, Linear] ... [Linear, AllReduce, ...]``.

    Shapes: ``x, y [s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).

    Args:
        hidden_size, ffn_hidden_size, num_heads: global sizes.
        num_query_groups: grouped-query attention groups (None: ``num_heads``).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (both norms of the block).
        activation: ``"gelu"`` or ``"swiglu"``.
        position_embedding: ``"rope"`` (in attention) or ``"none"``.
        init_std: std of the N(0, std^2) init of qkv/fc1; proj/fc2 use
            ``init_std / sqrt(2 * num_layers)`` (GPT-2 / Megatron scaled init).
        num_layers: depth of the model, for the scaled init.
        rng: dropout streams shared with the model (default: a private one from ``seed``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_heads: int,
        *,
        num_query_groups: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        normalization: Normalization = "LayerNorm",
        eps: float = 1e-5,
        activation: Activation = "gelu",
        bias: bool = True,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        position_embedding: Literal["rope", "none"] = "none",
        rope_theta: float = 10000.0,
        init_std: float = 0.02,
        num_layers: int = 1,
        seed: Optional[int] = 0,
        overlap: Optional[TPOverlap] = None,
        rng: Optional[DropoutRNG] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"TransformerLayer: num_layers must be a positive int, got {num_layers!r}")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed)
        rng = dropout_rng(ctx, rng)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        init = normal_init(init_std)
        output_init = normal_init(init_std / math.sqrt(2.0 * num_layers))
        common = dict(tp_group=tp_group, sequence_parallel=sequence_parallel, normalization=normalization,
                      eps=eps, bias=bias, residual_connection=True, hidden_dropout=hidden_dropout,
                      init_method=init, output_init_method=output_init, overlap=overlap, rng=rng,
                      dtype=dtype, device=device)
        self.attention = MultiheadAttention(
            hidden_size, num_heads, num_query_groups=num_query_groups, attention_dropout=attention_dropout,
            position_embedding=position_embedding, rope_theta=rope_theta, seed=ctx.child("attention").seed,
            **common,
        )
        self.mlp = LayerNormMLP(hidden_size, ffn_hidden_size, activation=activation,
                                seed=ctx.child("mlp").seed, **common)
        self.rng = rng
        self.activation_checkpointing: ActivationCheckpointing = "none"

    def set_activation_checkpointing(self, mode: ActivationCheckpointing) -> None:
        """``"none"``, ``"selective"`` (core attention recomputed) or ``"full"`` (the layer)."""
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"activation_checkpointing must be 'none', 'selective' or 'full', got {mode!r}")
        self.activation_checkpointing = mode
        self.attention.recompute_core_attention = mode == "selective"

    @classmethod
    def from_config(
        cls,
        config: GPTConfig,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        seed: Optional[int] = 0,
        overlap: Optional[TPOverlap] = None,
        rng: Optional[DropoutRNG] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> "TransformerLayer":
        """A layer with the architecture of ``config`` (one of its ``num_layers`` blocks)."""
        return cls(
            config.hidden_size, config.ffn_size, config.num_heads,
            num_query_groups=config.num_query_groups, tp_group=tp_group, sequence_parallel=sequence_parallel,
            normalization=config.normalization, eps=config.layernorm_eps, activation=config.activation,
            bias=config.bias, hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
            position_embedding="rope" if config.position_embedding == "rope" else "none",
            rope_theta=config.rope_theta, init_std=config.init_std, num_layers=config.num_layers,
            seed=seed, overlap=overlap, rng=rng, dtype=dtype, device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_fp8_amax_group(self.tp_group, self.sequence_parallel)
        if self.activation_checkpointing == "full" and torch.is_grad_enabled():
            # FP8 scales and dropout streams of the first forward are replayed (tp_fuse.checkpoint).
            return checkpoint(self._forward, x, modules=[self], get_rng_state_tracker=lambda: self.rng)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x))
