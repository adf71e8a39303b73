"""``wrap()`` for plain modules named by a plan: ``nn.Linear`` / GPT-2 ``Conv1D`` as column,
fused column or row projections, RMSNorms as sharded norms. Their checks, their
conversion, and the check that their full weights agree across the TP ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.overlap.config import TPOverlap

from ..parallel_linear import ColumnParallelLinear, RowParallelLinear
from ..sharding import ShardSpec, set_shard_spec, shard_tensor, tp_rank_and_size
from .modules import HF_RMS_NORMS, ParallelLinearAdapter, ShardedRMSNorm
from .plan_styles import FusedColumn

__all__ = ["NORMS", "no_init", "is_conv1d", "linear_sizes", "style_name", "plain_problems", "rms_norm_params",
           "convert_sharded_norm", "convert_plain", "check_replicated"]

NORMS: tuple[type, ...] = tuple(t for t in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", None)) if t)


def no_init(t: torch.Tensor) -> None:
    """The weight is replaced right after construction: skip drawing random numbers."""


def is_conv1d(m: torch.nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers.pytorch_utils), by name and layout: ``y = x W + b``
    with ``W [in, out]`` (the transpose of ``nn.Linear``'s)."""
    return (type(m).__name__ == "Conv1D" and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 2 and getattr(m, "nf", None) == m.weight.shape[1])


def linear_sizes(m: torch.nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return m.in_features, m.out_features


def style_name(style: Any) -> str:
    return style.describe() if isinstance(style, FusedColumn) else str(style)


def plain_problems(name: str, m: torch.nn.Module, style: Any, tp: int) -> list[str]:
    if style in ("column", "row") or isinstance(style, FusedColumn):
        if type(m) is not torch.nn.Linear and not is_conv1d(m):
            return [f"{name}: plan style {style_name(style)!r} needs a torch.nn.Linear (or GPT-2 Conv1D), "
                    f"got {type(m).__name__}"]
        in_f, out_f = linear_sizes(m)
        if isinstance(style, FusedColumn):
            return [f"{name}: {style_name(style)}: {p}" for p in style.problems(out_f, tp)]
        if style == "column" and out_f % tp:
            return [f"{name}: out_features ({out_f}) is not divisible by the TP size ({tp})"]
        if style == "row" and in_f % tp:
            return [f"{name}: in_features ({in_f}) is not divisible by the TP size ({tp})"]
        return []
    if style == "sharded_norm":
        return sharded_norm_problems(name, m, tp)
    if not isinstance(m, NORMS):
        return [f"{name}: plan style 'sequence_parallel' needs a LayerNorm/RMSNorm, got {type(m).__name__}"]
    return []


def rms_norm_params(m: torch.nn.Module) -> Optional[tuple[Optional[torch.Tensor], int, Optional[float], bool]]:
    """``(weight, width, eps, weight_after_cast)`` of an RMSNorm that ``ShardedRMSNorm``
    reproduces exactly, or None. Llama-family RMSNorms multiply the weight after casting
    back to the input dtype, OLMo2's before."""
    rms = getattr(torch.nn, "RMSNorm", None)
    if rms is not None and type(m) is rms:
        if len(m.normalized_shape) != 1:
            return None
        return m.weight, int(m.normalized_shape[0]), m.eps, False
    if type(m).__name__ in HF_RMS_NORMS:
        w = getattr(m, "weight", None)
        eps = getattr(m, "variance_epsilon", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1 or not isinstance(eps, float):
            return None
        return w, int(w.shape[0]), eps, type(m).__name__ != "Olmo2RMSNorm"
    return None


def sharded_norm_problems(name: str, m: torch.nn.Module, tp: int) -> list[str]:
    params = rms_norm_params(m)
    if params is None:
        return [f"{name}: plan style 'sharded_norm' needs a torch.nn.RMSNorm over one dimension or one of the "
                f"Hugging Face RMSNorms {list(HF_RMS_NORMS)} (whose formula it reproduces), got "
                f"{type(m).__name__}"]
    if params[1] % tp:
        return [f"{name}: its {params[1]} features are not divisible by the TP size ({tp})"]
    return []


def convert_sharded_norm(m: torch.nn.Module, tp_group: dist.ProcessGroup) -> ShardedRMSNorm:
    rank, size = tp_rank_and_size(tp_group)
    weight, width, eps, after_cast = rms_norm_params(m)  # type: ignore[misc] - checked before
    spec = ShardSpec(dim=0)
    local = shard_tensor(weight.detach(), spec, rank, size).clone() if weight is not None else None
    new = ShardedRMSNorm(local, width, eps, tp_group, weight_after_cast=after_cast)
    if new.weight is not None:
        new.weight.requires_grad_(weight.requires_grad)
        set_shard_spec(new.weight, spec)
    return new


def convert_plain(m: torch.nn.Module, style: Any, tp_group: dist.ProcessGroup, sequence_parallel: bool,
                   overlap: Optional[TPOverlap]) -> torch.nn.Module:
    rank, size = tp_rank_and_size(tp_group)
    conv1d = is_conv1d(m)
    w = m.weight.t() if conv1d else m.weight  # [out, in]
    in_f, out_f = linear_sizes(m)
    common = dict(tp_group=tp_group, bias=m.bias is not None, sequence_parallel=sequence_parallel,
                  init_method=no_init, seed=None, overlap=overlap, dtype=w.dtype, device=w.device)
    if style == "row":
        layer: torch.nn.Module = RowParallelLinear(in_f, out_f, **common)
        wspec, bspec = ShardSpec(dim=1), None
    else:
        layer = ColumnParallelLinear(in_f, out_f, **common)
        # A fused projection: every part split separately, rank r holds [q_r; k_r; v_r].
        wspec = bspec = style.spec(out_f) if isinstance(style, FusedColumn) else ShardSpec(dim=0)
    with torch.no_grad():
        layer.weight.copy_(shard_tensor(w, wspec, rank, size))
        if m.bias is not None:
            layer.bias.copy_(shard_tensor(m.bias, bspec, rank, size))
    set_shard_spec(layer.weight, wspec)
    if m.bias is not None:
        set_shard_spec(layer.bias, bspec)
    return ParallelLinearAdapter(layer, in_f, out_f, transposed=conv1d)


def check_replicated(named: list[tuple[str, torch.nn.Module]], tp_group: dist.ProcessGroup) -> list[str]:
    """Full weights must agree across TP ranks (else the shards would not form one model)."""
    if not named:
        return []
    sums = torch.tensor([[float(p.detach().double().sum()), float(p.detach().double().abs().sum())]
                         for _, m in named for p in m.parameters()], dtype=torch.float64)
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, sums, group=tp_group)
    bad = torch.zeros(sums.shape[0], dtype=torch.bool)
    for g in gathered:
        bad |= (g != sums).any(dim=1)
    out, k = [], 0
    for name, m in named:
        n = sum(1 for _ in m.parameters())
        if bool(bad[k:k + n].any()):
            out.append(f"{name}: parameters differ across TP ranks (seed every rank the same before building the model)")
        k += n
    return out
