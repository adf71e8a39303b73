"""``LayerNormMLP``: Transformer Engine's ``transformer_engine.pytorch.LayerNormMLP`` module
on tp_fuse's ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from tp_fuse.distributed import checkpoint as tp_checkpoint
from tp_fuse.layers import layernorm_mlp as _layers_mlp
from ._ops_module import OpsModule, check_common_args, check_norm_args, init_fn, refuse_unless, set_megatron_attrs
from .linear import no_overlap

__all__ = ["LayerNormMLP"]

#: TE's activation names: the layers block's (one table).
ACTIVATIONS = _layers_mlp.ACTIVATIONS


class LayerNormMLP(OpsModule):
    """``fc2(act(fc1(norm(x))))`` with Transformer Engine's ``LayerNormMLP`` constructor,
    parameter names (``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
    ``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias``) and
    ``forward(inp, is_first_microbatch=None)``.

    A constructor over the one MLP block, :class:`tp_fuse.layers.LayerNormMLP` (its forward),
    built with TE's init (on this rank's shards), ``return_bias`` / ``return_layernorm_output``
    and sequence-parallel gradients left to Megatron; with ``set_parallel_mode=True`` fc1 is
    column parallel and fc2 row parallel over ``tp_group`` (fc2's bias after the reduction, as
    in TE). The two GEMMs join the debug API as ``<name>.fc1`` and ``<name>.fc2`` (TE's debug
    names).

    ``activation``: TE's names (gelu (tanh), qgelu, relu, srelu, silu, geglu, qgeglu, reglu,
    sreglu, swiglu, glu, clamped_swiglu with ``activation_params={"limit", "alpha"}``).
    ``init_method`` initializes fc1, ``output_layer_init_method`` fc2 (both default
    ``normal_(0, 0.023)``). ``return_bias`` returns fc2's bias instead of adding it;
    ``return_layernorm_output`` appends the normalized input. ``seq_length`` /
    ``micro_batch_size`` only size TE's userbuffers (refused here), so they have no effect.

    ``checkpoint=True`` (TE's): the block's activations are recomputed in the backward
    (:func:`tp_fuse.checkpoint`, which replays the first forward's FP8 scales) instead of kept.

    Refused (ValueError naming the argument): ``return_layernorm_output_gathered=True``, other ``activation_params``, and what
    :class:`~tp_fuse.module.Linear` refuses.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        output_layer_init_method: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device: Optional[torch.device | str] = None,
        ub_overlap_ag: bool = False,
        name: Optional[str] = None,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__(name)
        cls = "LayerNormMLP"
        tp = check_common_args(
            cls, sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=None, parameters_split=None,
            delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type, device=device,
            params_dtype=params_dtype, return_bias=return_bias, bias=bias,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            ub=dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                    ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                    ub_bulk_wgrad=ub_bulk_wgrad),
        )
        refuse_unless(cls, "checkpoint", isinstance(checkpoint, bool), checkpoint, "a bool")
        self.checkpoint = checkpoint
        refuse_unless(cls, "return_layernorm_output", isinstance(return_layernorm_output, bool),
                      return_layernorm_output, "a bool")
        refuse_unless(cls, "return_layernorm_output_gathered", return_layernorm_output_gathered is False,
                      return_layernorm_output_gathered, "False: ln_out is this rank's, before the all-gather")
        refuse_unless(cls, "set_parallel_mode", isinstance(set_parallel_mode, bool), set_parallel_mode, "a bool")
        refuse_unless(cls, "activation", activation in ACTIVATIONS, activation, f"one of {sorted(ACTIVATIONS)}")
        if activation_params is not None:
            ok = activation == "clamped_swiglu" and isinstance(activation_params, dict) \
                and set(activation_params) <= {"limit", "alpha"}
            refuse_unless(cls, "activation_params", ok, activation_params,
                          "None, or {'limit', 'alpha'} for activation='clamped_swiglu'")
        check_norm_args(cls, normalization, eps, zero_centered_gamma)
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.activation = activation
        self.return_layernorm_output = return_layernorm_output
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.set_parallel_mode = set_parallel_mode
        self.tp_group, self.tp_size = tp_group, tp
        self.sequence_parallel = tp > 1 and sequence_parallel
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        init1 = init_fn(init_method, get_rng_state_tracker, None)
        init2 = init_fn(output_layer_init_method, get_rng_state_tracker, None)
        parallel = set_parallel_mode and tp > 1
        block = _layers_mlp.LayerNormMLP(
            hidden_size, ffn_hidden_size, tp_group=tp_group if parallel else None,
            sequence_parallel=self.sequence_parallel and parallel, normalization=normalization, eps=eps,
            activation=activation, activation_params=activation_params, bias=bias, init_method=init1,
            output_init_method=init2, seed=None, overlap=no_overlap(), dtype=dtype, device=device,
            zero_centered_gamma=zero_centered_gamma, return_bias=return_bias,
            return_layernorm_output=return_layernorm_output, shard_init=True,
            accumulate_into_main_grad=fuse_wgrad_accumulation, sync_sequence_parallel_grads=False)
        fc1, fc2 = block.fc1, block.fc2
        params = {"layer_norm_weight": (fc1.norm, "weight")}
        if normalization == "LayerNorm":
            params["layer_norm_bias"] = (fc1.norm, "bias")
        params["fc1_weight"] = (fc1.linear, "weight")
        if bias:
            params["fc1_bias"] = (fc1.bias, "bias")
        params["fc2_weight"] = (fc2.linear, "weight")
        if bias:
            params["fc2_bias"] = (block.fc2_bias_op if return_bias else fc2.bias, "bias")
        self._bind(block, params, {"fc1": fc1.linear, "fc2": fc2.linear})
        self._delay_wgrad([fc1.linear, fc2.linear], delay_wgrad_compute, ["fc1_weight", "fc2_weight"])
        self.__dict__["_inits"] = {"fc1_weight": init1, "fc2_weight": init2}
        if normalization == "RMSNorm":
            self.layer_norm_bias = None
        if not bias:
            # TE's attributes without biases.
            self.fc1_bias = torch.empty(0, device=device, dtype=dtype)
            self.fc2_bias = torch.empty(0, device=device, dtype=dtype)
        for name in ("layer_norm_weight", "layer_norm_bias"):
            if isinstance(getattr(self, name), torch.nn.Parameter):
                getattr(self, name).sequence_parallel = self.sequence_parallel  # TE's tag, for Megatron
        set_megatron_attrs(self.fc1_weight, set_parallel_mode, 0)
        set_megatron_attrs(self.fc2_weight, set_parallel_mode, 1)
        if isinstance(self.fc1_bias, torch.nn.Parameter):
            set_megatron_attrs(self.fc1_bias, set_parallel_mode, 0)
        if isinstance(self.fc2_bias, torch.nn.Parameter):
            self.fc2_bias.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """``y`` (``(y, fc2_bias)`` with ``return_bias``; ``ln_out`` appended with
        ``return_layernorm_output``)."""
        if self.checkpoint and torch.is_grad_enabled():
            return tp_checkpoint(self._run, inp, is_first_microbatch, modules=[self._ops])
        return self._run(inp, is_first_microbatch)
