"""Per-head and per-feature tensors left whole inside the sharded region (issue 39, point 3).

After ``wrap`` each rank holds only its share of the heads (and of a column projection's
output features) between a column-parallel projection and its row-parallel partner. A
tensor used there that is indexed by head -- GPT-OSS's attention ``sinks`` (``[heads]``),
Doge's ``A`` (``[kv_heads]``) and ``dt_proj`` (a Linear over all heads' values), MPT's
ALiBi bias built by the model for all heads (``[heads, 1, seq]``) -- keeps its full size
on every rank: the wrapped model's first forward fails on the shapes (or, where they
broadcast, computes wrong numbers).

:func:`per_head_check` builds the trace's check for them: a replicated parameter (or a
tensor computed from parameters only), or a constant tensor (no gradient: a bias the model
builds), that meets a TP-sharded tensor in one op and has a dimension of a size the plan
splits -- a head count (``config.num_attention_heads``, ``num_key_value_heads``) or the
output width of a column projection (or of one of its fused parts) -- that the sharded
tensor also has (not its batch dim). Sizes equal to the head width are ignored (a per-head
norm's ``[head_dim]`` weight is shared by all heads; its gradient is summed), so a model
whose head count equals its head width is left to verification.

A one-dimensional parameter with one entry per head (GPT-OSS's ``sinks``, ``[heads]``) is
sharded with the heads instead: rank r keeps the entries of its heads (every plan style
gives a rank a contiguous run of whole heads), ``ShardSpec(dim=0)``, its gradient this
rank's own. Anything else is a problem naming the module, the tensor (the parameter's
name, or its shape for a constant), the plan entry whose output it meets, and what to
write instead: exclude the block that holds both (it then stays replicated), or a
``fixup=`` that slices the tensor per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, Optional, Union

import torch

__all__ = ["HeadCheck", "HeadShard", "per_head_check", "split_sizes"]


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """A one-dimensional parameter with one entry per head (GPT-OSS's ``sinks``): sharded
    with the heads (rank r keeps its heads' entries) instead of refused."""

    name: str
    where: str


#: ``check(module, parameter names (empty: a constant), tensor, sharded tensor it meets,
#: the column projection that sharded tensor comes from, op name)`` -> a problem line, a
#: :class:`HeadShard`, or None.
HeadCheck = Callable[[str, list[str], torch.Tensor, torch.Tensor, str, str], Union[None, str, HeadShard]]


def split_sizes(config: object, widths: Mapping[int, list[str]]) -> tuple[dict[int, str], set[int]]:
    """``({size the plan splits: what it is}, {sizes to ignore: the head width})`` for a
    model with ``config`` (may be None) whose column projections have ``widths``."""
    sizes: dict[int, str] = {}
    ignore: set[int] = set()
    heads = getattr(config, "num_attention_heads", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            sizes.setdefault(v, f"config.{attr} = {v}")
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(head_dim, int) and isinstance(heads, int) and isinstance(hidden, int) and heads:
        head_dim = hidden // heads
    if isinstance(head_dim, int):
        ignore.add(head_dim)
    for width, names in widths.items():
        if width > 1:
            sizes.setdefault(width, f"the output width of {names[0]} ({width})")
    return sizes, ignore


def per_head_check(sizes: Mapping[int, str], ignore: set[int], entries: Mapping[str, str],
                   exclude_for: Callable[[str, str], str], vectors: Mapping[str, int]) -> HeadCheck:
    """The trace's check (see the module docstring). ``entries``: ``{column: its plan
    entry}``; ``exclude_for(module, column)``: the block to exclude that holds both;
    ``vectors``: ``{parameter name: size}`` of the one-dimensional parameters: one with an
    entry per head (its size a head count) is sharded with the heads instead."""

    def check(where: str, params: list[str], t: torch.Tensor, sharded: torch.Tensor, origin: str,
              op: str) -> Union[None, str, HeadShard]:
        if t.dim() == 0 or t.numel() == 1:
            return None
        hit = _aligned_hit(t.shape, sharded.shape, sizes, ignore)
        if hit is None:
            return None
        if len(params) == 1 and vectors.get(params[0]) == hit and sizes[hit].startswith("config."):
            return HeadShard(params[0], where)
        what = (f"parameter {params[0]} {tuple(t.shape)}" if params
                else f"a constant tensor {tuple(t.shape)} (computed by the model, e.g. an ALiBi bias built for all "
                     f"heads)")
        entry = entries.get(origin, origin)
        block = exclude_for(where, origin)
        return (f"{where}: {what} has a dimension of {hit} ({sizes[hit]}) and meets the TP-sharded output of "
                f"{origin} ({entry}) in {op}: after wrap each rank holds only its share of those {hit}, but this "
                f"tensor stays whole (a shape error, or wrong numbers). wrap does not shard it: exclude "
                f"{block!r} (it stays replicated), or pass wrap(fixup=f) that gives each rank its slice of it")

    return check


def _aligned_hit(mine: torch.Size, theirs: torch.Size, sizes: Mapping[int, str], ignore: set[int]) -> Optional[int]:
    """A size the plan splits that ``mine`` and ``theirs`` share at the same position,
    aligned from the last dim as broadcasting (and ``cat``, ``linear``'s contraction) does;
    not the sharded tensor's first dim when it has more than one (the batch), nor the last
    dim of a 4-D or larger one (``[batch, heads, seq, head_dim]``: within one head, where a
    partial rotary width may equal a head count)."""
    for i in range(1, min(len(mine), len(theirs)) + 1):
        if i == len(theirs) and len(theirs) > 1:
            break
        if i == 1 and len(theirs) >= 4:
            continue
        size = mine[-i]
        if size == theirs[-i] and size in sizes and size not in ignore:
            return size
    return None
