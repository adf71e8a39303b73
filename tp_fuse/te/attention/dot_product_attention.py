"""``DotProductAttention``: Transformer Engine's core-attention module
(``transformer_engine.pytorch.DotProductAttention``) as a thin constructor over tp_fuse's one
attention implementation, :class:`tp_fuse.layers.attention.DotProductAttention` (SDPA).

TE's constructor arguments and ``forward(query, key, value, attention_mask, ...,
attn_mask_type=..., window_size=..., checkpoint_core_attention=...)``; the shapes:

=========================  ======================================================
``qkv_format="sbhd"``      ``q [sq, b, n, d]``, ``k [skv, b, g, d]``, ``v [skv, b, g, dv]``
                           -> ``out [sq, b, n*dv]``
``qkv_format="bshd"``      the same with batch first -> ``out [b, sq, n*dv]``
=========================  ======================================================

``n`` and ``g`` are this rank's heads: ``num_attention_heads / tp_size`` and
``num_gqa_groups / tp_size`` (TE's arguments are the global counts).

Masks (TE's ``attn_mask_type``): ``"no_mask"``; ``"causal"`` (query ``i`` sees keys
``0..i``, top-left aligned); ``"causal_bottom_right"`` (aligned to the last key);
``"padding"`` / ``"padding_causal"`` / ``"padding_causal_bottom_right"`` with
``attention_mask`` a bool tensor ``[b, 1, 1, skv]`` (self) or the pair ``(q_mask [b, 1, 1,
sq], kv_mask [b, 1, 1, skv])`` (True = padded position, TE's convention); ``"arbitrary"``
with a bool ``attention_mask`` broadcastable to ``[b, n, sq, skv]``. ``window_size
(left, right)`` (``-1`` unbounded) adds TE's sliding window. Everything except plain
``causal`` / ``no_mask`` goes to the core as one explicit boolean mask.

Dropout on the attention probabilities runs inside ``get_rng_state_tracker().fork()`` (TE's
"model-parallel-rng" stream: different on each TP rank, whose heads differ).

Refused with ``ValueError`` naming the argument: context parallelism (``cp_group``,
``cp_global_ranks``, ``cp_stream``), ``qkv_format="thd"`` and the packed-sequence
arguments (``cu_seqlens_*``, ``max_seqlen_*``), ``softmax_type`` other than ``"vanilla"``,
``return_max_logit``, attention biases (``core_attention_bias_type`` other than
``"no_bias"``, ``alibi_slopes``), ``inference_params``, ``fp8_output``, ``num_splits``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from tp_fuse.distributed import checkpoint
from tp_fuse.layers.attention import DotProductAttention as CoreAttention
from tp_fuse.te.module._ops_module import refuse_unless

__all__ = ["DotProductAttention", "check_set_window_size"]

_MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
               "padding_causal_bottom_right", "arbitrary")
_CP = "None: context parallelism is not implemented"
_THD = "sbhd or bshd: packed (thd) sequences are not implemented"


def check_set_window_size(attn_mask_type: str, window_size: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """TE's ``attention.dot_product_attention.utils.check_set_window_size``: the window that
    ``attn_mask_type`` allows (``(-1, 0)`` / ``(>=0, 0)`` for causal masks, ``(-1, -1)`` /
    ``(>=0, >=0)`` otherwise). Like TE, a window a causal mask contradicts on the right is
    closed there with a warning, ``(-1, 0)`` without a causal mask opens to ``(-1, -1)`` with a
    warning; other windows are refused (ValueError here, an assert in TE)."""
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
            raise ValueError(f"window_size must be a pair of ints, got {window_size!r}")
        window_size = (int(window_size[0]), int(window_size[1]))
    if "causal" in attn_mask_type:
        if window_size is None:
            return (-1, 0)
        if window_size == (-1, -1) or (window_size[0] >= 0 and window_size[1] != 0):
            warnings.warn(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={attn_mask_type}")
            return (window_size[0], 0)
        if window_size != (-1, 0) and (window_size[0] < 0 or window_size[1] != 0):
            raise ValueError(f"window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={attn_mask_type}, "
                             f"got {window_size}")
        return window_size
    if attn_mask_type in ("no_mask", "padding", "arbitrary"):
        if window_size is None:
            return (-1, -1)
        if window_size == (-1, 0):
            warnings.warn(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={attn_mask_type}")
            return (-1, -1)
        if window_size != (-1, -1) and (window_size[0] < 0 or window_size[1] < 0):
            raise ValueError(f"window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={attn_mask_type}, "
                             f"got {window_size}")
        return window_size
    raise ValueError(f"Invalid attn_mask_type: {attn_mask_type}")


def _window(cls: str, window_size: Any, mask_type: str) -> Optional[tuple[int, int]]:
    """TE's window for ``mask_type`` (:func:`check_set_window_size`), or None when it restricts
    nothing beyond the mask itself."""
    left, right = check_set_window_size(mask_type, window_size)
    if left == -1 and right in (-1, 0):
        return None  # (-1, 0) with a causal mask is the causal mask itself
    return left, right


def build_mask(mask_type: str, attention_mask: Any, window: Optional[tuple[int, int]], b: int, sq: int,
               skv: int, device: torch.device) -> Optional[torch.Tensor]:
    """One bool mask broadcastable to ``[b, n, sq, skv]`` (True = masked out), or None when the
    core's own causal / unmasked path applies (see the module docstring)."""
    if mask_type in ("no_mask", "causal") and window is None and attention_mask is None:
        return None
    masked = torch.zeros(1, 1, sq, skv, dtype=torch.bool, device=device)
    i = torch.arange(sq, device=device)[:, None]  # query positions
    j = torch.arange(skv, device=device)[None, :]  # key positions
    shift = skv - sq if mask_type.endswith("bottom_right") else 0
    if "causal" in mask_type:
        masked |= j > i + shift
    if window is not None:
        left, right = window
        if left >= 0:
            masked |= j < i + shift - left
        if right >= 0:
            masked |= j > i + shift + right
    if mask_type.startswith("padding"):
        if attention_mask is None:
            raise ValueError(f"DotProductAttention: attn_mask_type={mask_type!r} needs attention_mask")
        if isinstance(attention_mask, (tuple, list)):
            q_pad, kv_pad = attention_mask
        else:
            q_pad = kv_pad = attention_mask
        for t in (q_pad, kv_pad):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
                raise ValueError("DotProductAttention: a padding attention_mask must be bool tensors [b, 1, 1, s]")
        # [b, 1, 1, sq] -> rows; [b, 1, 1, skv] -> columns.
        masked = masked | q_pad.reshape(b, 1, -1, 1)[:, :, :sq] | kv_pad.reshape(b, 1, 1, -1)[:, :, :, :skv]
    elif mask_type == "arbitrary":
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
            raise ValueError("DotProductAttention: attn_mask_type='arbitrary' needs a bool attention_mask")
        masked = masked | attention_mask
    return masked


class DotProductAttention(torch.nn.Module):
    """TE's ``DotProductAttention`` (see the module docstring); no parameters."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[tuple[int, int]] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group: Optional[Any] = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group: Optional[Any] = None,
        cp_global_ranks: Optional[list[int]] = None,
        cp_stream: Optional[Any] = None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
    ) -> None:
        super().__init__()
        cls = "DotProductAttention"
        for arg, value in (("cp_group", cp_group), ("cp_global_ranks", cp_global_ranks), ("cp_stream", cp_stream)):
            refuse_unless(cls, arg, value is None, value, _CP)
        refuse_unless(cls, "qkv_format", qkv_format in ("sbhd", "bshd"), qkv_format, _THD)
        refuse_unless(cls, "attn_mask_type", attn_mask_type in _MASK_TYPES, attn_mask_type, ", ".join(_MASK_TYPES))
        refuse_unless(cls, "attention_type", attention_type in ("self", "cross"), attention_type, "'self' or 'cross'")
        refuse_unless(cls, "softmax_type", softmax_type == "vanilla", softmax_type, "'vanilla'")
        refuse_unless(cls, "return_max_logit", return_max_logit is False, return_max_logit, "False")
        if tp_group is not None:
            tp_size = tp_group.size()
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"{cls}: tp_size must be a positive int, got {tp_size!r}")
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        for arg, value in (("num_attention_heads", num_attention_heads), ("num_gqa_groups", num_gqa_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % tp_size:
                raise ValueError(f"{cls}: {arg}={value!r} must be a positive multiple of tp_size={tp_size}")
        if num_attention_heads % num_gqa_groups:
            raise ValueError(f"{cls}: num_attention_heads={num_attention_heads} must be a multiple of "
                             f"num_gqa_groups={num_gqa_groups}")
        dk, dv = kv_channels if isinstance(kv_channels, (tuple, list)) else (kv_channels, kv_channels)
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, num_gqa_groups
        self.num_heads_per_rank = num_attention_heads // tp_size
        self.num_gqa_groups_per_partition = num_gqa_groups // tp_size
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = int(dk), int(dv)
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.window_size = _window(cls, window_size, attn_mask_type)
        self.sequence_parallel, self.tp_size, self.tp_group = bool(sequence_parallel), tp_size, tp_group
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = 1 if layer_number is None else layer_number
        self.attention_type, self.cp_comm_type = attention_type, cp_comm_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else dk ** -0.5
        self.attention_dropout = float(attention_dropout)
        # The one attention implementation; TE's default scale 1/sqrt(dk) passed explicitly.
        self.core = CoreAttention(attention_dropout, softmax_scale=self.softmax_scale)

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[tuple[int, int]] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params: Optional[Any] = None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        num_splits: Optional[int] = None,
    ) -> torch.Tensor:
        """Attention of ``query_layer`` over ``key_layer`` / ``value_layer`` (see the module docstring)."""
        cls = "DotProductAttention.forward"
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        refuse_unless(cls, "qkv_format", qkv_format in ("sbhd", "bshd"), qkv_format, _THD)
        for arg, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv),
                           ("cu_seqlens_q_padded", cu_seqlens_q_padded),
                           ("cu_seqlens_kv_padded", cu_seqlens_kv_padded), ("max_seqlen_q", max_seqlen_q),
                           ("max_seqlen_kv", max_seqlen_kv), ("pad_between_seqs", pad_between_seqs)):
            refuse_unless(cls, arg, value is None, value, _THD)
        refuse_unless(cls, "core_attention_bias_type", core_attention_bias_type == "no_bias",
                      core_attention_bias_type, "'no_bias'")
        for arg, value in (("core_attention_bias", core_attention_bias), ("alibi_slopes", alibi_slopes),
                           ("inference_params", inference_params), ("num_splits", num_splits)):
            refuse_unless(cls, arg, value is None, value, "None")
        refuse_unless(cls, "fp8_output", not fp8_output, fp8_output, "False")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        refuse_unless(cls, "attn_mask_type", mask_type in _MASK_TYPES, mask_type, ", ".join(_MASK_TYPES))
        window = self.window_size if window_size is None else _window(cls, window_size, mask_type)
        q, k, v = query_layer, key_layer, value_layer
        if qkv_format == "bshd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, h, d] -> [s, b, h, d]
        for name, t, heads in (("query_layer", q, self.num_heads_per_rank),
                               ("key_layer", k, self.num_gqa_groups_per_partition),
                               ("value_layer", v, self.num_gqa_groups_per_partition)):
            if t.dim() != 4 or t.shape[2] != heads:
                raise ValueError(f"{cls}: {name} must be 4-D {qkv_format} with {heads} heads on this rank, "
                                 f"got shape {tuple(t.shape)}")
        sq, b, skv = q.shape[0], q.shape[1], k.shape[0]
        # TE ignores attention_mask for the mask types that take none.
        mask_in = attention_mask if mask_type.startswith("padding") or mask_type == "arbitrary" else None
        mask = build_mask(mask_type, mask_in, window, b, sq, skv, q.device)
        causal = mask is None and mask_type == "causal"
        if checkpoint_core_attention:
            out = checkpoint(self._attend, q, k, v, causal, mask, modules=[self.core],
                             get_rng_state_tracker=self.get_rng_state_tracker)
        else:
            out = self._attend(q, k, v, causal, mask)  # [sq, b, n*dv]
        if qkv_format == "bshd":
            out = out.transpose(0, 1).contiguous()  # [b, sq, n*dv]
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        tracker = self.get_rng_state_tracker
        if tracker is not None and self.training and self.attention_dropout > 0:
            # TE: attention dropout in the tracker's model-parallel stream (per-rank heads).
            with tracker().fork():
                return self.core(q, k, v, causal=causal, mask=mask)
        return self.core(q, k, v, causal=causal, mask=mask)

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: Any = None, cp_stream: Any = None,
                                   cp_comm_type: str = "p2p") -> None:
        """TE's late context-parallel setup: only "none" (``cp_group=None``) is supported."""
        refuse_unless("DotProductAttention", "cp_group", cp_group is None, cp_group, _CP)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads_per_rank}, gqa_groups={self.num_gqa_groups_per_partition}, "
                f"qkv_format={self.qkv_format}, attn_mask_type={self.attn_mask_type}, "
                f"window_size={self.window_size}, tp_size={self.tp_size}")
