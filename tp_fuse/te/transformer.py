"""``TransformerLayer``: Transformer Engine's ``transformer_engine.pytorch.TransformerLayer``
as a constructor over the one transformer layer, :class:`tp_fuse.layers.TransformerLayer`.

The layers class, built on its own blocks, is tp_fuse's GPT block (explicit ``tp_group``,
TP-independent initialization, RoPE, activation checkpointing); built with TE's blocks
(``MultiheadAttention``, ``LayerNormMLP`` of this room) it adds their biases, dropout and
residuals TE's way. This class maps TE's constructor onto it; its ``forward`` checks and
translates TE's arguments and runs the layer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from tp_fuse.layers import transformer as _layers_transformer
from tp_fuse.layers.random import TrackerRNG
from .attention.multi_head_attention import MultiheadAttention, check_forward_args, check_mask_type, check_window
from .module._ops_module import check_common_args, norm_op, refuse_unless
from .module.layernorm_mlp import LayerNormMLP

__all__ = ["TransformerLayer"]


class TransformerLayer(_layers_transformer.TransformerLayer):
    """Transformer Engine's encoder layer: attention block and MLP block, with TE's
    constructor, submodule names and ``forward``: :class:`tp_fuse.layers.TransformerLayer`
    built with TE's blocks (``residual_from_norm``, ``parallel_attention_mlp`` and the final
    norm are options of that layer; its forward).

    Equations (TE's, ``drop`` = dropout with ``hidden_dropout``, default 0.1)::

        a, a_bias = self_attention(x)          # MultiheadAttention(input_layernorm=True, return_bias=True)
        h = x + drop(a + a_bias)
        m, m_bias = layernorm_mlp(h)           # LayerNormMLP(return_bias=True)
        y = h + drop(m + m_bias)

    ``apply_residual_connection_post_layernorm=True``: each residual is that block's
    normalized input instead. ``output_layernorm=True``: the attention has no input norm and
    ``y = layernorm(y)`` at the end (submodule ``layernorm``). ``parallel_attention_mlp=True``:
    ``y = x + drop(self_attention(x) + layernorm_mlp(x))``.

    Submodules as in TE: ``self_attention`` (:class:`~tp_fuse.MultiheadAttention`),
    ``layernorm_mlp`` (:class:`~tp_fuse.LayerNormMLP`), ``layernorm`` (with
    ``output_layernorm``). With ``name`` the GEMMs join nvdlfw-inspect's debug API as TE's
    ``<name>.self_attention.layernorm_linear_qkv``, ``<name>.self_attention.proj``,
    ``<name>.layernorm_mlp.fc1`` and ``<name>.layernorm_mlp.fc2``.

    Supported as in TE (defaults included): ``hidden_size``, ``ffn_hidden_size``,
    ``num_attention_heads``, ``num_gqa_groups``, ``layernorm_epsilon``, ``hidden_dropout``,
    ``attention_dropout``, ``init_method`` / ``output_layer_init_method``, ``layer_number``,
    ``kv_channels``, ``self_attn_mask_type`` (``"causal"`` default, ``"causal_bottom_right"``,
    ``"no_mask"``, ``"arbitrary"``), ``window_size`` (no sliding window only), ``tp_group`` /
    ``tp_size`` with ``set_parallel_mode``, ``sequence_parallel``, ``params_dtype``,
    ``get_rng_state_tracker``, ``fuse_wgrad_accumulation`` (with ``fuse_qkv_params``, as TE
    requires), ``seq_length`` (checked against the input under sequence parallelism, as in TE),
    ``micro_batch_size``, ``apply_residual_connection_post_layernorm``, ``output_layernorm``,
    ``parallel_attention_mlp``, ``fuse_qkv_params`` / ``qkv_weight_interleaved`` (see
    :class:`~tp_fuse.MultiheadAttention` for the QKV parameter names), ``zero_centered_gamma``,
    ``bias``, ``activation`` / ``activation_params`` (:class:`~tp_fuse.LayerNormMLP`'s),
    ``normalization``, ``device``, ``name``. The ``ub_*`` flags only act with
    ``ub_tp_comm_overlap=True`` in TE, which is refused here.

    Differences from TE, both from the layers layer: the hidden dropout draws from torch's
    global RNG as in TE, except under sequence parallelism with ``get_rng_state_tracker``,
    where each rank's sequence shard draws in the tracker's fork (the layers' stream for
    sharded activations; TE: the global RNG); and FP8 with sequence parallelism refuses an
    amax reduction group that does not cover the TP group (``tp_fuse.layers``' check: the
    gathered FP8 activations share one scale).

    Refused (ValueError naming the argument): ``layer_type="decoder"``, ``drop_path_rate > 0``,
    ``ub_tp_comm_overlap=True``, ``attn_input_format`` other than ``"sbhd"``, ``qk_norm_type``,
    ``softmax_type`` other than ``"vanilla"``, and what :class:`~tp_fuse.MultiheadAttention`
    refuses (also in ``forward``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        window_size: Optional[tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        enc_dec_window_size: Optional[tuple[int, int]] = None,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        get_rng_state_tracker: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        normalization: str = "LayerNorm",
        device: Optional[Union[torch.device, str]] = None,
        attn_input_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        cls = "TransformerLayer"
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{cls}: name must be a str or None, got {name!r}")
        for arg, value in (("apply_residual_connection_post_layernorm", apply_residual_connection_post_layernorm),
                           ("output_layernorm", output_layernorm), ("parallel_attention_mlp", parallel_attention_mlp),
                           ("ub_tp_comm_overlap", ub_tp_comm_overlap)):
            if not isinstance(value, bool):
                raise ValueError(f"{cls}: {arg} must be a bool, got {value!r}")
        refuse_unless(cls, "layer_type", layer_type == "encoder", layer_type,
                      "'encoder'; the decoder's cross-attention is not implemented")
        refuse_unless(cls, "drop_path_rate", drop_path_rate == 0.0, drop_path_rate, "0.0")
        refuse_unless(cls, "ub_tp_comm_overlap", not ub_tp_comm_overlap, ub_tp_comm_overlap,
                      "False: for comm+GEMM overlap build tp_fuse.ops with TPOverlap")
        refuse_unless(cls, "attn_input_format", attn_input_format == "sbhd", attn_input_format, "'sbhd'")
        check_mask_type(cls, "self_attn_mask_type", self_attn_mask_type)
        check_window(cls, window_size, self_attn_mask_type)
        if parallel_attention_mlp and (apply_residual_connection_post_layernorm or output_layernorm):
            raise ValueError(f"{cls}: parallel_attention_mlp is not supported together with "
                             "apply_residual_connection_post_layernorm or output_layernorm (as in TE)")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{cls}: fuse_wgrad_accumulation=True requires fuse_qkv_params=True (as in TE)")
        # TE: the ub_* flags only act together with ub_tp_comm_overlap (refused above).
        tp = check_common_args(
            cls, sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=None, parameters_split=None,
            delay_wgrad_compute=False, symmetric_ar_type=None, device=device, params_dtype=params_dtype,
            return_bias=False, bias=bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation, ub={})
        params_dtype = params_dtype or torch.get_default_dtype()

        sequence_parallel = tp > 1 and sequence_parallel
        kv = kv_channels if kv_channels else hidden_size // num_attention_heads
        common = dict(tp_group=tp_group, tp_size=tp, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, set_parallel_mode=set_parallel_mode,
                      zero_centered_gamma=zero_centered_gamma, bias=bias, normalization=normalization,
                      device=device, seq_length=seq_length, micro_batch_size=micro_batch_size,
                      return_layernorm_output=apply_residual_connection_post_layernorm,
                      return_bias=not parallel_attention_mlp)
        self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv, attention_dropout, layernorm_epsilon,
            init_method, output_layer_init_method, layer_number=layer_number, num_gqa_groups=num_gqa_groups,
            attn_mask_type=self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, fuse_qkv_params=fuse_qkv_params,
            qkv_weight_interleaved=qkv_weight_interleaved, rotary_pos_interleaved=rotary_pos_interleaved,
            input_layernorm=not output_layernorm, attention_type="self", qkv_format=attn_input_format,
            qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope,
            softmax_type=softmax_type, name=None if name is None else name + ".self_attention", **common)
        layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, init_method=init_method,
            output_layer_init_method=output_layer_init_method, activation=activation,
            activation_params=activation_params, name=None if name is None else name + ".layernorm_mlp",
            **common)
        layernorm = None
        if output_layernorm:
            layernorm, _ = norm_op(cls, normalization, hidden_size, layernorm_epsilon, zero_centered_gamma,
                                   device, params_dtype, sequence_parallel)
        super().__init__(
            hidden_size, ffn_hidden_size, num_attention_heads, tp_group=tp_group if tp > 1 else None,
            sequence_parallel=sequence_parallel, hidden_dropout=hidden_dropout,
            rng=TrackerRNG(get_rng_state_tracker), dtype=params_dtype,
            residual_from_norm=apply_residual_connection_post_layernorm,
            parallel_attention_mlp=parallel_attention_mlp,
            submodules=_layers_transformer.LayerSubmodules(
                attention=self_attention, mlp=layernorm_mlp, final_norm=layernorm, attention_name="self_attention",
                mlp_name="layernorm_mlp", final_norm_name="layernorm"))

        self.name = name
        self.layer_number = layer_number
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.enc_dec_bottom_right_diagonal = enc_dec_bottom_right_diagonal
        self.output_layernorm = output_layernorm
        self.layer_type = layer_type
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.kv_channels = kv
        self.tp_group, self.tp_size = tp_group, tp
        self.seq_length = seq_length
        self.get_rng_state_tracker = get_rng_state_tracker
        self.attn_input_format = attn_input_format
        self.softmax_type = softmax_type

    def _sync_names(self) -> None:
        """``name`` may be set after construction (``debug_api.infer_and_assign_layer_names``)."""
        name = self.name
        self.self_attention.name = None if name is None else name + ".self_attention"
        self.layernorm_mlp.name = None if name is None else name + ".layernorm_mlp"

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """TE's late TP-group setup: only the group given at construction is supported."""
        self.self_attention.set_tensor_parallel_group(tp_group)
        self.layernorm_mlp.set_tensor_parallel_group(tp_group)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        self_attn_mask_type: Optional[str] = None,
        window_size: Optional[tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Any = None,
        enc_dec_attn_mask_type: Optional[str] = None,
        enc_dec_window_size: Optional[tuple[int, int]] = None,
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
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
    ) -> torch.Tensor:
        """``[s, b, hidden_size]`` -> ``[s, b, hidden_size]`` (see the class docstring).
        ``encoder_output`` / ``enc_dec_*`` belong to the decoder layer (refused)."""
        cls = "TransformerLayer.forward"
        refuse_unless(cls, "encoder_output", encoder_output is None, type(encoder_output).__name__,
                      "None (layer_type='encoder')")
        refuse_unless(cls, "enc_dec_attn_mask", enc_dec_attn_mask is None, type(enc_dec_attn_mask).__name__,
                      "None (layer_type='encoder')")
        hidden_states = hidden_states.contiguous()
        if self.sequence_parallel and self.seq_length is not None \
                and hidden_states.shape[0] != self.seq_length // self.tp_size:
            raise ValueError(
                f"{cls}: with sequence parallelism hidden_states.shape[0] must be seq_length // tp_size = "
                f"{self.seq_length // self.tp_size}, got {hidden_states.shape[0]}")
        mask_type = self.self_attn_mask_type if self_attn_mask_type is None else self_attn_mask_type
        check_forward_args(
            cls, mask_type=mask_type, window_size=self.window_size if window_size is None else window_size,
            is_first_microbatch=is_first_microbatch, core_attention_bias_type=core_attention_bias_type,
            pad_between_seqs=pad_between_seqs, inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded, max_seqlen_q=max_seqlen_q)
        # The decoder's (TE passes the q ones to the self-attention).
        del cu_seqlens_kv, cu_seqlens_kv_padded, max_seqlen_kv, enc_dec_attn_mask_type, enc_dec_window_size
        del enc_dec_bottom_right_diagonal, bottom_right_diagonal, fast_zero_fill
        self._sync_names()
        return super().forward(hidden_states, attention_mask, attn_mask_type=mask_type,
                               checkpoint_core_attention=checkpoint_core_attention)
