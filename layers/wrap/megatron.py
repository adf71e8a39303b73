"""``wrap()`` for Megatron-core tensor-parallel linears (found by duck typing): their checks,
their conversion (keeping their very Parameter objects and flags), and the ``tp_shard`` tags
of the parameters ``wrap`` leaves as they are (Megatron's own ``partition_dim`` where set).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.overlap.config import TPOverlap

from ..parallel_linear import ColumnParallelLinear, RowParallelLinear
from ..sharding import ShardSpec, set_shard_spec, tp_rank_and_size
from .modules import MegatronLinearAdapter, ParallelLinearAdapter, megatron_adapter
from .plain import no_init

__all__ = ["COLUMN_ATTRS", "ROW_ATTRS", "EXPERT_FLAGS", "is_megatron", "megatron_problems", "convert_megatron",
           "tag_untouched"]

COLUMN_ATTRS = ("input_size", "output_size", "output_size_per_partition", "gather_output", "skip_bias_add",
                "weight", "bias")
ROW_ATTRS = ("input_size", "output_size", "input_size_per_partition", "input_is_parallel", "skip_bias_add",
             "weight", "bias")
EXPERT_FLAGS = ("is_expert", "explicit_expert_comm")


def is_megatron(module: torch.nn.Module, attrs: tuple[str, ...]) -> bool:
    return all(hasattr(module, a) for a in attrs) and not isinstance(
        module, (ColumnParallelLinear, RowParallelLinear, MegatronLinearAdapter, ParallelLinearAdapter))


def same_group(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def megatron_problems(name: str, m: torch.nn.Module, kind: str, tp_group: dist.ProcessGroup,
                       sequence_parallel: Optional[bool]) -> list[str]:
    problems = []
    _, tp = tp_rank_and_size(tp_group)
    if m.weight is None and kind != "column":
        problems.append(f"{name}: a row-parallel layer without a weight is not supported")
    for flag in ("disable_grad_reduce",):  # expert flags: checks.expert_problems (one line for all)
        if getattr(m, flag, False):
            problems.append(f"{name}: {flag}=True is not supported")
    config = getattr(m, "config", None)
    if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
        problems.append(f"{name}: config.defer_embedding_wgrad_compute=True is not supported")
    group = getattr(m, "tp_group", None)
    if group is not None and not same_group(group, tp_group):
        problems.append(f"{name}: its tp_group (ranks {dist.get_process_group_ranks(group)}) is not the "
                        f"tp_group given to wrap (ranks {dist.get_process_group_ranks(tp_group)})")
    if m.weight is not None:
        stride = getattr(m.weight, "partition_stride", 1)
        if stride != 1 and (kind != "column" or m.output_size_per_partition % stride):
            problems.append(f"{name}: strided weight partitioning (stride {stride}) is supported for column-parallel "
                            f"layers whose per-rank rows divide by the stride (Megatron's [gate; up] SwiGLU fc1)")
        want = ((m.output_size_per_partition, m.input_size) if kind == "column"
                else (m.output_size, m.input_size_per_partition))
        if tuple(m.weight.shape) != want:
            problems.append(f"{name}: weight shape {tuple(m.weight.shape)} is not {want}")
        per_rank = m.output_size_per_partition if kind == "column" else m.input_size_per_partition
        full = m.output_size if kind == "column" else m.input_size
        if per_rank * tp != full:
            problems.append(f"{name}: {full} features split {per_rank} per rank does not match TP size {tp}")
    module_sp = bool(getattr(m, "sequence_parallel", False))
    if sequence_parallel is not None and module_sp != sequence_parallel:
        problems.append(f"{name}: module has sequence_parallel={module_sp}, wrap was asked for {sequence_parallel}")
    return problems


def convert_megatron(m: torch.nn.Module, kind: str, tp_group: dist.ProcessGroup,
                      overlap: Optional[TPOverlap]) -> torch.nn.Module:
    w = m.weight
    dtype = w.dtype if w is not None else m.config.params_dtype
    device = w.device if w is not None else None
    common = dict(tp_group=tp_group, bias=m.bias is not None, skip_bias_add=bool(m.skip_bias_add),
                  sequence_parallel=bool(getattr(m, "sequence_parallel", False)), init_method=no_init,
                  seed=None, overlap=overlap, dtype=dtype, device=device)
    if kind == "column":
        new: ColumnParallelLinear | RowParallelLinear = ColumnParallelLinear(
            m.input_size, m.output_size, gather_output=bool(m.gather_output), **common)
        # Megatron's stride-s column layout: rank r holds [part0_r; ...; part(s-1)_r]
        # (SwiGLU fc1: [gate_r; up_r]) -- exactly ShardSpec(blocks=s); the local GEMM and
        # Megatron's local chunk(2) pairing need nothing else.
        stride = getattr(w, "partition_stride", 1) if w is not None else 1
        spec: Optional[ShardSpec] = ShardSpec(dim=0, blocks=stride)
    else:
        new = RowParallelLinear(m.input_size, m.output_size, input_is_parallel=bool(m.input_is_parallel),
                                sync_sequence_parallel_grads=False, **common)
        spec = ShardSpec(dim=1)
    linear = new.ops.linear
    linear.accumulate_into_main_grad = bool(getattr(m, "gradient_accumulation_fusion", False))
    # Reuse the very Parameters: optimizers and Megatron's grad buffers keep pointing at them.
    if w is not None:
        linear.weight = w
        _tag(w, spec)
    else:
        linear._parameters["weight"] = None  # lent at call time (tied output layer)
    if m.bias is not None:
        owner = new.bias_op if new.bias_op is not None else new.ops.bias
        sp_tag = getattr(m.bias, "sequence_parallel", None)
        owner.bias = m.bias
        _tag(m.bias, spec if kind == "column" else None)
        if sp_tag is not None:
            m.bias.sequence_parallel = sp_tag  # keep Megatron's tag as it was
    return megatron_adapter(m, new, kind)


def _tag(p: torch.Tensor, spec: Optional[ShardSpec]) -> None:
    """tp-fuse's layout tag, keeping Megatron's own attributes (stride included) as they are."""
    p.tp_shard = spec  # type: ignore[attr-defined]
    if not hasattr(p, "tensor_model_parallel"):
        set_shard_spec(p, spec)


def tag_untouched(model: torch.nn.Module) -> None:
    """Give every parameter wrap did not convert a ``tp_shard`` (for ``grad_norm``,
    ``full_state_dict``...): Megatron's ``tensor_model_parallel``/``partition_dim``/
    ``partition_stride`` attributes where present (e.g. ``VocabParallelEmbedding``),
    replicated otherwise."""
    for p in model.parameters():
        if hasattr(p, "tp_shard"):
            continue
        if getattr(p, "tensor_model_parallel", False):
            p.tp_shard = ShardSpec(dim=int(p.partition_dim), blocks=int(getattr(p, "partition_stride", 1)))
        else:
            p.tp_shard = None
