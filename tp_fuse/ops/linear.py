"""``Linear``: a container of ``BasicLinear`` and ``Bias`` (y = x W^T + b), with the
collectives its tensor-parallel mode implies."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .basic.basic_linear import BasicLinear
from .basic.bias import Bias
from .op import FusedOperation

# Where a row-parallel Linear adds its bias (``row_parallel_bias``).
PER_RANK = "per_rank"  # Transformer Engine: each rank's bias before the reduction
AFTER_REDUCTION = "after_reduction"  # Megatron-LM: one bias after the reduction
ROW_PARALLEL_BIAS_CHOICES = (PER_RANK, AFTER_REDUCTION)


class Linear(FusedOperation):
    """Linear layer as a run of basic ops, like Transformer Engine's ``ops.Linear``.

    Shapes: ``x [..., in_features] -> y [..., out_features]``. Inside a
    ``Sequential`` it is flattened into ``BasicLinear`` (+ ``Bias``) and the
    tensor-parallel collectives, so that the GEMM and the bias can fuse with their
    neighbours (activations, residual adds, tensor-parallel communication):

    ==========================  ==================================================
    no TP / column              ``[AllGather (SP)?, BasicLinear, Bias]`` (bias sharded
                                with the output features)
    row (default, TE)           ``[BasicLinear, Bias, ReduceScatter (SP) | AllReduce]``
    row, ``"after_reduction"``  ``[BasicLinear, ReduceScatter | AllReduce, Bias]``
    ==========================  ==================================================

    Row-parallel bias (``tensor_parallel_mode="row"``, TP size ``tp``, rank ``r`` holding
    ``x_r [s, in/tp]``, ``W_r [out, in/tp]`` and its own ``b_r [out]``):

    * ``row_parallel_bias="per_rank"`` (default; Transformer Engine's semantics, its
      ``Bias(out * tp, tensor_parallel=True)``): forward
      ``y = sum_r (x_r W_r^T + b_r)`` (then this rank's rows under sequence
      parallelism); the bias gradient of every rank is the sum of ``dy`` over the WHOLE
      sequence (``db_r = sum_rows dy``; the reduce-scatter's backward gathers ``dy``
      first), so no gradient reduction is left to the optimizer. The bias is a
      per-rank parameter: only ``sum_r b_r`` acts on the output.
    * ``row_parallel_bias="after_reduction"`` (Megatron-LM's ``RowParallelLinear``; what
      ``tp_fuse.layers`` builds): ``y = sum_r x_r W_r^T + b`` with one replicated ``b``.
      Under sequence parallelism a rank's bias gradient covers only its sequence shard
      (the bias carries Megatron's ``sequence_parallel=True`` tag: summing it over the
      TP group is the optimizer's job, as for every such Megatron parameter).

    The overlap fusions take the per-rank bias into the GEMM epilogue
    (``[BasicLinear, Bias, ReduceScatter|AllReduce]``); with ``"after_reduction"`` they
    fuse ``[BasicLinear, ReduceScatter|AllReduce]`` and the bias runs after.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        userbuffers_options: Optional[dict[str, Any]] = None,
        accumulate_into_main_grad: bool = False,
        tensor_parallel_mode: Optional[str] = None,
        tensor_parallel_group: Optional[Any] = None,
        sequence_parallel: bool = False,
        row_parallel_bias: str = PER_RANK,
    ) -> None:
        if row_parallel_bias not in ROW_PARALLEL_BIAS_CHOICES:
            raise ValueError(
                f"Linear: row_parallel_bias must be one of {ROW_PARALLEL_BIAS_CHOICES} "
                f"('per_rank': Transformer Engine, bias added on every rank before the reduction; "
                f"'after_reduction': Megatron-LM, one bias after it), got {row_parallel_bias!r}"
            )
        linear = BasicLinear(
            in_features,
            out_features,
            device=device,
            dtype=dtype,
            userbuffers_options=userbuffers_options,
            accumulate_into_main_grad=accumulate_into_main_grad,
            tensor_parallel_mode=tensor_parallel_mode,
            tensor_parallel_group=tensor_parallel_group,
            sequence_parallel=sequence_parallel,
        )
        expanded: list = linear.expanded_ops()  # [pre collectives, linear, post collectives]
        at = expanded.index(linear)
        pre, post = expanded[:at], expanded[at + 1:]
        bias_op: Optional[Bias] = None
        if bias:
            # Local size either way: column parallel shards the bias with the output
            # features; a row-parallel rank adds a full-width [out] vector (its own, per
            # rank, or the replicated one after the reduction).
            bias_op = Bias(linear.out_features, device=device, dtype=dtype or linear.weight.dtype)
        if bias_op is None:
            ops = [*pre, linear, *post]
        elif tensor_parallel_mode == "row" and row_parallel_bias == AFTER_REDUCTION:
            ops = [*pre, linear, *post, bias_op]
        else:
            ops = [*pre, linear, bias_op, *post]
        super().__init__(ops)
        self.row_parallel_bias = row_parallel_bias
        # Registered as submodules (unlike fusion results): the container owns them.
        self.basic_linear = linear
        self.bias_op = bias_op
        if bias_op is not None and tensor_parallel_mode == "row" and row_parallel_bias == AFTER_REDUCTION \
                and sequence_parallel:
            # Added once after the reduction to this rank's rows: its gradient is partial.
            bias_op.bias.sequence_parallel = True

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.basic_linear.weight

    @property
    def bias(self) -> Optional[torch.nn.Parameter]:
        return None if self.bias_op is None else self.bias_op.bias

    @property
    def in_features(self) -> int:
        return self.basic_linear.in_features

    @property
    def out_features(self) -> int:
        return self.basic_linear.out_features

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.basic_linear.tensor_parallel_mode == "row" and self.bias_op is not None:
            text += f", row_parallel_bias={self.row_parallel_bias!r}"
        return text
