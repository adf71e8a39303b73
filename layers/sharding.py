"""How full (TP=1) tensors map onto tensor-parallel shards, and TP-size-independent init.

Every parameter a layer in this package creates carries a :class:`ShardSpec` in the
attribute ``tp_shard`` (``None``: replicated on all TP ranks). The spec is all that is
needed to slice a full tensor into this rank's shard (:func:`shard_tensor`) or to
reassemble the full tensor from the shards (:func:`gather_tensor`), so that

* initialization is independent of the TP size: the full weight is generated on every
  rank from a seed derived from the parameter's name (:func:`seeded_full_tensor`), then
  sliced -- TP=2 shards are exactly slices of the TP=1 weight;
* tests and checkpoints can gather full tensors and reshard them at another TP size
  (:func:`full_state_dict`, :func:`load_full_state_dict`);
* gradient clipping counts each shard once and each replicated tensor once
  (:func:`grad_norm`).

Megatron-LM's parameter attributes (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``) are set as well, so Megatron-style tooling (e.g. a grad-norm that
counts sharded parameters once per TP rank) recognises the shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

__all__ = [
    "ShardSpec",
    "tp_rank_and_size",
    "divide",
    "shard_tensor",
    "gather_tensor",
    "set_shard_spec",
    "get_shard_spec",
    "derive_seed",
    "seeded_full_tensor",
    "normal_init",
    "full_state_dict",
    "full_grads",
    "load_full_state_dict",
    "grad_norm",
    "deferred_full_tensor",
    "set_deferred_init",
]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Layout of a TP-sharded tensor.

    Attributes:
        dim: the dimension split over the TP ranks (0: output features / vocab rows,
            1: input features).
        blocks: the full tensor is ``blocks`` equal parts concatenated along ``dim``,
            each split over the ranks separately; a shard is the concatenation of this
            rank's slice of every part. ``2`` for a SwiGLU ``fc1`` weight ``[gate; up]``,
            so that every rank holds ``[gate_r; up_r]`` and its local SwiGLU pairs the
            right halves.
        sizes: unequal parts instead of ``blocks`` equal ones: the full extents of the
            parts along ``dim`` (each divisible by the TP size), e.g. a fused GQA
            projection ``[q; k; v]`` with ``(heads * d, kv_heads * d, kv_heads * d)``;
            a shard is ``[q_r; k_r; v_r]`` with local extents ``size / tp``. ``blocks``
            is then ``len(sizes)`` (set automatically), so code that only knows
            ``blocks`` can tell the tensor has parts; code that reshards must read
            ``sizes`` when it is not None.
    """

    dim: int
    blocks: int = 1
    sizes: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.dim < 0 or self.blocks < 1:
            raise ValueError(f"ShardSpec: need dim >= 0 and blocks >= 1, got {self}")
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"ShardSpec: sizes must be a tuple of >= 2 positive ints, got {self.sizes!r}")
            if self.blocks not in (1, len(sizes)):
                raise ValueError(f"ShardSpec: blocks ({self.blocks}) must be len(sizes) ({len(sizes)}) when sizes "
                                 f"are given")
            object.__setattr__(self, "sizes", sizes)  # frozen dataclass: normalise once here
            object.__setattr__(self, "blocks", len(sizes))

    def part_sizes(self, extent: int) -> tuple[int, ...]:
        """The full extents of the parts along ``dim`` for a full tensor of ``extent``
        there: ``sizes``, or ``blocks`` equal parts."""
        if self.sizes is not None:
            if sum(self.sizes) != extent:
                raise ValueError(f"cannot shard dimension {self.dim} of size {extent} into parts {list(self.sizes)}: "
                                 f"they sum to {sum(self.sizes)}")
            return self.sizes
        if extent % self.blocks:
            raise ValueError(f"cannot shard dimension {self.dim} of size {extent} into {self.blocks} equal blocks")
        return (extent // self.blocks,) * self.blocks


def tp_rank_and_size(tp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """``(rank, size)`` in ``tp_group``; ``None`` means no tensor parallelism ``(0, 1)``.

    Note: in this package ``tp_group=None`` is NOT torch's default group -- model code
    takes explicit groups, and None means "not sharded".
    """
    if tp_group is None:
        return 0, 1
    if not isinstance(tp_group, dist.ProcessGroup):
        raise ValueError(f"tp_group must be a torch.distributed.ProcessGroup or None, got {type(tp_group).__name__}")
    if not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialized")
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; ValueError naming ``what`` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def shard_tensor(full: torch.Tensor, spec: Optional[ShardSpec], rank: int, size: int) -> torch.Tensor:
    """This rank's shard of ``full`` (a copy, contiguous). ``spec=None``: a copy of ``full``."""
    if spec is None or size == 1:
        return full.detach().clone()
    extent = full.shape[spec.dim]
    sizes = spec.part_sizes(extent)
    if any(s % size for s in sizes):
        raise ValueError(
            f"cannot shard dimension {spec.dim} of size {extent} (parts {list(sizes)}) over {size} "
            f"tensor-parallel ranks: every part must be divisible by {size}"
        )
    parts = full.detach().split(sizes, dim=spec.dim)
    return torch.cat([p.chunk(size, dim=spec.dim)[rank] for p in parts], dim=spec.dim).contiguous()


def gather_tensor(local: torch.Tensor, spec: Optional[ShardSpec], tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard (collective over ``tp_group``)."""
    _, size = tp_rank_and_size(tp_group)
    local = local.detach()
    if spec is None or size == 1:
        return local.clone()
    local = local.contiguous()  # NCCL needs contiguous inputs and outputs (empty_like keeps strides)
    pieces = [torch.empty_like(local) for _ in range(size)]
    check_collective("all_gather_list", [local], pieces, world_size=size)
    dist.all_gather(pieces, local, group=tp_group)
    # pieces[r] = [part0_r; part1_r; ...]: regroup by part, then concatenate.
    local_sizes = [s // size for s in spec.part_sizes(local.shape[spec.dim] * size)]
    per_rank_parts = [p.split(local_sizes, dim=spec.dim) for p in pieces]
    parts = [torch.cat([rp[b] for rp in per_rank_parts], dim=spec.dim) for b in range(spec.blocks)]
    return torch.cat(parts, dim=spec.dim)


def set_shard_spec(param: torch.Tensor, spec: Optional[ShardSpec]) -> None:
    """Tag ``param`` with its layout (and Megatron's equivalent attributes)."""
    param.tp_shard = spec  # type: ignore[attr-defined]
    param.tensor_model_parallel = spec is not None  # type: ignore[attr-defined]
    param.partition_dim = spec.dim if spec is not None else -1  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]


def get_shard_spec(param: torch.Tensor) -> Optional[ShardSpec]:
    """The layout set by :func:`set_shard_spec` (``None``: replicated)."""
    if not hasattr(param, "tp_shard"):
        raise ValueError("parameter has no tp_shard attribute: it was not created by a tp-fuse layer")
    return param.tp_shard


def derive_seed(seed: int, name: str) -> int:
    """A stable 31-bit seed for the tensor called ``name`` (independent of creation order)."""
    return zlib.crc32(f"{int(seed)}/{name}".encode()) & 0x7FFFFFFF


@contextlib.contextmanager
def _forked_cpu_rng(seed: int) -> Iterator[None]:
    # init_method callables (Megatron style) draw from torch's global RNG: fork it so that
    # initialization neither depends on nor disturbs the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def seeded_full_tensor(
    shape: tuple[int, ...],
    seed: int,
    name: str,
    init_method: Callable[[torch.Tensor], Any],
) -> torch.Tensor:
    """The full fp32 CPU tensor ``init_method(empty(shape))`` under a seed derived from ``name``.

    The same ``(seed, name)`` gives the same tensor on every rank and at every TP size.
    """
    full = torch.empty(shape, dtype=torch.float32)
    with _forked_cpu_rng(derive_seed(seed, name)), torch.no_grad():
        init_method(full)
    return full


def deferred_full_tensor(
    shape: tuple[int, ...], seed: int, name: str, init_method: Callable[[torch.Tensor], Any]
) -> torch.Tensor:
    """A ``meta`` stand-in for :func:`seeded_full_tensor`: no memory, no RNG draws.

    It carries ``tp_full_init``, a callable that draws the real full tensor later (the
    same values :func:`seeded_full_tensor` gives now), so that a model built on ``meta``
    can be materialized shard by shard (``tp_fuse.layers.meta_init.materialize``).
    """
    full = torch.empty(shape, dtype=torch.float32, device="meta")
    full.tp_full_init = functools.partial(seeded_full_tensor, shape, seed, name, init_method)  # type: ignore[attr-defined]
    return full


def _local_from_full(full_init: Callable[[], torch.Tensor], spec: Optional[ShardSpec], rank: int, size: int) -> torch.Tensor:
    return shard_tensor(full_init(), spec, rank, size)


def set_deferred_init(param: torch.Tensor, full: torch.Tensor, spec: Optional[ShardSpec], rank: int, size: int) -> None:
    """If ``full`` came from :func:`deferred_full_tensor`, tag ``param`` with ``tp_init``:
    a callable returning this TP rank's fp32 CPU shard (the values eager init gives)."""
    full_init = getattr(full, "tp_full_init", None)
    if full_init is not None:
        param.tp_init = functools.partial(_local_from_full, full_init, spec, rank, size)  # type: ignore[attr-defined]


def normal_init(std: float) -> Callable[[torch.Tensor], Any]:
    """Megatron's ``init_method_normal(std)``: N(0, std^2) from torch's (forked) global RNG."""
    if not std > 0:
        raise ValueError(f"init std must be > 0, got {std}")

    def init(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(t, mean=0.0, std=std)

    return init


def _shard_specs(model: torch.nn.Module) -> dict[str, Optional[ShardSpec]]:
    specs = {}
    for name, p in model.named_parameters():
        specs[name] = get_shard_spec(p)
    return specs


def full_state_dict(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup]) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter, by name (collective over ``tp_group``)."""
    specs = _shard_specs(model)
    return {name: gather_tensor(p, specs[name], tp_group) for name, p in model.named_parameters()}


def full_grads(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup]) -> dict[str, Optional[torch.Tensor]]:
    """Full gradients by parameter name (None where a parameter has no grad on this rank).

    Collective: every rank must have the same set of grads (they do after one backward).
    """
    specs = _shard_specs(model)
    out: dict[str, Optional[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        out[name] = None if p.grad is None else gather_tensor(p.grad, specs[name], tp_group)
    return out


@torch.no_grad()
def load_full_state_dict(
    model: torch.nn.Module, full: dict[str, torch.Tensor], tp_group: Optional[dist.ProcessGroup]
) -> None:
    """Copy this rank's shard of every full tensor in ``full`` into the model's parameters.

    Raises ValueError listing missing/unexpected names or shape mismatches.
    """
    rank, size = tp_rank_and_size(tp_group)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params))
    problems = []
    if missing:
        problems.append(f"missing: {missing}")
    if unexpected:
        problems.append(f"unexpected: {unexpected}")
    shards = {}
    for name, p in params.items():
        if name not in full:
            continue
        shard = shard_tensor(full[name], get_shard_spec(p), rank, size)
        if shard.shape != p.shape:
            problems.append(f"{name}: full shape {tuple(full[name].shape)} gives shard {tuple(shard.shape)}, "
                            f"parameter is {tuple(p.shape)}")
        shards[name] = shard
    if problems:
        raise ValueError("load_full_state_dict: " + "; ".join(problems))
    for name, p in params.items():
        p.copy_(shards[name])


def grad_norm(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup], norm_type: float = 2.0) -> torch.Tensor:
    """Global gradient norm of a TP-sharded model, identical on every TP rank.

    Sharded parameters (``tp_shard`` set) contribute every rank's shard (summed over
    ``tp_group``); replicated ones (norms, row biases -- their grads are identical on all
    TP ranks, sequence-parallel ones included after the layers' grad sync) count once.
    Collective over ``tp_group``. Data parallelism is the caller's business: call it after
    the DP gradient all-reduce, when DP replicas hold equal grads.
    """
    if norm_type != 2.0:
        raise ValueError(f"grad_norm: only the 2-norm is supported, got norm_type={norm_type}")
    _, size = tp_rank_and_size(tp_group)
    device = next(model.parameters()).device
    # float64 accumulators on the parameters' device: no host sync per parameter.
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if get_shard_spec(p) is not None:
            sharded += sq
        else:
            replicated += sq
    if size > 1:
        check_collective("all_reduce", [sharded], world_size=size)
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()
