"""``BasicLinear``'s tensor parallelism (Transformer Engine's ``tensor_parallel_mode``): the
argument checks, the collectives the op stands for (``expanded_ops``) and the dgrad all-reduce
of column parallelism without sequence parallelism."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tp_fuse.comm import all_reduce

from ..op import BasicOperation
from ._checks import maybe_dequantize
from ._tp import TPCommOperation, group_size
from .all_gather import AllGather
from .all_reduce import AllReduce
from .reduce_scatter import ReduceScatter

__all__ = ["LinearTensorParallelMixin"]


class LinearTensorParallelMixin:
    """The tensor-parallel part of ``BasicLinear`` (see its class docstring)."""

    def _setup_tensor_parallel(
        self, in_features: int, out_features: int, mode: Optional[str], group: Any, sequence_parallel: bool
    ) -> tuple[int, int]:
        """Validate the TP arguments; build the comm ops; return the local GEMM sizes."""
        if mode not in (None, "column", "row"):
            raise ValueError(f"BasicLinear: tensor_parallel_mode must be None, 'column' or 'row', got {mode!r}")
        if mode is None and (group is not None or sequence_parallel):
            raise ValueError("BasicLinear: tensor_parallel_group/sequence_parallel need tensor_parallel_mode")
        self.tensor_parallel_mode = mode
        self.tensor_parallel_group = group
        self.sequence_parallel = bool(sequence_parallel)
        tp = group_size(group) if mode is not None else 1
        self.tensor_parallel_size = tp
        self.global_in_features, self.global_out_features = in_features, out_features
        split = out_features if mode == "column" else in_features
        if split % tp:
            name = "out_features" if mode == "column" else "in_features"
            raise ValueError(f"BasicLinear({mode} parallel): {name}={split} is not divisible by the TP size {tp}")
        pre: list[TPCommOperation] = []
        post: list[TPCommOperation] = []
        if mode == "column" and sequence_parallel:
            pre.append(AllGather(group))
        elif mode == "row":
            post.append(ReduceScatter(group) if sequence_parallel else AllReduce(group))
        # Plain attributes (not submodules): the comm ops hold no state of their own.
        self.__dict__["_tp_ops"] = (tuple(pre), tuple(post))
        # Column parallel without sequence parallelism: the input is replicated, so its
        # gradient is the sum of every rank's dgrad (Megatron's copy-to-TP-region).
        self.reduces_dgrad = mode == "column" and not sequence_parallel and tp > 1
        if mode == "column":
            return in_features, out_features // tp
        if mode == "row":
            return in_features // tp, out_features
        return in_features, out_features

    def expanded_ops(self) -> list[BasicOperation]:
        """This op with the collectives its ``tensor_parallel_mode`` implies:
        column+SP ``[AllGather, BasicLinear]``, row ``[BasicLinear, ReduceScatter|AllReduce]``
        -- ordinary comm ops, so the userbuffers overlap fusions apply to them."""
        pre, post = self.__dict__.get("_tp_ops", ((), ()))
        return [*pre, self, *post]

    @property
    def local_in_features(self) -> int:
        """Input features of this rank's GEMM (= ``in_features``; see the class docstring)."""
        return self.in_features

    @property
    def local_out_features(self) -> int:
        """Output features of this rank's GEMM (= ``out_features``)."""
        return self.out_features

    def reduce_dgrad(self, dx: torch.Tensor) -> torch.Tensor:
        """dx summed over the TP group when the input was replicated (column, no SP)."""
        if not self.reduces_dgrad:
            return dx
        return all_reduce(maybe_dequantize(dx).contiguous(), self.tensor_parallel_group)
