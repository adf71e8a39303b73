"""``LayerNormLinear``: normalization followed by a column-parallel GEMM (Transformer Engine's name)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.ops import BasicOperation, MakeExtraOutput, Sequential
from tp_fuse.overlap.config import TPOverlap

from ._common import (
    GemmName,
    InitMethod,
    Normalization,
    ParallelContext,
    column_input_comm,
    column_parallel_ops,
    norm_op,
)
from .sharding import normal_init

__all__ = ["LayerNormLinear"]


class LayerNormLinear(torch.nn.Module):
    """``y = norm(x) A^T + b`` with ``A [out_features, in_features]`` split by rows over TP.

    Op sequence (the ``tp_fuse.ops.Sequential`` ``self.ops``; op names in parentheses):
    ``[MakeExtraOutput (residual)?, LayerNorm|RMSNorm (norm), MakeExtraOutput (ln_out)?,
    AllGather (SP) | CopyToTensorParallelRegion (comm), BasicLinear (linear), Bias (bias)?]``.
    The norm runs BEFORE the all-gather, on this rank's sequence shard, so under sequence
    parallelism it touches ``s/tp`` rows; ``[AllGather, BasicLinear, Bias]`` is the window
    the overlap fusion turns into an overlapped all-gather + GEMM.

    Shapes:
        x: ``[s, b, in]`` (``[s/tp, b, in]`` with sequence parallelism)
        y: ``[s, b, out/tp]``; with ``return_residual`` also the residual (``x`` itself), with
        ``return_layernorm_output`` the normalized input (this rank's, before the all-gather)

    Args:
        in_features, out_features: global sizes.
        tp_group: TP group (None: no tensor parallelism).
        sequence_parallel: the input is split along the sequence over the TP ranks.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        eps: normalization epsilon.
        bias: add a (zero-initialized) bias.
        return_residual: put ``MakeExtraOutput`` first and return ``(y, x)``, so the
            caller's residual add can be an ``AddExtraInput`` in a later Sequential.
        init_method: applied to the FULL weight (default N(0, 0.02^2)); shards are slices.
        seed: init seed (None: torch's global RNG).
        comm_name: GEMM name for the overlap configuration (``"qkv"`` or ``"fc1"``).
        overlap: overlap configuration (its comm op's ``overlap=``).
        zero_centered_gamma: the norm weight stores ``gamma - 1``.
        return_layernorm_output: return ``(y, norm(x))`` (not with ``return_residual``).
        shard_init, accumulate_into_main_grad, sync_sequence_parallel_grads: the
            :class:`~tp_fuse.layers._common.ParallelContext` options ``shard_init``,
            ``main_grad``, ``sync_sequence_parallel_grads`` (Transformer Engine's init,
            ``fuse_wgrad_accumulation`` and Megatron-reduced SP gradients; ``tp_fuse.te``'s
            ``LayerNormLinear`` is built on this block with them).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        normalization: Normalization = "LayerNorm",
        eps: float = 1e-5,
        bias: bool = True,
        return_residual: bool = False,
        init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        comm_name: GemmName = "qkv",
        overlap: Optional[TPOverlap] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        shard_init: bool = False,
        accumulate_into_main_grad: bool = False,
        sync_sequence_parallel_grads: bool = True,
    ) -> None:
        if return_residual and return_layernorm_output:
            raise ValueError("LayerNormLinear: return_residual and return_layernorm_output are exclusive "
                             "(one extra output)")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerNormLinear: {name} must be a positive int, got {value!r}")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed,
                              shard_init=shard_init, main_grad=accumulate_into_main_grad,
                              sync_sequence_parallel_grads=sync_sequence_parallel_grads)
        ops: "OrderedDict[str, BasicOperation]" = OrderedDict()
        if return_residual:
            ops["residual"] = MakeExtraOutput()
        ops["norm"] = norm_op(ctx, normalization, in_features, eps, zero_centered_gamma)
        if return_layernorm_output:
            ops["ln_out"] = MakeExtraOutput()
        ops.update(column_input_comm(ctx))
        ops.update(column_parallel_ops(
            ctx, in_features, out_features, bias=bias, comm_name=comm_name,
            init_method=init_method or normal_init(0.02), input_comm=False,
        ))
        super().__init__()
        self.ops = Sequential(ops)
        self.in_features, self.out_features = in_features, out_features
        self.tp_size = ctx.tp_size
        self.sequence_parallel = sequence_parallel
        self.return_residual = bool(return_residual)
        self.return_layernorm_output = bool(return_layernorm_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``y``; ``(y, x)`` with ``return_residual``; ``(y, norm(x))`` with ``return_layernorm_output``."""
        return self.ops(x)

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.ops.linear.weight

    @property
    def bias(self) -> Optional[torch.nn.Parameter]:
        op = self.ops._modules.get("bias")
        return None if op is None else op.bias

    @property
    def layer_norm_weight(self) -> torch.nn.Parameter:
        return self.ops.norm.weight
