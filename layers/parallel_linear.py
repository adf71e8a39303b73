"""Column- and row-parallel linear layers with Megatron-LM's interface, made of tp_fuse ops.

Both take GLOBAL sizes (``input_size``, ``output_size``) and return
``(output, bias_or_None)`` exactly like ``megatron.core.tensor_parallel``'s layers, so
Megatron-style model code runs unchanged on them (and ``tp_fuse.layers.wrap`` can swap them in
for Megatron's). Inside, each is one ``tp_fuse.ops.Sequential``:

=========================  =====================================================
ColumnParallelLinear        ``[AllGather (SP) | CopyToTensorParallelRegion, BasicLinear, Bias]``
RowParallelLinear           ``[ScatterToTensorParallelRegion?, BasicLinear, ReduceScatter (SP) | AllReduce, Bias]``
=========================  =====================================================

so the overlap fusions (``[AllGather, BasicLinear(, Bias)]``, ``[BasicLinear,
ReduceScatter]``, ``[BasicLinear, AllReduce]``) apply without any code here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.ops import Bias, Sequential
from tp_fuse.overlap.config import TPOverlap

from ._common import (
    GemmName,
    InitMethod,
    ParallelContext,
    bias_op,
    column_parallel_ops,
    row_parallel_ops,
)
from .sharding import ShardSpec, normal_init
from .tp_regions import GatherFromTensorParallelRegion

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class _ParallelLinear(torch.nn.Module):
    """What both layers share: Megatron's attributes, and ``weight``/``bias`` as views of
    the ops (with ``skip_bias_add`` the bias lives in ``bias_op``, outside the Sequential)."""

    ops: Sequential
    bias_op: Optional[Bias]

    def _set_attributes(self, ctx: ParallelContext, input_size: int, output_size: int, skip_bias_add: bool) -> None:
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = bool(skip_bias_add)
        self.sequence_parallel = ctx.sequence_parallel
        self.tp_group = ctx.tp_group
        self.tp_size = ctx.tp_size

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.ops.linear.weight

    @property
    def bias(self) -> Optional[torch.nn.Parameter]:
        if self.bias_op is not None:
            return self.bias_op.bias
        return self.ops.bias.bias if "bias" in self.ops._modules else None

    def _repr_prefix(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, tp={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, ")


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A [output_size, input_size]`` split by rows (output features).

    Shapes (``tp`` = size of ``tp_group``, activations ``[s, b, h]``):
        input:  ``[s, b, input_size]``, or ``[s/tp, b, input_size]`` with ``sequence_parallel``
        output: ``[s, b, output_size/tp]``, or ``[s, b, output_size]`` with ``gather_output``
        weight: ``[output_size/tp, input_size]``; bias ``[output_size/tp]``

    Args:
        input_size, output_size: global GEMM sizes.
        tp_group: TP process group (None: no tensor parallelism).
        bias: create a bias (zero-initialized).
        gather_output: all-gather the output's last dim so every rank has all features.
        skip_bias_add: do not add the bias; return it as the second output.
        sequence_parallel: the input is split along the sequence over the TP ranks and
            all-gathered before the GEMM.
        init_method: callable applied to the FULL ``[output_size, input_size]`` weight
            (default N(0, 0.02^2)); this rank keeps its rows, so shards are slices of the
            TP=1 weight.
        seed: seed of the weight init (None: torch's global RNG, as in Megatron).
        comm_name: GEMM name for the overlap configuration (``"qkv"``, ``"fc1"``, ...).
        overlap: overlap configuration passed to the GEMM's ``userbuffers_options``.
        shard_init, accumulate_into_main_grad: the
            :class:`~tp_fuse.layers._common.ParallelContext` options ``shard_init`` / ``main_grad``
            (Transformer Engine's init and ``fuse_wgrad_accumulation``; ``tp_fuse.te``'s
            ``Linear`` is built on these layers with them).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        comm_name: GemmName = None,
        overlap: Optional[TPOverlap] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        shard_init: bool = False,
        accumulate_into_main_grad: bool = False,
    ) -> None:
        super().__init__()
        _check_sizes("ColumnParallelLinear", input_size, output_size)
        ctx = ParallelContext(tp_group, sequence_parallel, dtype, _device(device), overlap, seed,
                              shard_init=shard_init, main_grad=accumulate_into_main_grad)
        self._set_attributes(ctx, input_size, output_size, skip_bias_add)
        self.output_size_per_partition = output_size // max(ctx.tp_size, 1)
        self.gather_output = bool(gather_output)
        ops = column_parallel_ops(
            ctx, input_size, output_size, bias=bias and not skip_bias_add, comm_name=comm_name,
            init_method=init_method or normal_init(0.02),
        )
        self.ops = Sequential(ops)
        # skip_bias_add: the bias lives outside the Sequential and is returned to the caller.
        self.bias_op: Optional[Bias] = None
        if bias and skip_bias_add:
            self.bias_op = bias_op(ctx, self.output_size_per_partition, ShardSpec(dim=0),
                                   sequence_parallel_partial=False)
        self._gather = GatherFromTensorParallelRegion(tp_group) if ctx.tp_size > 1 else None

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is not None:
            raise ValueError(
                "ColumnParallelLinear: passing `weight` to forward (Megatron's "
                "skip_weight_param_allocation) is not supported; the layer owns its weight"
            )
        out = self.ops(input_)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self._gather is not None:
            out = self._gather(out)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return self._repr_prefix() + f"gather_output={self.gather_output}, skip_bias_add={self.skip_bias_add}"


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A [output_size, input_size]`` split by columns (input features).

    Shapes:
        input:  ``[s, b, input_size/tp]`` (``input_is_parallel``), else ``[s, b, input_size]``
        output: ``[s, b, output_size]``, or ``[s/tp, b, output_size]`` with ``sequence_parallel``
        weight: ``[output_size, input_size/tp]``; bias ``[output_size]`` (replicated)

    The partial products are summed over the TP group (all-reduce, or reduce-scatter
    along the sequence with ``sequence_parallel``), THEN the bias is added -- once, as in
    Megatron. Under sequence parallelism the bias gradient of one rank covers only its
    sequence shard; it is all-reduced over the TP group during backward unless
    ``sync_sequence_parallel_grads=False`` (for Megatron models whose
    ``finalize_model_grads`` does it; the bias then carries ``sequence_parallel=True``).

    Args: as :class:`ColumnParallelLinear`, plus ``input_is_parallel`` (False: the input
    is full and this rank takes its slice of the last dim; not allowed with SP).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        comm_name: GemmName = None,
        overlap: Optional[TPOverlap] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        sync_sequence_parallel_grads: bool = True,
        shard_init: bool = False,
        accumulate_into_main_grad: bool = False,
    ) -> None:
        super().__init__()
        _check_sizes("RowParallelLinear", input_size, output_size)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (as in Megatron)")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype, _device(device), overlap, seed,
                              shard_init=shard_init, main_grad=accumulate_into_main_grad)
        self._set_attributes(ctx, input_size, output_size, skip_bias_add)
        self.input_size_per_partition = input_size // max(ctx.tp_size, 1)
        self.input_is_parallel = bool(input_is_parallel)
        sync = bool(sync_sequence_parallel_grads)
        ops = row_parallel_ops(
            ctx, input_size, output_size, bias=bias, comm_name=comm_name,
            init_method=init_method or normal_init(0.02), input_is_parallel=input_is_parallel,
            add_bias=not skip_bias_add, sync_bias_grad=sync,
        )
        self.bias_op: Optional[Bias] = None
        if bias and skip_bias_add:
            # The caller adds it to the (sequence-sharded, under SP) reduced output.
            self.bias_op = bias_op(ctx, output_size, None, sequence_parallel_partial=sequence_parallel and sync)
        if not sync:
            bias_param = self.bias_op.bias if self.bias_op is not None else (ops["bias"].bias if "bias" in ops else None)
            if bias_param is not None:
                bias_param.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]  # Megatron's tag
        self.ops = Sequential(ops)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        out = self.ops(input_)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return self._repr_prefix() + f"input_is_parallel={self.input_is_parallel}, skip_bias_add={self.skip_bias_add}"


def _check_sizes(layer: str, input_size: int, output_size: int) -> None:
    for name, value in (("input_size", input_size), ("output_size", output_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")


def _device(device: Optional[torch.device | str]) -> Optional[torch.device]:
    return torch.device(device) if device is not None else None
