"""``LayerNormMLP``: Transformer Engine's ``transformer_engine.pytorch.LayerNormMLP`` module
on tp_fuse's ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from tp_fuse import ops as _ops
from tp_fuse.ops.basic.make_extra_output import MakeExtraOutput
from tp_fuse.ops.sequential import Sequential
from ._ops_module import OpsModule, check_common_args, init_fn, norm_op, refuse_unless, set_megatron_attrs
from .linear import linear_ops

__all__ = ["LayerNormMLP"]

#: TE's activation names -> (tp_fuse op class name, gated: fc1 produces 2 * ffn_hidden_size).
ACTIVATIONS = {
    "gelu": ("GELU", False), "qgelu": ("QGELU", False), "relu": ("ReLU", False),
    "srelu": ("SReLU", False), "silu": ("SiLU", False),
    "geglu": ("GEGLU", True), "qgeglu": ("QGEGLU", True), "reglu": ("ReGLU", True),
    "sreglu": ("SReGLU", True), "swiglu": ("SwiGLU", True), "glu": ("GLU", True),
    "clamped_swiglu": ("ClampedSwiGLU", True),
}


class LayerNormMLP(OpsModule):
    """``fc2(act(fc1(norm(x))))`` with Transformer Engine's ``LayerNormMLP`` constructor,
    parameter names (``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
    ``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias``) and
    ``forward(inp, is_first_microbatch=None)``.

    Inside: ``tp_fuse.ops.Sequential(norm, MakeExtraOutput?, BasicLinear, Bias, activation,
    BasicLinear, Bias)``; with ``set_parallel_mode=True`` fc1 is column parallel and fc2 row
    parallel over ``tp_group`` (fc2's bias after the reduction, as in TE). The two GEMMs join
    the debug API as ``<name>.fc1`` and ``<name>.fc2`` (TE's debug names).

    ``activation``: TE's names (gelu (tanh), qgelu, relu, srelu, silu, geglu, qgeglu, reglu,
    sreglu, swiglu, glu, clamped_swiglu with ``activation_params={"limit", "alpha"}``).
    ``init_method`` initializes fc1, ``output_layer_init_method`` fc2 (both default
    ``normal_(0, 0.023)``). ``return_bias`` returns fc2's bias instead of adding it;
    ``return_layernorm_output`` appends the normalized input. ``seq_length`` /
    ``micro_batch_size`` only size TE's userbuffers (refused here), so they have no effect.

    Refused (ValueError naming the argument): ``checkpoint=True``,
    ``return_layernorm_output_gathered=True``, other ``activation_params``, and what
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
        refuse_unless(cls, "checkpoint", checkpoint is False, checkpoint,
                      "False: recompute with tp_fuse.checkpoint around the module")
        refuse_unless(cls, "return_layernorm_output", isinstance(return_layernorm_output, bool),
                      return_layernorm_output, "a bool")
        refuse_unless(cls, "return_layernorm_output_gathered", return_layernorm_output_gathered is False,
                      return_layernorm_output_gathered, "False: ln_out is this rank's, before the all-gather")
        refuse_unless(cls, "set_parallel_mode", isinstance(set_parallel_mode, bool), set_parallel_mode, "a bool")
        refuse_unless(cls, "activation", activation in ACTIVATIONS, activation, f"one of {sorted(ACTIVATIONS)}")
        op_name, gated = ACTIVATIONS[activation]
        act_kwargs: dict[str, Any] = {}
        if activation_params is not None:
            ok = activation == "clamped_swiglu" and isinstance(activation_params, dict) \
                and set(activation_params) <= {"limit", "alpha"}
            refuse_unless(cls, "activation_params", ok, activation_params,
                          "None, or {'limit', 'alpha'} for activation='clamped_swiglu'")
            act_kwargs = dict(activation_params)
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
        norm, params = norm_op(cls, normalization, hidden_size, eps, zero_centered_gamma, device, dtype,
                               self.sequence_parallel)
        common = dict(device=device, dtype=dtype, tp_group=tp_group, tp_size=tp,
                      sequence_parallel=sequence_parallel, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        init1 = init_fn(init_method, get_rng_state_tracker, None)
        init2 = init_fn(output_layer_init_method, get_rng_state_tracker, None)
        fc1_ops, fc1, fc1_bias_op, _ = linear_ops(
            cls, hidden_size, ffn_hidden_size * (2 if gated else 1), bias=bias, apply_bias=bias,
            init=init1,
            parallel_mode="column" if set_parallel_mode else None, **common)
        fc2_ops, fc2, fc2_bias_op, fc2_bias = linear_ops(
            cls, ffn_hidden_size, hidden_size, bias=bias, apply_bias=self.apply_bias,
            init=init2,
            parallel_mode="row" if set_parallel_mode else None, **common)
        act = getattr(_ops, op_name)(**act_kwargs)
        params["fc1_weight"] = (fc1, "weight")
        if fc1_bias_op is not None:
            params["fc1_bias"] = (fc1_bias_op, "bias")
        params["fc2_weight"] = (fc2, "weight")
        if fc2_bias_op is not None:
            params["fc2_bias"] = (fc2_bias_op, "bias")
        extra = [MakeExtraOutput()] if return_layernorm_output else []
        self._bind(Sequential(norm, *extra, *fc1_ops, act, *fc2_ops), params, {"fc1": fc1, "fc2": fc2})
        self.__dict__["_inits"] = {"fc1_weight": init1, "fc2_weight": init2}
        if normalization == "RMSNorm":
            self.layer_norm_bias = None
        if fc1_bias_op is None:
            self.fc1_bias = torch.empty(0, device=device, dtype=dtype)
        if fc2_bias_op is None:
            self.fc2_bias = fc2_bias
        set_megatron_attrs(self.fc1_weight, set_parallel_mode, 0)
        set_megatron_attrs(self.fc2_weight, set_parallel_mode, 1)
        if isinstance(self.fc1_bias, torch.nn.Parameter):
            set_megatron_attrs(self.fc1_bias, set_parallel_mode, 0)
        if isinstance(self.fc2_bias, torch.nn.Parameter):
            self.fc2_bias.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """``y`` (``(y, fc2_bias)`` with ``return_bias``; ``ln_out`` appended with
        ``return_layernorm_output``)."""
        result = self._run(inp, is_first_microbatch)
        out, ln_out = result if self.return_layernorm_output else (result, None)
        ret: tuple = (out,)
        if self.return_bias:
            ret += (self.fc2_bias.to(out.dtype),)
        if self.return_layernorm_output:
            ret += (ln_out,)
        return ret[0] if len(ret) == 1 else ret
