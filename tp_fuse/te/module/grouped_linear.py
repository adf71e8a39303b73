"""``GroupedLinear``: Transformer Engine's module ``transformer_engine.pytorch.GroupedLinear``
(``num_gemms`` linears over consecutive row groups, e.g. MoE experts) as a thin constructor over
``tp_fuse.ops.GroupedLinear``.

TE's signature ``GroupedLinear(num_gemms, in_features, out_features, sequence_parallel=False,
fuse_wgrad_accumulation=False, tp_group=None, tp_size=1, get_rng_state_tracker=None,
rng_tracker_name=None, init_method=None, bias=True, return_bias=False, params_dtype=None,
parallel_mode=None, device="cuda", ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None,
delay_wgrad_compute=False, save_original_input=False, name=None)``, parameters ``weight{i}``
``[out, in]`` and ``bias{i}`` ``[out]``, and ``forward(inp, m_splits, is_first_microbatch=None)``:
``inp [M, in]`` with ``M = sum(m_splits)`` -> ``[M, out]`` (with ``return_bias``: ``(out,
[bias_i])``, the biases not added).

Refused (ValueError naming the argument): tensor parallelism (``parallel_mode`` "column"/"row"
with a TP size above 1: Megatron's expert-parallel GEMMs then need TE's sharded weights),
the ``ub_*`` flags, ``save_original_input``. ``delay_wgrad_compute=True`` defers the weight
gradients to ``backward_dw()`` (``ops.GroupedLinear``'s deferral; the bias gradients stay in
the backward pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from tp_fuse.ops.basic.grouped_linear import GroupedLinear as GroupedLinearOp
from tp_fuse.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported
from ._ops_module import OpsModule, init_fn, refuse_unless, set_megatron_attrs

__all__ = ["GroupedLinear", "is_module_grouped_tensor_path_supported"]


#: TE's module-level name of its grouped-tensor GEMM path predicate: tp_fuse has no such path
#: (one GEMM per group), so the answer is the op layer's, always False.
is_module_grouped_tensor_path_supported = is_op_fuser_grouped_tensor_path_supported


class GroupedLinear(OpsModule):
    """TE's ``GroupedLinear`` module (see the module docstring)."""

    def __init__(
        self,
        num_gemms: int,
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
        device: Optional[Union[torch.device, str]] = None,
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(name)
        cls = "GroupedLinear"
        if tp_group is not None:
            tp_size = tp_group.size()
        refuse_unless(cls, "parallel_mode", parallel_mode in (None, "column", "row"), parallel_mode,
                      "None, 'column' or 'row'")
        refuse_unless(cls, "tp_size", tp_size == 1 or parallel_mode is None, tp_size,
                      "1: tensor-parallel grouped GEMMs are not implemented")
        for arg, value in (("ub_overlap_rs", ub_overlap_rs), ("ub_overlap_ag", ub_overlap_ag),
                           ("save_original_input", save_original_input)):
            refuse_unless(cls, arg, value is False, value, "False")
        for arg, value in (("bias", bias), ("return_bias", return_bias),
                           ("fuse_wgrad_accumulation", fuse_wgrad_accumulation),
                           ("delay_wgrad_compute", delay_wgrad_compute)):
            if not isinstance(value, bool):
                raise ValueError(f"{cls}: {arg} must be a bool, got {value!r}")
        dtype = params_dtype or torch.get_default_dtype()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.parallel_mode, self.tp_group, self.tp_size = parallel_mode, tp_group, tp_size
        self.sequence_parallel = bool(sequence_parallel) and tp_size > 1
        self.fuse_wgrad_accumulation, self.ub_name = fuse_wgrad_accumulation, ub_name
        op = GroupedLinearOp(num_gemms, in_features, out_features, bias=self.apply_bias, device=device, dtype=dtype,
                             accumulate_into_main_grad=fuse_wgrad_accumulation)
        # TE initializes each weight with init_method (default normal(0, 0.023)) in the tracker's fork.
        init = init_fn(init_method, get_rng_state_tracker, rng_tracker_name)
        with torch.no_grad():
            for i in range(num_gemms):
                init(getattr(op, f"weight{i}"))
        params = {f"weight{i}": (op, f"weight{i}") for i in range(num_gemms)}
        if self.apply_bias:
            params.update({f"bias{i}": (op, f"bias{i}") for i in range(num_gemms)})
        self._bind(op, params, {})
        self.__dict__["_op"] = op
        self._delay_wgrad([op], delay_wgrad_compute, [f"weight{i}" for i in range(num_gemms)])
        if bias and return_bias:
            # return_bias: parameters of no op (the caller adds them), as TE's Linear.
            for i in range(num_gemms):
                self.register_parameter(f"bias{i}", torch.nn.Parameter(
                    torch.zeros(out_features, device=device, dtype=dtype)))
        # TE's registration order (parameters(), state_dict()): weight0, bias0, weight1, bias1...
        for name in [n for i in range(num_gemms) for n in (f"weight{i}", f"bias{i}")]:
            if name in self._parameters:
                self._parameters[name] = self._parameters.pop(name)
        for i in range(num_gemms):
            set_megatron_attrs(getattr(self, f"weight{i}"), parallel_mode is not None,
                               1 if parallel_mode == "row" else 0)

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor],
                is_first_microbatch: Optional[bool] = None) -> Any:
        """``[sum(m_splits), in] -> [sum(m_splits), out]``; group ``i`` is the next ``m_splits[i]`` rows."""
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear.forward: m_splits has {len(m_splits)} entries, "
                             f"expected num_gemms={self.num_gemms}")
        splits = m_splits if isinstance(m_splits, torch.Tensor) else torch.tensor(list(m_splits), dtype=torch.int64)
        if is_first_microbatch not in (None, True, False):
            raise ValueError(f"GroupedLinear: is_first_microbatch must be None, True or False, "
                             f"got {is_first_microbatch!r}")
        self._sync()
        out = self._op(inp, splits)
        if self.return_bias:
            biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
            return out, [b.to(out.dtype) for b in biases]
        return out
