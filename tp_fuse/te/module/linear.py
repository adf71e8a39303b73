"""``Linear``: Transformer Engine's ``transformer_engine.pytorch.Linear`` module on tp_fuse's ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from tp_fuse.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from tp_fuse.overlap.config import OverlapConfig, TPOverlap
from ._ops_module import OpsModule, check_common_args, init_fn, refuse_unless, set_megatron_attrs, split_sizes

__all__ = ["Linear", "no_overlap"]


def no_overlap() -> TPOverlap:
    """TE's modules overlap no comm with GEMMs (their ``ub_*`` flags are refused): the layers
    blocks under them get overlap switched off."""
    return TPOverlap(OverlapConfig(enabled=False))


class Linear(OpsModule):
    """``y = x W^T + b`` with Transformer Engine's ``Linear`` constructor, parameter names
    (``weight``, ``bias``) and forward (``forward(inp, is_first_microbatch=None)``); FP8 under
    ``tp_fuse.autocast`` / ``fp8_autocast``.

    A constructor over the one linear block: :class:`tp_fuse.layers.ColumnParallelLinear`
    (``parallel_mode`` None or ``"column"``) or :class:`tp_fuse.layers.RowParallelLinear`
    (``"row"``), built with TE's init (``init_method`` on this rank's shard), bias placement
    (row parallel: after the reduction), ``return_bias`` as the block's ``skip_bias_add``, and
    sequence-parallel gradients left to Megatron (tagged ``sequence_parallel``); the forward
    is the block's. The block's parameters carry TE's names here (see
    :mod:`tp_fuse.te.module._ops_module`).

    Arguments as in TE: ``in_features``, ``out_features`` (global sizes; ``parallel_mode``
    ``"column"`` splits ``out_features``, ``"row"`` ``in_features`` over ``tp_group``),
    ``bias``, ``return_bias`` (``forward`` returns ``(y, bias)`` and adds no bias),
    ``init_method`` (default ``normal_(0, 0.023)``, TE's), ``get_rng_state_tracker`` /
    ``rng_tracker_name``, ``params_dtype``, ``device`` (None: torch's default device; TE's
    default is ``"cuda"``), ``name`` (the debug layer name: the GEMM joins nvdlfw-inspect's
    debug API under it, as ``ops.BasicLinear``'s ``name`` does), ``tp_group`` / ``tp_size``,
    ``sequence_parallel`` (with a TP size above 1, as in TE), ``fuse_wgrad_accumulation``
    (dW into ``weight.main_grad``). Row parallel adds the bias after the reduction (TE's
    ``Linear``; under sequence parallelism the bias carries ``sequence_parallel=True``).

    ``parameters_split`` (TE's): a tuple of names (equal parts) or a dict name -> rows splits
    ``weight`` (and ``bias``) into parameters ``<name>_weight`` / ``<name>_bias`` (a trailing
    ``_`` of the name dropped; column parallel: ``rows / tp`` of each per rank), read as their
    concatenation; not with ``return_bias``, ``fuse_wgrad_accumulation`` or
    ``delay_wgrad_compute``.

    ``delay_wgrad_compute=True`` (TE's): the backward pass computes the input (and bias)
    gradient; :meth:`backward_dw` computes the weight gradient (``ops.BasicLinear``'s
    deferral), bit for bit the one the backward pass would have computed.

    Refused (ValueError naming the argument): ``symmetric_ar_type``, the ``ub_*`` overlap flags (use ``tp_fuse.ops`` with overlap),
    ``save_original_input=True``, ``tp_size > 1`` without ``tp_group``, and ``fp8_output`` /
    ``fp8_grad`` in ``forward``. ``is_first_microbatch`` is accepted: TE caches the first
    micro-batch's FP8 weight; tp_fuse quantizes it at each call (same values while the weight
    is unchanged).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Optional[Any] = None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        parameters_split: Optional[Union[tuple[str, ...], dict[str, int]]] = None,
        device: Optional[Union[torch.device, str]] = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: Optional[str] = None,
        save_original_input: bool = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(name)
        cls = "Linear"
        tp = check_common_args(
            cls, sequence_parallel=sequence_parallel, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=rng_tracker_name,
            parameters_split=parameters_split, delay_wgrad_compute=delay_wgrad_compute,
            symmetric_ar_type=symmetric_ar_type, device=device, params_dtype=params_dtype,
            return_bias=return_bias, bias=bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            ub=dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                    ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                    ub_bulk_wgrad=ub_bulk_wgrad),
        )
        refuse_unless(cls, "save_original_input", save_original_input is False, save_original_input,
                      "False: the backward keeps the (quantized) input the GEMM used")
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.parallel_mode = parallel_mode
        self.tp_group = tp_group
        self.tp_size = tp
        self.sequence_parallel = tp > 1 and sequence_parallel
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.ub_name = ub_name
        init = init_fn(init_method, get_rng_state_tracker, rng_tracker_name)
        refuse_unless(cls, "parallel_mode", parallel_mode in (None, "column", "row"), parallel_mode,
                      "None, 'column' or 'row'")
        tp_mode = parallel_mode if tp > 1 else None
        block_args = dict(tp_group=tp_group if tp_mode else None, bias=bias, skip_bias_add=return_bias,
                          sequence_parallel=self.sequence_parallel and tp_mode is not None,
                          init_method=init, seed=None,
                          overlap=no_overlap(), dtype=dtype, device=device, shard_init=True,
                          accumulate_into_main_grad=fuse_wgrad_accumulation)
        if parallel_mode == "row":
            block: Any = RowParallelLinear(in_features, out_features, input_is_parallel=True,
                                           sync_sequence_parallel_grads=False, **block_args)
        else:
            block = ColumnParallelLinear(in_features, out_features, **block_args)
        linear = block.ops.linear
        # TE's Linear: in/out_features are the local sizes after construction.
        self.in_features, self.out_features = linear.in_features, linear.out_features
        params: dict[str, tuple[torch.nn.Module, str]] = {"weight": (linear, "weight")}
        bias_holder = block.bias_op if block.bias_op is not None else block.ops._modules.get("bias")
        if bias_holder is not None:
            params["bias"] = (bias_holder, "bias")
        self._bind(block, params, {"": linear})
        self.__dict__["_inits"] = {"weight": init}
        if bias_holder is None:
            self.bias = torch.empty(0, device=device, dtype=dtype)  # TE's attribute without a bias
        parallel = parallel_mode is not None
        set_megatron_attrs(self.weight, parallel, 1 if parallel_mode == "row" else 0)
        if isinstance(self.bias, torch.nn.Parameter):
            if parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            else:
                set_megatron_attrs(self.bias, parallel, 0)
        parts = split_sizes(cls, parameters_split, out_features, tp, parallel_mode == "column" and tp > 1)
        if parts is not None:
            # TE's parameters_split: query_weight / key_weight / value_weight (and biases).
            self._split("weight", parts, "weight")
            if "bias" in self._param_map:
                self._split("bias", parts, "bias")
        self._delay_wgrad([linear], delay_wgrad_compute, ["weight"])

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        """``y = inp W^T + b`` (``(y, bias)`` with ``return_bias``). ``fp8_output`` /
        ``fp8_grad`` (TE's FP8 tensors between modules) are refused."""
        refuse_unless("Linear.forward", "fp8_output", not fp8_output, fp8_output, "False")
        refuse_unless("Linear.forward", "fp8_grad", not fp8_grad, fp8_grad, "False")
        out, bias = self._run(inp, is_first_microbatch)
        if self.return_bias:
            # Without a bias TE returns its empty bias tensor (the layers block returns None).
            return out, (self.bias if bias is None else bias).to(out.dtype)
        return out
