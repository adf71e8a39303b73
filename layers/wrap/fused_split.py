"""Fused projections found by the trace, not by the plan (issue 39, point 2).

A fused projection computes several projections with one GEMM, and the model splits its
output: GPT-2 / nanoGPT ``c_attn(x).split(E, dim=2)``, Phi-3 ``qkv[..., :q_end]``, a
gated MLP's ``gate_up.chunk(2, dim=-1)``, CodeGen's ``qkv.reshape(..., 4, -1)`` then
``split``, DiffLlama's ``chunk(2, dim=1)`` of the value heads. Sharded as one plain
``"column"``, rank r holds the r-th contiguous block of the output features, and the
model's split separates the wrong features: wrong numbers, no error. It must be a
``FusedColumn`` whose parts are exactly the pieces the model splits off, in their order.

:class:`SplitWatcher` follows the output of each column projection through the ops that
only rearrange its features (``view``/``reshape``, ``transpose``/``permute``,
``contiguous``, casts) and records where an op cuts them (``split``, ``chunk``,
``tensor_split``, ``unbind``, ``narrow``, indexing): the cut points of the output's
feature dim, or -- after a reshape into ``[blocks, inner]`` -- of the inner dim of each
block. Blocks are harmless when their count follows the TP size on the wrapped model
(a head count: stored on the module, which ``wrap`` localizes, or the model config's --
GPT-NeoX's and Bloom's per-head ``[q, k, v]``, GPT-NeoX's count given as ``-1``); any other
count is fixed, ``-1`` or not: CodeGen's ``view(..., -1, 3 * embed_dim // mp_num)`` makes
``mp_num = 4`` blocks of ``[q; v; k]`` whatever the TP size (``embed_dim`` is localized),
each of 2 of its 8 heads. No plan entry shards that layout: a ``FusedColumn`` of the
12 parts gives each rank heads from every block, and the row projection after the
attention takes a contiguous range of heads; the block is refused with the exclude that
keeps it replicated; so is a cut across whole heads (DiffLlama's ``chunk(2, dim=1)`` of
the value heads, pairing head i with head i + heads/2, a pairing its output side follows
too). (On the wrapped model, traced on its first forward, the config's
head counts are not the local ones: there a ``-1`` count follows the TP size.)

:func:`fused_problems` compares what the model does with the plan: a plain ``"column"``
whose output is cut into parts, and a ``FusedColumn`` whose parts are not the pieces cut
(the wrong order of unequal parts), are refused with the plan entry to write instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from .checks import name_pattern
from .heads import HEAD_ATTRS, KV_HEAD_ATTRS
from .plan_styles import FusedColumn

__all__ = ["SplitWatcher", "Cuts", "fused_problems", "suggested_style"]

# Ops that keep every element where it is (the layout is the input's), when the output
# has the input's shape and no other tensor takes part (DBRX clamps its qkv before the split).
_SAME = frozenset({"contiguous", "float", "double", "half", "bfloat16", "to", "type", "type_as", "clone",
                   "detach", "clamp", "clamp_", "clip", "clip_", "mul", "__mul__", "__rmul__", "add", "__add__",
                   "__radd__", "sub", "__sub__", "div", "__truediv__", "neg", "relu", "gelu", "silu", "tanh",
                   "sigmoid", "dropout"})
_VIEWS = frozenset({"view", "reshape"})
_SPLITS = frozenset({"split", "split_with_sizes", "chunk", "tensor_split", "unbind", "narrow", "__getitem__",
                     "unsafe_split"})


@dataclasses.dataclass(frozen=True)
class _Factor:
    """One dim of a tensor that indexes the projection's output features: feature index
    ``+= i * stride`` for ``i < size``; ``scales``: its count follows the TP size on the
    wrapped model (``-1`` in the reshape, or a head count wrap localizes)."""

    stride: int
    size: int
    scales: bool = True


@dataclasses.dataclass
class Cuts:
    """Where the model cut one projection's output features.

    ``blocks == 1``: cut points in ``[0, width)`` of the whole output; ``blocks > 1``: the
    output was reshaped into ``blocks`` blocks and each block cut at ``points`` (in
    ``[0, width / blocks)``); ``scales``: the block count follows the TP size."""

    width: int
    blocks: int = 1
    scales: bool = True
    points: set[int] = dataclasses.field(default_factory=set)
    how: str = ""
    where: str = ""  # the module whose forward cut it
    heads: bool = False  # cut along a dim of whole heads (after a view into [heads, head_dim])

    def parts(self) -> tuple[int, ...]:
        """The pieces cut, in order (every block's, for a fixed block count)."""
        inner = self.width // self.blocks
        edges = sorted({0, inner, *self.points})
        sizes = tuple(b - a for a, b in zip(edges, edges[1:]))
        return sizes * (self.blocks if not self.scales else 1)


class SplitWatcher:
    """Follows column outputs through rearranging ops and records their cuts (by tensor
    ``id``; the followed tensors are kept alive until the trace ends)."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], local: bool = False) -> None:
        self.modules = modules
        self.local = local  # the wrapped model's first forward: module head counts are per rank, the config's not
        config = getattr(modules.get(""), "config", None)
        self.config_heads = {v for a in HEAD_ATTRS + KV_HEAD_ATTRS + ("num_attention_heads", "num_key_value_heads")
                             if isinstance(v := getattr(config, a, None), int) and not isinstance(v, bool)}
        self.layouts: dict[int, tuple[str, tuple[Optional[_Factor], ...]]] = {}
        self.cuts: dict[tuple[str, int], Cuts] = {}
        self.keep: list[torch.Tensor] = []

    def column_output(self, name: str, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.dim() >= 1:
            self._follow(out, name, (None,) * (out.dim() - 1) + (_Factor(1, out.shape[-1]),))

    def _follow(self, t: torch.Tensor, name: str, dims: tuple[Optional[_Factor], ...]) -> None:
        self.layouts[id(t)] = (name, dims)
        self.keep.append(t)

    def watches(self, tensors: list[torch.Tensor]) -> bool:
        return any(id(t) in self.layouts for t in tensors)

    def observe(self, func: Callable, args: tuple, kwargs: dict, out: Any, where: str) -> None:
        """One op seen by the trace; ``where``: the module running it."""
        fname = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is None or id(src) not in self.layouts:
            return
        name, dims = self.layouts[id(src)]
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        if fname in _SAME and isinstance(out, torch.Tensor) and out.shape == src.shape and not others:
            self._follow(out, name, dims)
        elif fname in _VIEWS and isinstance(out, torch.Tensor):
            self._view(src, out, name, dims, args, kwargs, where)
        elif fname in ("transpose", "swapaxes", "permute") and isinstance(out, torch.Tensor):
            self._permute(src, out, name, dims, fname, args, kwargs)
        elif fname in _SPLITS:
            self._cut(src, name, dims, fname, args, kwargs, where)

    # -- rearranging ------------------------------------------------------------------------
    def _view(self, src: torch.Tensor, out: torch.Tensor, name: str, dims: tuple, args: tuple, kwargs: dict,
              where: str) -> None:
        factors = [d for d in dims if d is not None]
        if len(factors) != 1 or dims[-1] is None or factors[0].stride != 1:
            return  # only a whole, unsplit feature dim (the projection's output) is reshaped
        lead = src.shape[:-1]
        if tuple(out.shape[:len(lead)]) != tuple(lead):
            return
        tail = tuple(out.shape[len(lead):])
        if not tail or int(torch.tensor(tail).prod()) != src.shape[-1]:
            return
        asked = tuple(args[1:])
        if len(asked) == 1 and isinstance(asked[0], (tuple, list, torch.Size)):
            asked = tuple(asked[0])
        asked = tuple(kwargs.get("shape", kwargs.get("size", asked)))
        outer_pos = len(lead)
        outer_asked = asked[outer_pos] if len(asked) == out.dim() else -1
        heads = self._head_counts(where)
        stride, new = src.shape[-1], []
        for i, size in enumerate(tail):
            stride //= size
            scales = i > 0 or size in heads or (outer_asked == -1 and (self.local or not heads))
            new.append(_Factor(stride, size, scales))
        self._follow(out, name, (None,) * len(lead) + tuple(new))

    def _head_counts(self, where: str) -> set[int]:
        """Head counts stored on the module ``where`` (wrap localizes them), and on the
        original model's config."""
        m = self.modules.get(where)
        attrs = vars(m) if m is not None else {}
        stored = {v for a in HEAD_ATTRS + KV_HEAD_ATTRS if isinstance(v := attrs.get(a), int)}
        return stored | (self.config_heads if not self.local else set())

    def _permute(self, src: torch.Tensor, out: torch.Tensor, name: str, dims: tuple, fname: str, args: tuple,
                 kwargs: dict) -> None:
        n = src.dim()
        if fname == "permute":
            order = args[1:] if len(args) > 2 or isinstance(args[1], int) else tuple(args[1])
            order = [o % n for o in order]
        else:
            a, b = (kwargs.get(k, v) for k, v in zip(("dim0", "dim1"), args[1:3]))
            order = list(range(n))
            order[a % n], order[b % n] = order[b % n], order[a % n]
        self._follow(out, name, tuple(dims[o] for o in order))

    # -- cutting ------------------------------------------------------------------------------
    def _cut(self, src: torch.Tensor, name: str, dims: tuple, fname: str, args: tuple, kwargs: dict,
             where: str) -> None:
        for dim, points in _cut_points(src, fname, args, kwargs):
            factor = dims[dim] if -len(dims) <= dim < len(dims) else None
            points = {p for p in points if 0 < p < src.shape[dim]}
            if factor is None or not points:
                continue
            width = _width(dims)
            outer = [d for d in dims if d is not None and d.stride > factor.stride]
            if factor.stride * factor.size == width:  # the outermost factor: cuts of the whole output
                key, cuts = (name, 1), Cuts(width)
                scaled = {p * factor.stride for p in points}
            elif len(outer) == 1 and outer[0].stride == factor.stride * factor.size:  # inside each block
                key, cuts = (name, outer[0].size), Cuts(width, outer[0].size, outer[0].scales)
                scaled = {p * factor.stride for p in points}
            else:
                continue
            entry = self.cuts.setdefault(key, cuts)
            entry.points |= scaled
            entry.how = entry.how or f"{'indexing' if fname == '__getitem__' else fname} in {where}"
            entry.where = entry.where or where
            entry.heads = entry.heads or factor.stride > 1


def _width(dims: tuple) -> int:
    width = 1
    for d in dims:
        if d is not None:
            width *= d.size
    return width


def _arg(args: tuple, kwargs: dict, index: int, *names: str, default: Any = None) -> Any:
    """Argument ``index`` of an op (``args[0]`` is the tensor), or its keyword."""
    if len(args) > index:
        return args[index]
    return next((kwargs[n] for n in names if n in kwargs), default)


def _cut_points(src: torch.Tensor, fname: str, args: tuple, kwargs: dict) -> list[tuple[int, set[int]]]:
    """``[(dim, cut points)]`` of a cutting op on ``src``."""
    if fname == "__getitem__":
        return _index_cuts(src, _arg(args, kwargs, 1, "index"))
    if fname == "narrow":
        dim, start, length = (_arg(args, kwargs, i, n) for i, n in ((1, "dim"), (2, "start"), (3, "length")))
        return [(int(dim), {int(start), int(start) + int(length)})]
    if fname == "unbind":
        dim = int(_arg(args, kwargs, 1, "dim", default=0))
        return [(dim, set(range(1, src.shape[dim])))]
    dim = _arg(args, kwargs, 2, "dim", default=0)
    arg = _arg(args, kwargs, 1, "split_size_or_sections", "split_size", "split_sizes", "chunks",
               "indices_or_sections", "sections")
    if not isinstance(dim, int):
        return []
    size = src.shape[dim]
    if fname == "chunk" and isinstance(arg, int):
        step = -(-size // arg)  # torch.chunk's chunk size
        return [(dim, set(range(step, size, step)))]
    if fname == "tensor_split":
        if isinstance(arg, int):
            return [(dim, {size * i // arg for i in range(1, arg)})]
        return [(dim, {int(i) for i in arg})]
    if isinstance(arg, int):  # split(size): pieces of that size
        return [(dim, set(range(arg, size, arg)))]
    if isinstance(arg, (list, tuple)):  # split([sizes])
        return [(dim, _edges(tuple(int(a) for a in arg)))]
    return []


def _index_cuts(src: torch.Tensor, index: Any) -> list[tuple[int, set[int]]]:
    """Cut points of ``src[index]`` per indexed dim (slices and ints)."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
        return []  # tensor / bool indexing: not a cut of a fixed layout
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, dim = [], 0
    for i in items:
        if i is Ellipsis:
            dim += src.dim() - used
        elif i is None:
            continue
        else:
            size = src.shape[dim]
            if isinstance(i, int):
                j = i % size
                out.append((dim, {j, j + 1}))
            elif i.step in (None, 1):
                start, stop, _ = i.indices(size)
                out.append((dim, {start, stop}))
            dim += 1
    return out


def _edges(parts: tuple[int, ...]) -> set[int]:
    """The inner boundaries of consecutive parts."""
    edges, total = set(), 0
    for p in parts[:-1]:
        total += p
        edges.add(total)
    return edges


def suggested_style(parts: tuple[int, ...]) -> str:
    """The ``FusedColumn`` plan entry for these parts, as the user writes it."""
    if len(set(parts)) == 1:
        return f"FusedColumn({len(parts)})"
    return f"FusedColumn({tuple(parts)!r})"


def fused_problems(cuts: Mapping[tuple[str, int], Cuts], styles: Mapping[str, Any], entries: Mapping[str, str],
                   tp: int, local: bool) -> list[str]:
    """The problem lines for the columns whose plan does not match how the model cuts
    their output. ``styles``/``entries``: each column's plan style and ``plan[...]`` text;
    ``local``: the cuts were seen on the wrapped model (per-rank widths: scaled by ``tp``)."""
    problems = []
    for (name, _), cut in cuts.items():
        style = styles.get(name)
        if style is None or (cut.blocks > 1 and cut.scales):
            continue  # per-head blocks whose count wrap localizes: a contiguous slice of heads is right
        parts = tuple(p * tp for p in cut.parts()) if local else cut.parts()
        width = cut.width * tp if local else cut.width
        if len(parts) < 2:
            continue
        inner = [p * (tp if local else 1) for p in cut.parts()[:len(parts) // cut.blocks]]
        layout = (f"reshaped into {cut.blocks} blocks (a fixed count, not a head count wrap localizes) and each "
                  f"block cut into {inner}" if cut.blocks > 1 else f"cut into parts of {list(parts)} features")
        odd = [p for p in parts if p % tp]
        if cut.heads and cut.blocks == 1:
            fix = (f"The model pairs heads across those parts (it cuts the heads, not the features: DiffLlama's "
                   f"chunk(2, dim=1)), and its other projections follow the pairing too, which no plan style "
                   f"expresses: exclude {name_pattern(cut.where)!r} (it stays replicated)")
        elif cut.blocks > 1:
            fix = (f"No plan entry shards this layout (each rank would take heads from all {cut.blocks} blocks, while "
                   f"the row projection after them takes a contiguous range): exclude {name_pattern(cut.where)!r} "
                   f"(it stays replicated)")
        elif odd:
            fix = (f"no split over {tp} ranks exists (a part of {odd[0]} features): exclude the block that holds "
                   f"{name}")
        else:
            fix = f"Write {entries[name].split(' = ')[0]} = {suggested_style(parts)} (each part split over the ranks, " \
                  f"in this order)"
        if isinstance(style, FusedColumn) and (cut.blocks > 1 or cut.heads):
            problems.append(f"{name}: {entries[name]}, but the model's forward ({cut.how}) has its output {layout}. "
                            f"{fix}")
        elif style == "column":
            problems.append(f"{name}: {entries[name]}, but the model's forward ({cut.how}) has its output {layout}: "
                            f"a fused projection. As one column each rank would hold a contiguous block of the "
                            f"{width} features and the model's split would separate the wrong ones (wrong numbers, "
                            f"no error). {fix}")
        elif isinstance(style, FusedColumn) and not _edges(parts) <= _edges(style.sizes(width)):
            # A cut inside one of the plan's parts: that part's features are not the piece
            # the model takes (the wrong order of unequal parts). Parts finer than the cuts
            # (a piece the model splits again later) cannot be judged here.
            problems.append(f"{name}: {entries[name]} has parts {list(style.sizes(width))}, but the model's forward "
                            f"({cut.how}) has its output {layout}; the parts must be those pieces, in that order. "
                            f"{fix}")
    return problems
