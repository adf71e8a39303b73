"""``TransformerLayer``: pre-norm attention block + pre-norm MLP block, both with residuals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist

from tp_fuse.distributed import checkpoint
from tp_fuse.overlap.config import TPOverlap

from ._common import Normalization, ParallelContext, check_fp8_amax_group, dropout_rng, hidden_dropout_stream
from .attention import MaskType, MultiheadAttention
from .config import GPTConfig
from .layernorm_mlp import Activation, LayerNormMLP
from .random import DropoutRNG, TrackerRNG, maybe_fork
from .sharding import normal_init

__all__ = ["ActivationCheckpointing", "LayerSubmodules", "TransformerLayer"]

#: ``"none"``; ``"selective"``: recompute the core attention (softmax(QK^T)V, Megatron's
#: ``recompute_granularity=selective``); ``"full"``: recompute the whole layer.
ActivationCheckpointing = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class LayerSubmodules:
    """Prebuilt blocks of a :class:`TransformerLayer` that return their output bias instead of
    adding it (Megatron's ``skip_bias_add``, Transformer Engine's ``return_bias``), and their
    attribute names (``tp_fuse.te``'s ``TransformerLayer`` passes TE's: ``self_attention``,
    ``layernorm_mlp``, ``layernorm``).

    Contract: ``attention(x, attention_mask, attn_mask_type=, checkpoint_core_attention=)`` and
    ``mlp(h)`` return ``(y, bias)``, and ``(y, bias, norm(input))`` when the layer takes its
    residuals after the norms (``residual_from_norm``; not the attention's with
    ``final_norm``, which has no input norm then); with ``parallel_attention_mlp`` both
    return ``y`` with the bias added. ``final_norm``: applied to the layer's output (None: none).
    """

    attention: torch.nn.Module
    mlp: torch.nn.Module
    final_norm: Optional[torch.nn.Module] = None
    attention_name: str = "attention"
    mlp_name: str = "mlp"
    final_norm_name: str = "final_norm"


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
        rng: dropout streams shared with the model (default: a private one from ``seed``; a
            :class:`~tp_fuse.layers.random.TrackerRNG` draws from a Megatron / TE RNG tracker).
        submodules: prebuilt blocks (:class:`LayerSubmodules`; the arguments that build the
            blocks are then not used). Their biases, dropout (``hidden_dropout``) and
            residuals are added here, Transformer Engine's way: ``h = r1 + drop(a + a_bias)``,
            ``y = r2 + drop(m + m_bias)``, ``r`` each block's input, or with
            ``residual_from_norm`` its normalized input (TE's
            ``apply_residual_connection_post_layernorm``); with ``parallel_attention_mlp``
            ``y = x + drop(attn(x) + mlp(x))``. ``tp_fuse.te.TransformerLayer`` is this layer
            with TE's blocks. Without ``submodules`` the blocks add bias, dropout and residual
            in their last op sequence (where the overlap and bias fusions see them), so those two
            options are refused.
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
        rng: Optional[DropoutRNG | TrackerRNG] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        residual_from_norm: bool = False,
        parallel_attention_mlp: bool = False,
        submodules: Optional[LayerSubmodules] = None,
    ) -> None:
        super().__init__()
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"TransformerLayer: num_layers must be a positive int, got {num_layers!r}")
        if submodules is None and (residual_from_norm or parallel_attention_mlp):
            raise ValueError("TransformerLayer: residual_from_norm and parallel_attention_mlp need prebuilt blocks "
                             "that return their bias (submodules=LayerSubmodules(...)); this layer's own blocks "
                             "add bias, dropout and residual in their last op sequence")
        if parallel_attention_mlp and (residual_from_norm or (submodules is not None and submodules.final_norm)):
            raise ValueError("TransformerLayer: parallel_attention_mlp is not supported together with "
                             "residual_from_norm or a final norm (as in Transformer Engine)")
        if not isinstance(hidden_dropout, (int, float)) or isinstance(hidden_dropout, bool) \
                or not 0.0 <= hidden_dropout < 1.0:
            raise ValueError(f"TransformerLayer: hidden_dropout must be in [0, 1), got {hidden_dropout!r}")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed)
        rng = dropout_rng(ctx, rng)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.rng = rng
        self.activation_checkpointing: ActivationCheckpointing = "none"
        self.hidden_dropout = float(hidden_dropout)
        self.residual_from_norm, self.parallel_attention_mlp = bool(residual_from_norm), bool(parallel_attention_mlp)
        self._hidden_stream = hidden_dropout_stream(ctx)
        if submodules is not None:
            self._names = (submodules.attention_name, submodules.mlp_name, submodules.final_norm_name)
            self.add_module(self._names[0], submodules.attention)
            self.add_module(self._names[1], submodules.mlp)
            if submodules.final_norm is not None:
                self.add_module(self._names[2], submodules.final_norm)
            self._fused_residuals = False
            return
        self._names = ("attention", "mlp", "final_norm")
        self._fused_residuals = True
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

    def set_activation_checkpointing(self, mode: ActivationCheckpointing) -> None:
        """``"none"``, ``"selective"`` (core attention recomputed) or ``"full"`` (the layer)."""
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"activation_checkpointing must be 'none', 'selective' or 'full', got {mode!r}")
        self.activation_checkpointing = mode
        self._modules[self._names[0]].recompute_core_attention = mode == "selective"

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

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                attn_mask_type: Optional[MaskType] = None,
                checkpoint_core_attention: Optional[bool] = None) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]``; the attention arguments as
        :meth:`~tp_fuse.layers.attention.MultiheadAttention.forward`'s."""
        check_fp8_amax_group(self.tp_group, self.sequence_parallel)
        if self.activation_checkpointing == "full" and torch.is_grad_enabled():
            # FP8 scales and dropout streams of the first forward are replayed (tp_fuse.checkpoint).
            return checkpoint(self._forward, x, attention_mask, attn_mask_type, checkpoint_core_attention,
                              modules=[self], get_rng_state_tracker=lambda: self.rng)
        return self._forward(x, attention_mask, attn_mask_type, checkpoint_core_attention)

    def _forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[MaskType],
                 checkpoint_core_attention: Optional[bool]) -> torch.Tensor:
        attention, mlp = self._modules[self._names[0]], self._modules[self._names[1]]
        a = attention(x, attention_mask, attn_mask_type=attn_mask_type,
                      checkpoint_core_attention=checkpoint_core_attention)
        if self._fused_residuals:
            return mlp(a)  # each block adds its bias, dropout and residual
        if self.parallel_attention_mlp:
            return self._bias_dropout_add(a, mlp(x), x)
        h = self._bias_dropout_add(*self._residual(a, x))
        y = self._bias_dropout_add(*self._residual(mlp(h), h))
        final_norm = self._modules.get(self._names[2])
        return y if final_norm is None else final_norm(y)

    def _residual(self, outputs: tuple[torch.Tensor, ...], block_input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A block's ``(y, bias[, norm(input)])`` -> ``(y, bias, residual)``."""
        y, bias = outputs[:2]
        return y, bias, outputs[2] if self.residual_from_norm and len(outputs) == 3 else block_input

    def _bias_dropout_add(self, y: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
        """``residual + dropout(y + bias)`` (an empty bias: a block without one)."""
        if bias is not None and bias.numel() != 0:
            y = y + bias
        with maybe_fork(self.rng, self._hidden_stream, self.training and self.hidden_dropout > 0):
            return residual + torch.nn.functional.dropout(y, p=self.hidden_dropout, training=self.training)
