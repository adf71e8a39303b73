"""``MultiheadAttention``: Transformer Engine's ``transformer_engine.pytorch.MultiheadAttention``
as a constructor over the one attention block, :class:`tp_fuse.layers.MultiheadAttention`.

TE's QKV and output projections are TE's module classes of :mod:`tp_fuse.te.module`
(``LayerNormLinear`` / ``Linear`` for QKV, ``Linear`` for the output projection), handed to
the layers block as its prebuilt submodules under TE's names; the QKV split, the core
attention (``DotProductAttention``) and the dropout streams are the layers block's. This
class maps TE's arguments and checks what tp_fuse does not do; its ``forward`` translates
TE's arguments and runs the block's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from tp_fuse.layers import attention as _layers_attention
from tp_fuse.layers.random import TrackerRNG
from ..module._ops_module import check_common_args, refuse_unless
from ..module.layernorm_linear import LayerNormLinear
from ..module.linear import Linear

__all__ = ["MultiheadAttention"]

#: TE's self-attention mask types tp_fuse computes: the layers block's.
MASK_TYPES = _layers_attention.MASK_TYPES


def neutral_window(mask_type: str) -> tuple[int, int]:
    """TE's ``window_size`` that means "no sliding window" for ``mask_type``."""
    return (-1, 0) if "causal" in mask_type else (-1, -1)


def check_mask_type(cls: str, arg: str, mask_type: Any) -> None:
    refuse_unless(cls, arg, mask_type in MASK_TYPES, mask_type,
                  f"one of {list(MASK_TYPES)}; padding masks are not implemented")


def check_window(cls: str, window_size: Any, mask_type: str) -> None:
    """Only TE's "no sliding window" values: None, (-1, -1), or (-1, 0) with a causal mask."""
    ok = window_size is None or tuple(window_size) == neutral_window(mask_type)
    refuse_unless(cls, "window_size", ok, window_size,
                  f"None or {neutral_window(mask_type)} for attn_mask_type={mask_type!r}: no sliding window")


class MultiheadAttention(_layers_attention.MultiheadAttention):
    """Self-attention with Transformer Engine's ``MultiheadAttention`` constructor, submodule
    names and ``forward``: :class:`tp_fuse.layers.MultiheadAttention` built with TE's modules
    (its forward; ``kv_channels``, the QKV layouts, the mask types, ``return_layernorm_output``
    and the RNG tracker's dropout are options of that block).

    ``y = proj(attention(split(qkv(x))))`` for ``x [s, b, hidden_size]``: no residual and no
    output dropout (TE's ``TransformerLayer`` adds them). Submodules, as in TE:
    ``layernorm_qkv`` (a :class:`~tp_fuse.module.LayerNormLinear`, with ``input_layernorm=True``)
    or ``qkv`` (a :class:`~tp_fuse.module.Linear`, TE's default ``input_layernorm=False``),
    ``core_attention`` (no parameters) and ``proj`` (a :class:`~tp_fuse.module.Linear`). With
    ``name`` the GEMMs join nvdlfw-inspect's debug API as ``<name>.layernorm_linear_qkv`` (or
    ``<name>.linear_qkv``) and ``<name>.proj``, TE's names.

    QKV layout (TE's): with ``fuse_qkv_params=True`` and ``qkv_weight_interleaved=True`` the
    QKV output per rank is ``[g, n/g + 2, d]`` (per group: its query heads, then k, then v);
    otherwise (TE forces ``qkv_weight_interleaved=False`` without ``fuse_qkv_params``) it is
    ``[n/g + 2, g, d]``: all query heads, then all keys, then all values. Query head ``i``
    uses key/value group ``i // (n/g)``. Softmax scale ``1/sqrt(kv_channels)``.

    Parameter names, as in TE: with ``fuse_qkv_params=True`` one fused ``weight`` / ``bias`` in
    the QKV layer; with TE's default ``fuse_qkv_params=False`` ``query_weight`` / ``key_weight`` /
    ``value_weight`` (and biases; the layer's ``parameters_split``), read as ``[q; k; v]``.
    With tensor parallelism each rank holds its own ``[q_r; k_r; v_r]``, as in TE.

    Supported as in TE: ``kv_channels``, ``attention_dropout`` (default 0.1, on the attention
    probabilities in training; inside ``get_rng_state_tracker().fork()`` when a tracker is
    given), ``layernorm_epsilon``, ``init_method`` / ``output_layer_init_method`` (default
    ``normal_(0, 0.023)``), ``layer_number`` (no effect on the values), ``attn_mask_type``
    ``"causal"`` (default), ``"causal_bottom_right"`` (the same mask here), ``"no_mask"`` and
    ``"arbitrary"`` (``forward``'s ``attention_mask``: bool, ``True`` = masked out; TE ignores
    the mask for the other types and so does this class), ``num_gqa_groups``,
    ``return_layernorm_output`` (only with ``input_layernorm``, as in TE), ``input_layernorm``,
    ``normalization``, ``zero_centered_gamma``, ``bias``, ``return_bias`` (``(y, proj_bias)``),
    ``set_parallel_mode`` with ``tp_group`` (QKV column-, proj row-parallel) and
    ``sequence_parallel``, ``fuse_wgrad_accumulation``, ``params_dtype``, ``device`` (None:
    torch's default; TE's default is ``"cuda"``), ``name``; ``seq_length`` /
    ``micro_batch_size`` only warm TE's JIT kernels and have no effect. ``forward``:
    ``attention_mask``, ``attn_mask_type``, ``window_size`` (no sliding window only),
    ``is_first_microbatch``, ``checkpoint_core_attention`` (``tp_fuse.checkpoint`` around
    the core attention).

    Refused (ValueError naming the argument and what is supported): ``attention_type="cross"``,
    padding mask types, a sliding ``window_size``, ``qkv_format`` other than ``"sbhd"``,
    ``qk_norm_type``, ``softmax_type`` other than ``"vanilla"``, the ``ub_*`` overlap flags,
    ``tp_size > 1`` without ``set_parallel_mode=True`` and a ``tp_group``; in ``forward``
    ``encoder_output``, ``inference_params``, ``rotary_pos_emb``, attention biases / ALiBi,
    ``cu_seqlens_*`` / ``max_seqlen_*`` and ``pad_between_seqs=True``. FP8 attention
    (``fp8_dpa`` / ``fp8_mha``) is refused by the recipes; under ``autocast`` the GEMMs run
    in FP8 and the core attention in the input precision.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        num_gqa_groups: Optional[int] = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        sequence_parallel: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Optional[Union[torch.device, str]] = None,
        qkv_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        softmax_type: str = "vanilla",
    ) -> None:
        cls = "MultiheadAttention"
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{cls}: name must be a str or None, got {name!r}")
        for arg, value in (("hidden_size", hidden_size), ("num_attention_heads", num_attention_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{cls}: {arg} must be a positive int, got {value!r}")
        tp = check_common_args(
            cls, sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=None, parameters_split=None,
            delay_wgrad_compute=False, symmetric_ar_type=None, device=device, params_dtype=params_dtype,
            return_bias=return_bias, bias=bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            ub=dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                    ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                    ub_bulk_wgrad=ub_bulk_wgrad),
        )
        for arg, value in (("input_layernorm", input_layernorm), ("return_layernorm_output", return_layernorm_output),
                           ("set_parallel_mode", set_parallel_mode), ("fuse_qkv_params", fuse_qkv_params),
                           ("qkv_weight_interleaved", qkv_weight_interleaved),
                           ("rotary_pos_interleaved", rotary_pos_interleaved)):
            if not isinstance(value, bool):
                raise ValueError(f"{cls}: {arg} must be a bool, got {value!r}")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{cls}: fuse_wgrad_accumulation=True requires fuse_qkv_params=True (main_grad "
                             "needs one QKV weight tensor, not query_weight / key_weight / value_weight)")
        refuse_unless(cls, "attention_type", attention_type == "self", attention_type,
                      "'self'; cross-attention is not implemented")
        check_mask_type(cls, "attn_mask_type", attn_mask_type)
        check_window(cls, window_size, attn_mask_type)
        if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
            raise ValueError(f"{cls}: bottom_right_diagonal must be a bool or None, got {bottom_right_diagonal!r}")
        refuse_unless(cls, "qkv_format", qkv_format == "sbhd", qkv_format, "'sbhd' ([s, b, h] activations)")
        refuse_unless(cls, "qk_norm_type", qk_norm_type is None, qk_norm_type, "None")
        refuse_unless(cls, "softmax_type", softmax_type == "vanilla", softmax_type, "'vanilla'")
        refuse_unless(cls, "tp_size", tp == 1 or set_parallel_mode, tp,
                      "1, or a tp_group together with set_parallel_mode=True (QKV column-, proj row-parallel)")
        if layer_number is not None and (isinstance(layer_number, bool) or not isinstance(layer_number, int)
                                         or layer_number <= 0):
            raise ValueError(f"{cls}: layer_number must be a positive int or None, got {layer_number!r}")
        heads = num_attention_heads
        groups = heads if num_gqa_groups is None else num_gqa_groups
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0 or heads % groups:
            raise ValueError(f"{cls}: num_gqa_groups ({groups!r}) must be a positive divisor of "
                             f"num_attention_heads ({heads})")
        if heads % tp or groups % tp:
            raise ValueError(f"{cls}: num_attention_heads ({heads}) and num_gqa_groups ({groups}) must be "
                             f"divisible by the tensor-parallel size ({tp})")
        kv = kv_channels if kv_channels else hidden_size // heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
            raise ValueError(f"{cls}: kv_channels must be a positive int, got {kv_channels!r}")

        params_dtype = params_dtype or torch.get_default_dtype()
        # TE: without fused QKV parameters the layout is [q; k; v] whatever qkv_weight_interleaved says.
        interleaved = qkv_weight_interleaved and fuse_qkv_params
        gemm_kwargs = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp,
                           get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                           params_dtype=params_dtype, device=device)
        hidden_q, hidden_kv = kv * heads, kv * groups
        qkv_mode = "column" if set_parallel_mode else None
        # TE: without fuse_qkv_params the QKV layer holds query_weight / key_weight / value_weight.
        split = None if fuse_qkv_params else {"query": hidden_q, "key": hidden_kv, "value": hidden_kv}
        if input_layernorm:
            qkv: torch.nn.Module = LayerNormLinear(
                hidden_size, hidden_q + 2 * hidden_kv, eps=layernorm_epsilon, init_method=init_method, bias=bias,
                parallel_mode=qkv_mode, return_layernorm_output=return_layernorm_output,
                zero_centered_gamma=zero_centered_gamma, normalization=normalization, ub_name="qkv",
                parameters_split=split, name=None if name is None else name + ".layernorm_linear_qkv",
                **gemm_kwargs)
        else:
            qkv = Linear(
                hidden_size, hidden_q + 2 * hidden_kv, init_method=init_method, bias=bias, parallel_mode=qkv_mode,
                parameters_split=split, name=None if name is None else name + ".linear_qkv", **gemm_kwargs)
        proj = Linear(
            hidden_q, hidden_size, init_method=output_layer_init_method, bias=bias,
            return_bias=return_bias, parallel_mode="row" if set_parallel_mode else None, ub_name="proj",
            name=None if name is None else name + ".proj", **gemm_kwargs)
        super().__init__(
            hidden_size, heads, num_query_groups=groups, tp_group=tp_group if tp > 1 else None,
            sequence_parallel=tp > 1 and sequence_parallel, input_layernorm=input_layernorm,
            attention_dropout=attention_dropout, rng=TrackerRNG(get_rng_state_tracker), dtype=params_dtype,
            kv_channels=kv, qkv_interleaved=interleaved, attn_mask_type=attn_mask_type,
            return_layernorm_output=input_layernorm and return_layernorm_output,
            submodules=_layers_attention.AttentionSubmodules(
                qkv=qkv, proj=proj, qkv_name="layernorm_qkv" if input_layernorm else "qkv",
                core_name="core_attention"))

        self.name = name
        self.num_attention_heads = heads
        self.num_gqa_groups = groups
        self.hidden_size_per_attention_head = kv
        self.hidden_size_q, self.hidden_size_kv = hidden_q, hidden_kv
        self.num_attention_heads_per_partition = heads // tp
        self.num_gqa_groups_per_partition = groups // tp
        self.window_size = window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm = input_layernorm
        self.attention_type = attention_type
        self.return_bias = return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_group = tp_group
        self.params_dtype = params_dtype
        self.qkv_format = qkv_format
        self.softmax_type = softmax_type
        self.qkv_weight_interleaved = interleaved

    def _sync_names(self) -> None:
        """``name`` may be set after construction (``debug_api.infer_and_assign_layer_names``)."""
        name = self.name
        qkv = self.layernorm_qkv if self.input_layernorm else self.qkv
        suffix = ".layernorm_linear_qkv" if self.input_layernorm else ".linear_qkv"
        qkv.name = None if name is None else name + suffix
        self.proj.name = None if name is None else name + ".proj"

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """TE's late TP-group setup: only the group given at construction is supported."""
        if tp_group is not self.tp_group:
            raise ValueError("MultiheadAttention: set_tensor_parallel_group after construction is not supported "
                             "by tp_fuse (pass tp_group to the constructor)")

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = None,
        encoder_output: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params: Any = None,
        rotary_pos_emb: Any = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: Optional[bool] = None,
    ):
        """``y`` (``[s, b, hidden_size]``); ``(y, proj_bias)`` with ``return_bias``; the
        normalized input appended with ``input_layernorm`` and ``return_layernorm_output``.
        TE's arguments checked and translated; the computation is the layers block's."""
        cls = "MultiheadAttention.forward"
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        check_forward_args(
            cls, mask_type=mask_type, window_size=self.window_size if window_size is None else window_size,
            is_first_microbatch=is_first_microbatch, core_attention_bias_type=core_attention_bias_type,
            pad_between_seqs=pad_between_seqs, encoder_output=encoder_output, inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb, core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        if mask_type == "arbitrary":
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
                raise ValueError(f"{cls}: attn_mask_type='arbitrary' needs attention_mask, a bool tensor "
                                 "broadcastable to [b, heads, s, s] (True = masked out)")
        else:
            attention_mask = None  # TE: attention_mask is not used with the causal / no_mask types
        self._sync_names()
        return super().forward(hidden_states, attention_mask, attn_mask_type=mask_type,
                               checkpoint_core_attention=checkpoint_core_attention)


def check_forward_args(cls: str, *, mask_type: Any, window_size: Any, is_first_microbatch: Any,
                       core_attention_bias_type: Any, pad_between_seqs: Any, **must_be_none: Any) -> None:
    """TE's ``forward`` arguments of the attention that tp_fuse does not compute with: refused
    (ValueError naming the argument) unless they ask for nothing (``must_be_none``: None)."""
    check_mask_type(cls, "attn_mask_type", mask_type)
    check_window(cls, window_size, mask_type)
    for arg, value in must_be_none.items():
        refuse_unless(cls, arg, value is None, type(value).__name__, "None")
    refuse_unless(cls, "core_attention_bias_type", core_attention_bias_type == "no_bias",
                  core_attention_bias_type, "'no_bias'")
    refuse_unless(cls, "pad_between_seqs", not pad_between_seqs, pad_between_seqs, "None or False")
    # is_first_microbatch is TE's FP8 weight-cache hint: tp_fuse quantizes the weight at every
    # call (the same values while the weight is unchanged), so only its value is checked.
    if is_first_microbatch not in (None, True, False):
        raise ValueError(f"{cls}: is_first_microbatch must be None, True or False, got {is_first_microbatch!r}")
