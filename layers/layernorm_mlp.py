"""``LayerNormMLP``: norm -> column-parallel fc1 -> GELU/SwiGLU -> row-parallel fc2 (-> dropout + residual)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal, Optional

import torch
import torch.distributed as dist

from tp_fuse import ops as _ops
from tp_fuse.ops import AddExtraInput, BasicOperation, Dropout, MakeExtraOutput, Sequential
from tp_fuse.overlap.config import TPOverlap

from ._common import (
    InitMethod,
    bias_op,
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

#: The activations (Transformer Engine's names) -> (tp_fuse.ops class name, gated: fc1
#: produces ``2 * ffn_hidden_size``, the halves ``[a; b]`` sharded separately).
ACTIVATIONS = {
    "gelu": ("GELU", False), "qgelu": ("QGELU", False), "relu": ("ReLU", False),
    "srelu": ("SReLU", False), "silu": ("SiLU", False),
    "geglu": ("GEGLU", True), "qgeglu": ("QGEGLU", True), "reglu": ("ReGLU", True),
    "sreglu": ("SReGLU", True), "swiglu": ("SwiGLU", True), "glu": ("GLU", True),
    "clamped_swiglu": ("ClampedSwiGLU", True),
}
Activation = Literal["gelu", "qgelu", "relu", "srelu", "silu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu",
                     "glu", "clamped_swiglu"]


class LayerNormMLP(torch.nn.Module):
    """Pre-norm feed-forward block, tensor-parallel over the FFN dimension.

    Two ``tp_fuse.ops.Sequential``s (op names in parentheses)::

        fc1: [MakeExtraOutput (residual)?, LayerNorm|RMSNorm (norm), MakeExtraOutput (ln_out)?,
              AllGather (SP) | CopyToTensorParallelRegion (comm), BasicLinear (linear),
              Bias (bias)?, activation (act)]
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
        activation: a name of :data:`ACTIVATIONS` (Transformer Engine's: ``"gelu"`` is the
            tanh approximation; gated ones such as ``"swiglu"`` double fc1's output);
            ``activation_params``: ``{"limit", "alpha"}`` of ``"clamped_swiglu"``.
        residual_connection: add the block input to the output.
        hidden_dropout: dropout probability on fc2's output.
        init_method / output_init_method: applied to the FULL fc1 / fc2 weights.
        rng: dropout RNG streams shared with the rest of the model (see
            :class:`~tp_fuse.layers.random.DropoutRNG`); default: a private one from ``seed``.
        return_bias: fc2's bias is not added but returned: ``(y, b2)`` (Megatron's
            ``skip_bias_add``, Transformer Engine's ``return_bias``).
        return_layernorm_output: also return the normalized input: ``(y, [b2,] norm(x))``
            (not with ``residual_connection``).
        Other args (``zero_centered_gamma``, ``shard_init``, ``accumulate_into_main_grad``,
        ``sync_sequence_parallel_grads``) as :class:`~tp_fuse.layers.layernorm_linear.LayerNormLinear`;
        ``tp_fuse.te``'s ``LayerNormMLP`` is built on this block.
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
        activation_params: Optional[dict] = None,
        zero_centered_gamma: bool = False,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        shard_init: bool = False,
        accumulate_into_main_grad: bool = False,
        sync_sequence_parallel_grads: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerNormMLP: {name} must be a positive int, got {value!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if activation_params is not None and not (
                activation == "clamped_swiglu" and isinstance(activation_params, dict)
                and set(activation_params) <= {"limit", "alpha"}):
            raise ValueError(f"LayerNormMLP: activation_params={activation_params!r} is not supported (None, or "
                             "{'limit', 'alpha'} for activation='clamped_swiglu')")
        if residual_connection and return_layernorm_output:
            raise ValueError("LayerNormMLP: residual_connection and return_layernorm_output are exclusive")
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, overlap, seed,
                              shard_init=shard_init, main_grad=accumulate_into_main_grad,
                              sync_sequence_parallel_grads=sync_sequence_parallel_grads)
        divide(ffn_hidden_size, ctx.tp_size, "LayerNormMLP: ffn_hidden_size")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation
        self.residual_connection = bool(residual_connection)
        self.return_bias = bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.hidden_dropout = float(hidden_dropout)
        self.tp_size = ctx.tp_size
        self.sequence_parallel = sequence_parallel
        # Without dropout no stream is drawn from: none is made (a private one would need the
        # RNG of ``device``, which a CPU-only build lacks for "cuda").
        self.rng: Optional[DropoutRNG] = dropout_rng(ctx, rng) if rng is not None or hidden_dropout > 0 else None
        self._dropout_stream = hidden_dropout_stream(ctx)
        init_method = init_method or normal_init(0.02)
        output_init_method = output_init_method or init_method

        op_name, gated = ACTIVATIONS[activation]
        fc1: "OrderedDict[str, BasicOperation]" = OrderedDict()
        if residual_connection:
            fc1["residual"] = MakeExtraOutput()
        fc1["norm"] = norm_op(ctx, normalization, hidden_size, eps, zero_centered_gamma)
        if return_layernorm_output:
            fc1["ln_out"] = MakeExtraOutput()
        fc1.update(column_input_comm(ctx))
        fc1.update(column_parallel_ops(
            ctx, hidden_size, ffn_hidden_size * (2 if gated else 1), bias=bias, comm_name="fc1",
            init_method=init_method, name="fc1.weight", blocks=2 if gated else 1, input_comm=False,
        ))
        fc1["act"] = getattr(_ops, op_name)(**(activation_params or {}))
        self.fc1 = Sequential(fc1)

        fc2 = row_parallel_ops(ctx, ffn_hidden_size, hidden_size, bias=bias, comm_name="fc2",
                               init_method=output_init_method, name="fc2.weight", add_bias=not return_bias)
        # return_bias: the caller adds it to the (sequence-sharded, under SP) reduced output.
        self.fc2_bias_op: Optional[BasicOperation] = None
        if bias and return_bias:
            self.fc2_bias_op = bias_op(ctx, hidden_size, None, sequence_parallel_partial=ctx.sequence_parallel)
        if hidden_dropout > 0:
            fc2["dropout"] = Dropout(hidden_dropout)
        if residual_connection:
            fc2["residual"] = AddExtraInput()
        self.fc2 = Sequential(fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``y``; with ``return_bias`` / ``return_layernorm_output`` ``(y, [b2,] [norm(x)])``."""
        extra: tuple[torch.Tensor, ...] = ()
        ln_out = None
        if self.residual_connection:
            h, residual = self.fc1(x)
            extra = (residual,)
        elif self.return_layernorm_output:
            h, ln_out = self.fc1(x)
        else:
            h = self.fc1(x)
        with maybe_fork(self.rng, self._dropout_stream, self.training and self.hidden_dropout > 0):
            y = self.fc2(h, *extra)
        if not (self.return_bias or self.return_layernorm_output):
            return y
        ret: tuple[torch.Tensor, ...] = (y,)
        if self.return_bias:
            bias = self.fc2_bias_op.bias if self.fc2_bias_op is not None else torch.empty(0, device=y.device)
            ret += (bias.to(y.dtype),)
        if self.return_layernorm_output:
            ret += (ln_out,)
        return ret

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation!r}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
