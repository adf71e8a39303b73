"""``Linear``: a container of ``BasicLinear`` and ``Bias`` (y = x W^T + b)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .basic.basic_linear import BasicLinear
from .basic.bias import Bias
from .op import FusedOperation


class Linear(FusedOperation):
    """Linear layer as a pair of basic ops, like Transformer Engine's ``ops.Linear``.

    Shapes: ``x [..., in_features] -> y [..., out_features]``. Inside a
    ``Sequential`` it is flattened into ``BasicLinear`` (+ ``Bias``) so that the
    GEMM and the bias can fuse with their neighbours (activations, residual
    adds, tensor-parallel communication).
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
    ) -> None:
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
        ops: list = linear.expanded_ops()  # with its TP collectives, if any
        if bias:
            # Local size: column parallel shards the bias with the output features; row
            # parallel adds the full bias after the reduction (its collective comes first
            # in expanded_ops()).
            ops.append(Bias(linear.out_features, device=device, dtype=dtype or linear.weight.dtype))
        super().__init__(ops)
        # Registered as submodules (unlike fusion results): the container owns them.
        self.basic_linear = linear
        self.bias_op = ops[-1] if bias else None
        if bias and tensor_parallel_mode == "row" and sequence_parallel:
            # Each rank adds the bias to its sequence shard, so its gradient is partial:
            # summing it over the TP group is the optimizer's job, as for every
            # Megatron parameter flagged sequence_parallel.
            self.bias_op.bias.sequence_parallel = True

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
