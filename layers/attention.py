"""Tensor-parallel self-attention: fused QKV, heads sharded over TP, GQA, causal SDPA, RoPE."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.distributed import checkpoint
from tp_fuse.ops import AddExtraInput, BasicOperation, Dropout, Sequential
from tp_fuse.overlap.config import TPOverlap

from ._common import (
    InitMethod,
    Normalization,
    ParallelContext,
    column_parallel_ops,
    dropout_rng,
    hidden_dropout_stream,
    row_parallel_ops,
)
from .layernorm_linear import LayerNormLinear
from .random import DropoutRNG, TrackerRNG, maybe_fork
from .rope import RotaryEmbedding, apply_rotary
from .sharding import divide, normal_init
from tp_fuse.ops import MakeExtraOutput

__all__ = ["AttentionSubmodules", "DotProductAttention", "MASK_TYPES", "MaskType", "MultiheadAttention"]

#: ``"causal"``: query ``i`` sees keys ``0..i`` (``"causal_bottom_right"``, Transformer Engine's
#: name, is the same mask in self-attention: the query and key lengths are equal);
#: ``"no_mask"``; ``"arbitrary"``: ``forward``'s ``attention_mask`` (bool, ``True`` = masked
#: out, TE's convention).
MaskType = Literal["causal", "causal_bottom_right", "no_mask", "arbitrary"]
MASK_TYPES = ("causal", "causal_bottom_right", "no_mask", "arbitrary")


@dataclass(frozen=True)
class AttentionSubmodules:
    """Prebuilt QKV and output projections of a :class:`MultiheadAttention`, and the attribute
    names of its three submodules (``tp_fuse.te``'s ``MultiheadAttention`` passes Transformer
    Engine's modules and names: ``layernorm_qkv`` / ``qkv``, ``core_attention``, ``proj``).

    Contract: ``qkv(x)`` returns this rank's ``[s, b, qkv features]`` (with the block's
    ``return_layernorm_output`` a pair ``(qkv, norm(x))``); ``proj(context)`` returns ``y`` or
    a tuple starting with ``y`` (TE's ``return_bias``: ``(y, bias)``), returned as is.
    """

    qkv: torch.nn.Module
    proj: torch.nn.Module
    qkv_name: str = "qkv"
    core_name: str = "core"


class DotProductAttention(torch.nn.Module):
    """Causal scaled-dot-product attention over this rank's heads (no parameters).

    Shapes: ``q [s, b, n, d]``, ``k, v [s, b, g, d]`` with ``n`` query heads and ``g``
    key/value groups (``n % g == 0``; query head ``i`` uses group ``i // (n/g)``, as
    Megatron-LM's grouped-query attention) -> ``out [s, b, n*d]``.

    Equation: ``out = softmax(q k^T * scale + mask) v`` per head (``scale``: ``softmax_scale``,
    default ``1/sqrt(d)``; ``k``/``v`` may have their own sequence length and ``v`` its own
    head size ``dv``, then ``out [s, b, n*dv]``), via
    ``torch.nn.functional.scaled_dot_product_attention`` (which picks a fused kernel
    where one exists); dropout on the attention probabilities in training.

    The mask, per call: ``causal=True`` (the default; query ``i`` sees keys ``0..i``),
    ``causal=False`` (no mask), or ``causal=False`` with ``mask``: a boolean tensor
    broadcastable to ``[b, n, s, s]`` in Transformer Engine's convention (``True`` = that
    key is masked out). ``tp_fuse.MultiheadAttention`` (TE's) uses the same class.
    """

    def __init__(self, attention_dropout: float = 0.0, softmax_scale: Optional[float] = None) -> None:
        super().__init__()
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                          or softmax_scale <= 0):
            raise ValueError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
        self.attention_dropout = float(attention_dropout)
        # None: SDPA's 1/sqrt(d).
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        s, b, n, _ = q.shape
        g, dv = k.shape[2], v.shape[3]
        if mask is not None:
            if causal:
                raise ValueError("DotProductAttention: mask is only used with causal=False")
            if mask.dtype != torch.bool:
                raise ValueError(f"DotProductAttention: mask must be a bool tensor, got {mask.dtype}")
            mask = ~mask  # SDPA's boolean mask marks the positions that take part
        # SDPA wants heads before the sequence: [s, b, heads, d] -> [b, heads, s, d].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=g != n,
        )  # [b, n, s, dv]
        return out.permute(2, 0, 1, 3).reshape(s, b, n * dv)  # [s, b, n*dv]


class MultiheadAttention(torch.nn.Module):
    """Pre-norm multi-head (or grouped-query) self-attention, heads sharded over TP.

    Blocks (op names in parentheses)::

        qkv:  LayerNormLinear [MakeExtraOutput (residual)?, norm, AllGather (SP) |
              CopyToTensorParallelRegion (comm), BasicLinear (linear), Bias (bias)?]
              -- or without ``input_layernorm`` just [comm, linear, bias]
        core: RoPE (optional) + DotProductAttention on this rank's heads
        proj: [BasicLinear (linear), ReduceScatter (SP) | AllReduce (comm), Bias (bias)?,
              Dropout (dropout)?, AddExtraInput (residual)?]

    Fused QKV layout (Megatron-LM): the TP=1 weight's rows are ``g`` groups, each
    ``[q heads of the group (n/g of them), k, v] x d`` rows, so a contiguous row slice
    holds whole groups and TP shards are plain slices of the TP=1 weight.

    Shapes (``tp`` = TP size, ``n`` heads, ``g`` = ``num_query_groups``, ``d`` head dim):
        x, y: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)
        qkv weight: ``[g/tp * (n/g + 2) * d, h]``; proj weight: ``[h, n/tp * d]``

    Args:
        hidden_size, num_heads: global sizes; ``tp`` must divide ``num_heads`` and
            ``num_query_groups``.
        num_query_groups: key/value groups (None: ``num_heads``, i.e. plain MHA).
        position_embedding: ``"rope"`` applies rotary embeddings to q and k; ``"none"``
            leaves positions to the caller (e.g. learned embeddings at the input).
        residual_connection: return ``x + dropout(attention(x))``.
        input_layernorm: normalize the input first (pre-norm).
        kv_channels: the head size ``d`` (None: ``hidden_size // num_heads``).
        qkv_interleaved: the QKV layout above (True); False: ``[n/g + 2, g, d]`` per rank, all
            query heads, then all keys, then all values (TE's layout without
            ``qkv_weight_interleaved``; query head ``i`` still uses group ``i // (n/g)``).
        attn_mask_type: the default mask (:data:`MaskType`); ``forward``'s ``attn_mask_type``
            overrides it per call, ``attention_mask`` is the mask of ``"arbitrary"``.
        return_layernorm_output: also return the normalized input, ``(y, norm(x))`` (with
            ``input_layernorm``, not with ``residual_connection``).
        rng: dropout streams (:class:`~tp_fuse.layers.random.DropoutRNG`, or a
            :class:`~tp_fuse.layers.random.TrackerRNG` over a Megatron / TE RNG tracker).
        submodules: prebuilt QKV / output projections (:class:`AttentionSubmodules`; then
            the arguments that build them -- norm, bias, init, seed, overlap, dtype, device --
            are not used, and ``residual_connection`` / ``hidden_dropout`` are refused:
            they live in the projection's op sequence). ``tp_fuse.te.MultiheadAttention`` is
            this block with TE's modules.
        Others as :class:`~tp_fuse.layers.layernorm_mlp.LayerNormMLP`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        num_query_groups: Optional[int] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        input_layernorm: bool = True,
        normalization: Normalization = "LayerNorm",
        eps: float = 1e-5,
        bias: bool = True,
        residual_connection: bool = False,
        attention_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        position_embedding: Literal["rope", "none"] = "none",
        rope_theta: float = 10000.0,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        overlap: Optional[TPOverlap] = None,
        rng: Optional[DropoutRNG | TrackerRNG] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        kv_channels: Optional[int] = None,
        qkv_interleaved: bool = True,
        attn_mask_type: MaskType = "causal",
        return_layernorm_output: bool = False,
        submodules: Optional[AttentionSubmodules] = None,
    ) -> None:
        super().__init__()
        groups = num_heads if num_query_groups is None else num_query_groups
        head_dim = hidden_size // num_heads if kv_channels is None else kv_channels
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_query_groups", groups),
                            ("kv_channels", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MultiheadAttention: {name} must be a positive int, got {value!r}")
        if kv_channels is None and hidden_size % num_heads != 0:
            raise ValueError(f"MultiheadAttention: hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(f"MultiheadAttention: attn_mask_type must be one of {list(MASK_TYPES)}, "
                             f"got {attn_mask_type!r}")
        if return_layernorm_output and (residual_connection or (submodules is None and not input_layernorm)):
            raise ValueError("MultiheadAttention: return_layernorm_output needs input_layernorm=True and "
                             "residual_connection=False (one extra output of the QKV layer)")
        if submodules is not None and (residual_connection or hidden_dropout > 0):
            raise ValueError("MultiheadAttention: with prebuilt submodules residual_connection must be False and "
                             "hidden_dropout 0 (the residual and the dropout live in the built projection)")
        if num_heads % groups != 0:
            raise ValueError(f"MultiheadAttention: num_heads ({num_heads}) must be divisible by num_query_groups ({groups})")
        if position_embedding not in ("rope", "none"):
            raise ValueError(f"MultiheadAttention: position_embedding must be 'rope' or 'none', got {position_embedding!r}")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed)
        divide(num_heads, ctx.tp_size, "MultiheadAttention: num_heads")
        divide(groups, ctx.tp_size, "MultiheadAttention: num_query_groups")
        self.hidden_size, self.num_heads, self.num_query_groups = hidden_size, num_heads, groups
        self.head_dim = head_dim
        self.qkv_interleaved = bool(qkv_interleaved)
        self.attn_mask_type = attn_mask_type
        self.return_layernorm_output = bool(return_layernorm_output)
        self.heads_per_group = num_heads // groups
        self.local_heads, self.local_groups = num_heads // ctx.tp_size, groups // ctx.tp_size
        self.tp_size, self.sequence_parallel = ctx.tp_size, sequence_parallel
        self.residual_connection = bool(residual_connection)
        self.hidden_dropout = float(hidden_dropout)
        self.rng = dropout_rng(ctx, rng)
        self._hidden_stream = hidden_dropout_stream(ctx)
        init_method = init_method or normal_init(0.02)
        output_init_method = output_init_method or init_method

        # Selective recompute (Megatron's "core_attn"): the [b, n, s, s] scores are the
        # largest activation of the layer and the cheapest to rebuild (no GEMM weights, no FP8).
        self.recompute_core_attention = False
        if submodules is not None:
            self._qkv_name, self._core_name = submodules.qkv_name, submodules.core_name
            self.add_module(self._qkv_name, submodules.qkv)
            self.rotary = RotaryEmbedding(self.head_dim, rope_theta) if position_embedding == "rope" else None
            self.add_module(self._core_name, DotProductAttention(attention_dropout))
            self.proj = submodules.proj
            return
        self._qkv_name, self._core_name = "qkv", "core"
        qkv_size = groups * (self.heads_per_group + 2) * self.head_dim
        if input_layernorm:
            self.qkv: torch.nn.Module = LayerNormLinear(
                hidden_size, qkv_size, tp_group=tp_group, sequence_parallel=sequence_parallel,
                normalization=normalization, eps=eps, bias=bias, return_residual=residual_connection,
                init_method=init_method, seed=ctx.child("qkv").seed, comm_name="qkv", overlap=overlap,
                dtype=dtype, device=device, return_layernorm_output=return_layernorm_output,
            )
        else:
            ops: "OrderedDict[str, BasicOperation]" = OrderedDict()
            if residual_connection:
                ops["residual"] = MakeExtraOutput()
            ops.update(column_parallel_ops(ctx.child("qkv"), hidden_size, qkv_size, bias=bias, comm_name="qkv",
                                           init_method=init_method))
            self.qkv = Sequential(ops)
        self.rotary = RotaryEmbedding(self.head_dim, rope_theta) if position_embedding == "rope" else None
        self.core = DotProductAttention(attention_dropout)

        proj = row_parallel_ops(ctx.child("proj"), num_heads * self.head_dim, hidden_size, bias=bias,
                                comm_name="proj", init_method=output_init_method)
        if hidden_dropout > 0:
            proj["dropout"] = Dropout(hidden_dropout)
        if residual_connection:
            proj["residual"] = AddExtraInput()
        self.proj = Sequential(proj)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, g/tp * (n/g + 2) * d]`` -> ``q [s, b, n/tp, d]``, ``k, v [s, b, g/tp, d]``
        (either layout: see ``qkv_interleaved``)."""
        s, b, _ = qkv.shape
        qpg, g, d = self.heads_per_group, self.local_groups, self.head_dim
        # One split (its backward is one cat) where indexing would give three backward
        # kernels, each a zero fill plus a copy on a GPU.
        if self.qkv_interleaved:
            q, k, v = torch.split(qkv.view(s, b, g, qpg + 2, d), (qpg, 1, 1), dim=3)  # [s, b, g/tp, ., d]
            k, v = k.squeeze(3), v.squeeze(3)
        else:
            q, k, v = torch.split(qkv.view(s, b, qpg + 2, g, d), (qpg, 1, 1), dim=2)  # [s, b, ., g/tp, d]
            k, v = k.squeeze(2), v.squeeze(2)
        return q.reshape(s, b, self.local_heads, d), k, v  # q [s, b, n/tp, d]; k, v [s, b, g/tp, d]

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                attn_mask_type: Optional[MaskType] = None,
                checkpoint_core_attention: Optional[bool] = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``y`` (the projection's output: see :class:`AttentionSubmodules`), ``(y, norm(x))``
        with ``return_layernorm_output``. ``attn_mask_type`` overrides the constructor's;
        ``attention_mask`` only with ``"arbitrary"``; ``checkpoint_core_attention`` (None: the
        ``recompute_core_attention`` attribute) recomputes the core attention in backward."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in MASK_TYPES:
            raise ValueError(f"MultiheadAttention: attn_mask_type must be one of {list(MASK_TYPES)}, "
                             f"got {mask_type!r}")
        if (attention_mask is not None) != (mask_type == "arbitrary"):
            raise ValueError("MultiheadAttention: attention_mask is given with attn_mask_type='arbitrary' only "
                             f"(and needed then), got attn_mask_type={mask_type!r} and "
                             f"attention_mask={type(attention_mask).__name__}")
        out = self._modules[self._qkv_name](x)
        qkv, extra = out if self.residual_connection or self.return_layernorm_output else (out, None)
        q, k, v = self.split_qkv(qkv)
        if self.rotary is not None:
            # qkv holds the whole sequence here (gathered under SP): positions 0..s-1.
            cos, sin = self.rotary.cos_sin(q.shape[0], q.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        causal = "causal" in mask_type
        recompute = self.recompute_core_attention if checkpoint_core_attention is None else checkpoint_core_attention
        if recompute and torch.is_grad_enabled():
            context = checkpoint(self._core_attention, q, k, v, causal, attention_mask,
                                 modules=[self._modules[self._core_name]], get_rng_state_tracker=lambda: self.rng)
        else:
            context = self._core_attention(q, k, v, causal, attention_mask)  # [s, b, n/tp * d]
        residual = (extra,) if self.residual_connection else ()
        with maybe_fork(self.rng, self._hidden_stream, self.training and self.hidden_dropout > 0):
            y = self.proj(context, *residual)
        if not self.return_layernorm_output:
            return y
        return (*y, extra) if isinstance(y, tuple) else (y, extra)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        mask: Optional[torch.Tensor]) -> torch.Tensor:
        core = self._modules[self._core_name]
        with maybe_fork(self.rng, "tp_local", self.training and core.attention_dropout > 0):
            # Each rank holds different heads: masks must be independent across TP ranks.
            return core(q, k, v, causal=causal, mask=mask)  # [s, b, n/tp * d]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                f"num_query_groups={self.num_query_groups}, tp={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, rope={self.rotary is not None}")
