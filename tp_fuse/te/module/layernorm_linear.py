"""``LayerNormLinear``: Transformer Engine's ``transformer_engine.pytorch.LayerNormLinear``
module on tp_fuse's ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from tp_fuse.layers import layernorm_linear as _layers_lnl
from ._ops_module import (
    OpsModule,
    check_common_args,
    check_norm_args,
    init_fn,
    refuse_unless,
    set_megatron_attrs,
    split_sizes,
)
from .linear import no_overlap

__all__ = ["LayerNormLinear"]


class LayerNormLinear(OpsModule):
    """``y = norm(x) W^T + b`` with Transformer Engine's ``LayerNormLinear`` constructor,
    parameter names (``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
    ``weight``, ``bias``) and ``forward(inp, is_first_microbatch=None)``.

    A constructor over the one block, :class:`tp_fuse.layers.LayerNormLinear` (its forward:
    ``[norm, MakeExtraOutput (ln_out)?, AllGather | Copy (column parallel), BasicLinear,
    Bias?]``), built with TE's init (on this rank's shard) and sequence-parallel gradients
    left to Megatron; with ``return_bias`` the bias is a parameter of no op, returned.
    Arguments as :class:`~tp_fuse.module.Linear`'s, plus ``eps``, ``normalization``
    (``"LayerNorm"`` / ``"RMSNorm"``), ``zero_centered_gamma`` and ``return_layernorm_output``
    (``forward`` returns ``(y, ln_out)``, or ``(y, bias, ln_out)`` with ``return_bias``;
    ``ln_out`` is this rank's normalized input, before any all-gather).
    ``parameters_split`` as :class:`~tp_fuse.module.Linear`'s (TE's ``query_weight`` /
    ``key_weight`` / ``value_weight`` of a ``MultiheadAttention`` without ``fuse_qkv_params``).

    Refused (ValueError naming the argument): ``parallel_mode="row"``,
    ``return_layernorm_output_gathered=True``, and what :class:`~tp_fuse.module.Linear` refuses.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Optional[Union[tuple[str, ...], dict[str, int]]] = None,
        zero_centered_gamma: bool = False,
        device: Optional[Union[torch.device, str]] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(name)
        cls = "LayerNormLinear"
        tp = check_common_args(
            cls, sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=None,
            parameters_split=parameters_split, delay_wgrad_compute=delay_wgrad_compute,
            symmetric_ar_type=symmetric_ar_type, device=device, params_dtype=params_dtype,
            return_bias=return_bias, bias=bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            ub=dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                    ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                    ub_bulk_wgrad=ub_bulk_wgrad),
        )
        refuse_unless(cls, "parallel_mode", parallel_mode in (None, "column"), parallel_mode, "None or 'column'")
        refuse_unless(cls, "return_layernorm_output", isinstance(return_layernorm_output, bool),
                      return_layernorm_output, "a bool")
        refuse_unless(cls, "return_layernorm_output_gathered", return_layernorm_output_gathered is False,
                      return_layernorm_output_gathered, "False: ln_out is this rank's, before the all-gather")
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.parallel_mode, self.tp_group, self.tp_size = parallel_mode, tp_group, tp
        self.sequence_parallel = tp > 1 and sequence_parallel
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.ub_name = ub_name
        check_norm_args(cls, normalization, eps, zero_centered_gamma)
        init = init_fn(init_method, get_rng_state_tracker, None)
        parallel = parallel_mode == "column" and tp > 1
        block = _layers_lnl.LayerNormLinear(
            in_features, out_features, tp_group=tp_group if parallel else None,
            sequence_parallel=self.sequence_parallel and parallel, normalization=normalization, eps=eps,
            bias=self.apply_bias, init_method=init, seed=None, comm_name=None, overlap=no_overlap(),
            dtype=dtype, device=device, zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=return_layernorm_output, shard_init=True,
            accumulate_into_main_grad=fuse_wgrad_accumulation, sync_sequence_parallel_grads=False)
        ops = block.ops
        linear = ops.linear
        self.out_features = linear.out_features
        params = {"layer_norm_weight": (ops.norm, "weight")}
        if normalization == "LayerNorm":
            params["layer_norm_bias"] = (ops.norm, "bias")
        params["weight"] = (linear, "weight")
        if self.apply_bias:
            params["bias"] = (ops.bias, "bias")
        self._bind(block, params, {"": linear})
        self._delay_wgrad([linear], delay_wgrad_compute, ["weight"])
        self.__dict__["_inits"] = {"weight": init}
        if normalization == "RMSNorm":
            self.layer_norm_bias = None
        if self.return_bias and bias:
            # TE: returned, added by the caller; a parameter of no op.
            self.bias = torch.nn.Parameter(torch.zeros(linear.out_features, device=device, dtype=dtype))
        elif not bias:
            self.bias = torch.empty(0, device=device, dtype=dtype)  # TE's attribute without a bias
        for name in ("layer_norm_weight", "layer_norm_bias"):
            if isinstance(getattr(self, name), torch.nn.Parameter):
                getattr(self, name).sequence_parallel = self.sequence_parallel  # TE's tag, for Megatron
        set_megatron_attrs(self.weight, parallel_mode is not None, 0)
        if isinstance(self.bias, torch.nn.Parameter):
            set_megatron_attrs(self.bias, parallel_mode is not None, 0)
        parts = split_sizes(cls, parameters_split, out_features, tp, parallel_mode == "column" and tp > 1)
        if parts is not None:
            # TE's parameters_split: query_weight / key_weight / value_weight (and biases).
            self._split("weight", parts, "weight")
            if "bias" in self._param_map:
                self._split("bias", parts, "bias")

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        """``y`` (``(y, bias)`` with ``return_bias``; ``ln_out`` appended with
        ``return_layernorm_output``). ``fp8_output`` / ``fp8_grad`` are refused."""
        refuse_unless("LayerNormLinear.forward", "fp8_output", not fp8_output, fp8_output, "False")
        refuse_unless("LayerNormLinear.forward", "fp8_grad", not fp8_grad, fp8_grad, "False")
        result = self._run(inp, is_first_microbatch)
        out, ln_out = result if self.return_layernorm_output else (result, None)
        ret: tuple = (out,)
        if self.return_bias:
            ret += (self.bias.to(out.dtype),)
        if self.return_layernorm_output:
            ret += (ln_out,)
        return ret[0] if len(ret) == 1 else ret
