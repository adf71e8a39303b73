"""Shared plumbing of the sharded layers: parallel context, op builders, init.

The layer files build ``tp_fuse.ops.Sequential``s out of the op lists produced here, so
that every layer shares one definition of "column-parallel" and "row-parallel":

* column-parallel, ``in -> out/tp``: ``[AllGather (SP) | CopyToTensorParallelRegion,
  BasicLinear, Bias]`` -- the ``[AllGather, BasicLinear(, Bias)]`` window is what the
  overlap fusion replaces with an overlapped all-gather + GEMM;
* row-parallel, ``in/tp -> out``: ``[BasicLinear, ReduceScatter (SP) | AllReduce, Bias]``
  -- the bias comes AFTER the reduction (Megatron's math: added once, not ``tp`` times),
  and ``[BasicLinear, ReduceScatter|AllReduce]`` is the window the overlap fusions take.
  This is a deliberate choice: layers and ``wrap()`` must equal Megatron's own TP bit for
  bit, so they build this order here rather than use ``tp_fuse.ops.Linear``, whose row mode
  follows Transformer Engine (a per-rank bias BEFORE the reduction) unless given
  ``row_parallel_bias="after_reduction"``.

Without TP (``tp_group=None``) no comm op is inserted at all.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from tp_fuse.ops import AllGather, AllReduce, BasicLinear, BasicOperation, Bias, LayerNorm, ReduceScatter, RMSNorm
from tp_fuse.overlap.config import TPOverlap
from tp_fuse.quantization import active_autocast
from tp_fuse.quantization.compile_state import traced_amax_group, traced_key

from .grad_sync import sync_sequence_parallel_grad
from .random import DropoutRNG, TrackerRNG
from .sharding import (
    ShardSpec,
    deferred_full_tensor,
    derive_seed,
    divide,
    seeded_full_tensor,
    set_deferred_init,
    set_shard_spec,
    shard_tensor,
    tp_rank_and_size,
)
from .tp_regions import CopyToTensorParallelRegion, ScatterToTensorParallelRegion

InitMethod = Callable[[torch.Tensor], Any]
Normalization = Literal["LayerNorm", "RMSNorm"]
GemmName = Optional[Literal["qkv", "proj", "fc1", "fc2"]]


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """Where and how a layer is sharded; built once per layer from its constructor args.

    Attributes:
        tp_group: TP process group, or None for no tensor parallelism.
        sequence_parallel: activations outside the TP blocks are split along the
            sequence (first) dim over the TP ranks.
        dtype, device: parameter dtype/device.
        overlap: the :class:`tp_fuse.overlap.config.TPOverlap` handed to every comm op
            (``overlap=``), the one carrier of a window's overlap settings; None: each
            comm op's own default ``TPOverlap()`` (overlap ON, Megatron's methods). Pass
            ``TPOverlap(OverlapConfig(enabled=False))`` to switch overlap off.
        seed: base seed of this layer's parameters (None: draw from torch's global RNG,
            as Megatron-LM does; identical on all ranks only if the caller seeded them so).
        shard_init: the GEMM weights' ``init_method`` runs on this rank's shard, on the
            parameter's device and dtype (Transformer Engine's init; ``seed`` is not used for
            them), instead of on the full TP=1 tensor of which each rank keeps its slice.
        main_grad: the GEMMs accumulate dW into ``weight.main_grad`` (TE's / Megatron's
            ``fuse_wgrad_accumulation``).
        sync_sequence_parallel_grads: under sequence parallelism the gradients that are
            partial sums (norm weights, a row-parallel bias) are all-reduced over the TP group
            in the backward (True), or tagged ``sequence_parallel=True`` for the caller to
            reduce (False: Megatron's ``finalize_model_grads``, as with TE's modules).
    """

    tp_group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False
    dtype: torch.dtype = torch.float32
    device: Optional[torch.device] = None
    overlap: Optional[TPOverlap] = None
    seed: Optional[int] = 0
    shard_init: bool = False
    main_grad: bool = False
    sync_sequence_parallel_grads: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.overlap is not None and not isinstance(self.overlap, TPOverlap):
            raise ValueError(f"overlap must be a tp_fuse.overlap.config.TPOverlap or None, got {type(self.overlap).__name__}")
        tp_rank_and_size(self.tp_group)  # validates the group

    @property
    def tp_rank(self) -> int:
        return tp_rank_and_size(self.tp_group)[0]

    @property
    def tp_size(self) -> int:
        return tp_rank_and_size(self.tp_group)[1]

    def child(self, name: str) -> "ParallelContext":
        """The context of a sub-layer: same sharding, seed derived from ``name``."""
        seed = None if self.seed is None else derive_seed(self.seed, name)
        return dataclasses.replace(self, seed=seed)


def full_init(ctx: ParallelContext, shape: tuple[int, ...], name: str, init_method: InitMethod) -> torch.Tensor:
    """The full (TP=1) fp32 tensor for parameter ``name``, identical at every TP size.

    On the ``meta`` device: a stand-in that draws nothing now (materialized later, shard
    by shard, with the same values; ``tp_fuse.layers.meta_init``).
    """
    if ctx.device is not None and ctx.device.type == "meta":
        if ctx.seed is None:
            raise ValueError("device='meta' needs a seed: with seed=None the init draws from torch's global RNG, "
                             "which a deferred initialization cannot replay")
        return deferred_full_tensor(shape, ctx.seed, name, init_method)
    if ctx.seed is None:
        full = torch.empty(shape, dtype=torch.float32)
        with torch.no_grad():
            init_method(full)
        return full
    return seeded_full_tensor(shape, ctx.seed, name, init_method)


def userbuffers_options(comm_name: GemmName) -> dict[str, Any]:
    """``userbuffers_options`` for a BasicLinear: its GEMM name (the ``TPOverlap`` goes to
    the comm op, its one carrier)."""
    return {"comm_name": comm_name} if comm_name is not None else {}


def linear_op(
    ctx: ParallelContext,
    full_weight: torch.Tensor,
    spec: Optional[ShardSpec],
    comm_name: GemmName,
) -> BasicLinear:
    """A BasicLinear holding this rank's shard of ``full_weight [out, in]``."""
    shard = shard_tensor(full_weight, spec, ctx.tp_rank, ctx.tp_size)
    out_local, in_local = shard.shape

    def copy_shard(w: torch.Tensor) -> None:
        with torch.no_grad():
            w.copy_(shard)

    op = BasicLinear(
        in_local,
        out_local,
        device=ctx.device,
        dtype=ctx.dtype,
        init_method=copy_shard,
        userbuffers_options=userbuffers_options(comm_name),
        accumulate_into_main_grad=ctx.main_grad,
    )
    set_shard_spec(op.weight, spec)
    set_deferred_init(op.weight, full_weight, spec, ctx.tp_rank, ctx.tp_size)
    return op


def gemm_op(ctx: ParallelContext, out_features: int, in_features: int, spec: ShardSpec, comm_name: GemmName,
            name: str, init_method: InitMethod) -> BasicLinear:
    """The BasicLinear of a global ``in -> out`` GEMM sharded by ``spec``: from the full
    tensor (:func:`full_init`), or with ``ctx.shard_init`` initialized on its own shard."""
    if not ctx.shard_init:
        return linear_op(ctx, full_init(ctx, (out_features, in_features), name, init_method), spec, comm_name)
    rows = out_features // ctx.tp_size if spec.dim == 0 else out_features
    cols = in_features // ctx.tp_size if spec.dim == 1 else in_features
    op = BasicLinear(cols, rows, device=ctx.device, dtype=ctx.dtype, init_method=init_method,
                     userbuffers_options=userbuffers_options(comm_name), accumulate_into_main_grad=ctx.main_grad)
    set_shard_spec(op.weight, spec)
    return op


def bias_op(ctx: ParallelContext, size: int, spec: Optional[ShardSpec], *, sequence_parallel_partial: bool) -> Bias:
    """A zero-initialized Bias of local ``size``; its grad is TP-synced when it is a partial sum."""
    op = Bias(size, device=ctx.device, dtype=ctx.dtype)
    set_shard_spec(op.bias, spec)
    if sequence_parallel_partial:
        _partial_grad(ctx, op.bias)
    return op


def _partial_grad(ctx: ParallelContext, param: torch.nn.Parameter) -> None:
    """A parameter whose gradient is a partial sum over the TP ranks under sequence parallelism:
    reduced in the backward, or tagged for the caller (``ctx.sync_sequence_parallel_grads``)."""
    if ctx.sync_sequence_parallel_grads:
        sync_sequence_parallel_grad(param, ctx.tp_group)
    else:
        param.sequence_parallel = True  # type: ignore[attr-defined]  # Megatron's tag


def norm_op(ctx: ParallelContext, normalization: Normalization, hidden_size: int, eps: float,
            zero_centered_gamma: bool = False) -> BasicOperation:
    """LayerNorm or RMSNorm over ``hidden_size``; replicated, grads TP-synced under SP.
    ``zero_centered_gamma``: the weight stores ``gamma - 1`` (Transformer Engine's option)."""
    if normalization == "LayerNorm":
        op: BasicOperation = LayerNorm(hidden_size, eps=eps, device=ctx.device, dtype=ctx.dtype,
                                       zero_centered_gamma=zero_centered_gamma)
    elif normalization == "RMSNorm":
        op = RMSNorm(hidden_size, eps=eps, device=ctx.device, dtype=ctx.dtype, zero_centered_gamma=zero_centered_gamma)
    else:
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    for p in op.parameters():
        set_shard_spec(p, None)
        if ctx.sequence_parallel:
            # Each rank normalizes only its s/tp rows: the weight grads are partial sums.
            _partial_grad(ctx, p)
    return op


def column_parallel_ops(
    ctx: ParallelContext,
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    comm_name: GemmName,
    init_method: InitMethod,
    name: str = "weight",
    blocks: int = 1,
    input_comm: bool = True,
) -> "OrderedDict[str, BasicOperation]":
    """``[AllGather | CopyToTensorParallelRegion, BasicLinear, Bias]`` for a global ``in -> out`` GEMM.

    ``blocks`` > 1 shards each of ``blocks`` equal output parts separately (SwiGLU's
    ``[gate; up]``). ``input_comm=False`` leaves the input comm op out (the caller
    places its own, e.g. after a norm).
    """
    divide(out_features, ctx.tp_size * blocks, f"output features of {comm_name or name}")
    spec = ShardSpec(dim=0, blocks=blocks)
    ops: "OrderedDict[str, BasicOperation]" = OrderedDict()
    if input_comm:
        ops.update(column_input_comm(ctx))
    ops["linear"] = gemm_op(ctx, out_features, in_features, spec, comm_name, name, init_method)
    if bias:
        ops["bias"] = bias_op(ctx, out_features // ctx.tp_size, spec, sequence_parallel_partial=False)
    return ops


def column_input_comm(ctx: ParallelContext) -> "OrderedDict[str, BasicOperation]":
    """The comm op in front of a column-parallel GEMM (empty without TP)."""
    ops: "OrderedDict[str, BasicOperation]" = OrderedDict()
    if ctx.tp_size == 1:
        return ops
    if ctx.sequence_parallel:
        ops["comm"] = AllGather(ctx.tp_group, overlap=ctx.overlap)
    else:
        ops["comm"] = CopyToTensorParallelRegion(ctx.tp_group)
    return ops


def row_parallel_ops(
    ctx: ParallelContext,
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    comm_name: GemmName,
    init_method: InitMethod,
    name: str = "weight",
    input_is_parallel: bool = True,
    add_bias: bool = True,
    sync_bias_grad: bool = True,
) -> "OrderedDict[str, BasicOperation]":
    """``[BasicLinear, ReduceScatter (SP) | AllReduce, Bias]`` for a global ``in -> out`` GEMM.

    ``add_bias=False`` creates no Bias op (the caller holds the bias, Megatron's
    ``skip_bias_add``). ``sync_bias_grad=False`` leaves the SP partial bias gradient
    un-reduced (for callers that reduce it themselves, e.g. Megatron's finalize_model_grads).
    """
    divide(in_features, ctx.tp_size, f"input features of {comm_name or name}")
    ops: "OrderedDict[str, BasicOperation]" = OrderedDict()
    if not input_is_parallel and ctx.tp_size > 1:
        ops["scatter"] = ScatterToTensorParallelRegion(ctx.tp_group)
    ops["linear"] = gemm_op(ctx, out_features, in_features, ShardSpec(dim=1), comm_name, name, init_method)
    if ctx.tp_size > 1:
        comm_op = ReduceScatter if ctx.sequence_parallel else AllReduce
        ops["comm"] = comm_op(ctx.tp_group, overlap=ctx.overlap)
    if bias and add_bias:
        # After the reduction: added once. Under SP each rank adds it to its s/tp rows only.
        ops["bias"] = bias_op(ctx, out_features, None,
                              sequence_parallel_partial=ctx.sequence_parallel and sync_bias_grad)
    return ops


def dropout_rng(ctx: ParallelContext, rng: Optional["DropoutRNG | TrackerRNG"]) -> "DropoutRNG | TrackerRNG":
    """``rng`` if given, else a layer-private one seeded from the layer's seed.

    Models share one :class:`~tp_fuse.layers.random.DropoutRNG` between layers (GPT does); a
    standalone layer gets its own, so its masks never come from an unmanaged stream. A
    :class:`~tp_fuse.layers.random.TrackerRNG` draws from a Megatron / TE RNG tracker instead
    (``tp_fuse.te``'s blocks).
    """
    if rng is not None:
        if not isinstance(rng, (DropoutRNG, TrackerRNG)):
            raise ValueError(f"rng must be a tp_fuse.layers.random.DropoutRNG or TrackerRNG, got {type(rng).__name__}")
        return rng
    seed = ctx.seed if ctx.seed is not None else torch.initial_seed() & 0x7FFFFFFF
    return DropoutRNG(seed, ctx.tp_rank, ctx.device)


def hidden_dropout_stream(ctx: ParallelContext) -> str:
    """Hidden activations are replicated over TP without SP (same mask everywhere), sharded with it."""
    return "tp_local" if ctx.sequence_parallel and ctx.tp_size > 1 else "replicated"


def check_fp8_amax_group(tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool) -> None:
    """Under FP8 with sequence parallelism, the amax reduction group must cover the TP group.

    The all-gather before a column-parallel GEMM moves FP8 bytes with ONE scale, which is
    only right if every TP rank quantized with the same scale -- i.e. if amaxes were
    reduced over (at least) the TP group: FP8 group ``tp`` or ``world``, not ``dp``.
    Otherwise the gathered shards would be decoded with the wrong scale, silently.
    """
    if not sequence_parallel or tp_group is None:
        return
    if torch.compiler.is_compiling():
        # Dynamo cannot read the autocast ContextVar: it reads (and guards on) the mirror.
        if traced_key() is not None:
            _check_amax_group(traced_amax_group(), tp_group)
        return
    state = active_autocast()
    if state is not None:
        _check_amax_group(state.amax_reduction_group, tp_group)


def _check_amax_group(group: Optional[dist.ProcessGroup], tp_group: dist.ProcessGroup) -> None:
    if group is None or group is tp_group:
        return  # None: torch's default group (the world), which covers every TP group
    amax_ranks = set(dist.get_process_group_ranks(group))
    tp_ranks = dist.get_process_group_ranks(tp_group)
    if len(tp_ranks) > 1 and not amax_ranks.issuperset(tp_ranks):
        raise ValueError(
            f"FP8 with sequence parallelism: the autocast's amax_reduction_group (ranks {sorted(amax_ranks)}) "
            f"must include the tensor-parallel group (ranks {tp_ranks}), because FP8 activations are "
            "all-gathered as bytes with one scale; use the 'tp' or 'world' FP8 group, not 'dp'"
        )
