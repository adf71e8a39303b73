"""``LayerNormMLP``: norm -> column-parallel fc1 -> GELU/SwiGLU -> row-parallel fc2 (-> dropout + residual)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal, Optional

import torch
import torch.distributed as dist

from tp_fuse.ops import GELU, AddExtraInput, BasicOperation, Dropout, MakeExtraOutput, Sequential, SwiGLU
from tp_fuse.overlap.config import TPOverlap

from ._common import (
    InitMethod,
    Normalization,
    ParallelContext,
    column_input_comm,
    column_parallel_ops,
    dropout_rng,
    hidden_dropout_stream,
    norm_op,
    row_parallel_ops,
)
from .random import DropoutRNG, maybe_fork
from .sharding import divide, normal_init

__all__ = ["LayerNormMLP"]

Activation = Literal["gelu", "swiglu"]


class LayerNormMLP(torch.nn.Module):
    """Pre-norm feed-forward block, tensor-parallel over the FFN dimension.

    Two ``tp_fuse.ops.Sequential``s (op names in parentheses)::

        fc1: [MakeExtraOutput (residual)?, LayerNorm|RMSNorm (norm),
              AllGather (SP) | CopyToTensorParallelRegion (comm), BasicLinear (linear),
              Bias (bias)?, GELU|SwiGLU (act)]
        fc2: [BasicLinear (linear), ReduceScatter (SP) | AllReduce (comm), Bias (bias)?,
              Dropout (dropout)?, AddExtraInput (residual)?]

    The split falls after the activation, where no fusion spans anyway, and lets the
    residual made by ``MakeExtraOutput`` in fc1 enter fc2's ``AddExtraInput``.

    Shapes (``tp`` = TP size; ``f`` = ``ffn_hidden_size``):
        x, y: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)
        fc1 weight: ``[f/tp, h]`` (GELU) or ``[2f/tp, h]`` = ``[gate_r; up_r]`` (SwiGLU:
        the gate and up halves of the TP=1 weight ``[gate; up]`` are sharded separately,
        so every shard is made of slices of the TP=1 weight)
        fc2 weight: ``[h, f/tp]``

    Equations: ``y = x + dropout(act(norm(x) W1^T + b1) W2^T + b2)`` with
    ``residual_connection``, else without the ``x +``. ``b2`` is added after the TP
    reduction (once).

    Args:
        hidden_size, ffn_hidden_size: global sizes (``ffn_hidden_size`` is the width
            after the activation; SwiGLU's fc1 produces twice that).
        activation: ``"gelu"`` (tanh approximation) or ``"swiglu"``.
        residual_connection: add the block input to the output.
        hidden_dropout: dropout probability on fc2's output.
        init_method / output_init_method: applied to the FULL fc1 / fc2 weights.
        rng: dropout RNG streams shared with the rest of the model (see
            :class:`~tp_fuse.layers.random.DropoutRNG`); default: a private one from ``seed``.
        Other args as :class:`~tp_fuse.layers.layernorm_linear.LayerNormLinear`.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        normalization: Normalization = "LayerNorm",
        eps: float = 1e-5,
        activation: Activation = "gelu",
        bias: bool = True,
        residual_connection: bool = False,
        hidden_dropout: float = 0.0,
        init_method: Optional[InitMethod] = None,
        output_init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        overlap: Optional[TPOverlap] = None,
        rng: Optional[DropoutRNG] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerNormMLP: {name} must be a positive int, got {value!r}")
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"LayerNormMLP: activation must be 'gelu' or 'swiglu', got {activation!r}")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed)
        divide(ffn_hidden_size, ctx.tp_size, "LayerNormMLP: ffn_hidden_size")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation
        self.residual_connection = bool(residual_connection)
        self.hidden_dropout = float(hidden_dropout)
        self.tp_size = ctx.tp_size
        self.sequence_parallel = sequence_parallel
        self.rng = dropout_rng(ctx, rng)
        self._dropout_stream = hidden_dropout_stream(ctx)
        init_method = init_method or normal_init(0.02)
        output_init_method = output_init_method or init_method

        gated = activation == "swiglu"
        fc1: "OrderedDict[str, BasicOperation]" = OrderedDict()
        if residual_connection:
            fc1["residual"] = MakeExtraOutput()
        fc1["norm"] = norm_op(ctx, normalization, hidden_size, eps)
        fc1.update(column_input_comm(ctx))
        fc1.update(column_parallel_ops(
            ctx, hidden_size, ffn_hidden_size * (2 if gated else 1), bias=bias, comm_name="fc1",
            init_method=init_method, name="fc1.weight", blocks=2 if gated else 1, input_comm=False,
        ))
        fc1["act"] = SwiGLU() if gated else GELU()
        self.fc1 = Sequential(fc1)

        fc2 = row_parallel_ops(ctx, ffn_hidden_size, hidden_size, bias=bias, comm_name="fc2",
                               init_method=output_init_method, name="fc2.weight")
        if hidden_dropout > 0:
            fc2["dropout"] = Dropout(hidden_dropout)
        if residual_connection:
            fc2["residual"] = AddExtraInput()
        self.fc2 = Sequential(fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.residual_connection:
            h, residual = self.fc1(x)
            extra = (residual,)
        else:
            h, extra = self.fc1(x), ()
        with maybe_fork(self.rng, self._dropout_stream, self.training and self.hidden_dropout > 0):
            return self.fc2(h, *extra)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation!r}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
