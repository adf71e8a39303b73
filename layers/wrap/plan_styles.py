"""``wrap()`` plan styles beyond the plain strings: fused column projections.

A fused projection computes several projections with one GEMM: nanoGPT / GPT-2
``c_attn`` = ``[q; k; v]`` (three equal parts), Phi-3's GQA ``qkv_proj`` =
``[q: heads*d; k: kv_heads*d; v: kv_heads*d]`` (unequal parts), Phi-3's ``gate_up_proj``
= ``[gate; up]``. Split as one plain column, rank r gets the r-th contiguous block of
rows (Phi-3 ``[q: 32; k: 16; v: 16]`` at TP=2: rank 0 all of q, rank 1 all of k and v):
the model's own split of the output (``chunk(3)``, ``qkv[..., :query_pos]``) then
separates the wrong features -- silently wrong numbers. :class:`FusedColumn` splits
every part over the TP ranks separately, so rank r holds ``[q_r; k_r; v_r]`` (the
weight's output rows and the bias alike) and a per-rank split with per-rank sizes
(``size / tp`` for every part) separates them again.

This module only describes layouts (``tp_fuse.layers.sharding.ShardSpec``) and checks them; it
never touches a model.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from ..sharding import ShardSpec

__all__ = ["FusedColumn"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class FusedColumn:
    """Plan style for a fused column projection: its output features are parts
    concatenated in order, each split over the TP ranks separately.

    Args:
        parts: an int ``n >= 2`` for ``n`` equal parts (``FusedColumn(3)``: nanoGPT
            ``c_attn``), or the parts' sizes in order (``FusedColumn((256, 64, 64))``),
            which must sum to the module's ``out_features``.
        names: optional names of the parts (``("q", "k", "v")``) used in error messages
            and the wrap report; default ``part0, part1, ...``.
        head_dim: if given, ``parts`` are per-part HEAD counts and the sizes are
            ``heads * head_dim`` (``FusedColumn((8, 2, 2), head_dim=64, names=("q", "k",
            "v"))``); each part's head count must then divide by the TP size (every rank
            needs whole heads), not only its feature count.

    Rank ``r`` of ``tp`` holds, for every part of size ``s``, rows ``[r*s/tp, (r+1)*s/tp)``
    of that part, concatenated in the parts' order; the bias likewise. A
    head-interleaved projection (GPT-NeoX ``query_key_value``: per head ``[q_h, k_h,
    v_h]``) is NOT a fused column: it is a plain ``"column"`` (a contiguous slice of
    whole heads).
    """

    parts: Union[int, tuple[int, ...]]
    names: tuple[str, ...] = ()
    head_dim: Optional[int] = None

    def __post_init__(self) -> None:
        parts = self.parts
        if _is_int(parts):
            if parts < 2:
                raise ValueError(f"FusedColumn: parts must be an int >= 2 or a tuple of >= 2 sizes, got {parts!r}")
            if self.head_dim is not None:
                raise ValueError("FusedColumn: head_dim needs parts as per-part head counts (a tuple), got the "
                                 f"int {parts!r}")
        else:
            try:
                parts = tuple(parts)  # type: ignore[arg-type]
            except TypeError:
                raise ValueError(f"FusedColumn: parts must be an int >= 2 or a tuple of >= 2 sizes, "
                                 f"got {self.parts!r}") from None
            if len(parts) < 2 or not all(_is_int(p) and p > 0 for p in parts):
                raise ValueError(f"FusedColumn: parts must be an int >= 2 or a tuple of >= 2 positive ints, "
                                 f"got {self.parts!r}")
            object.__setattr__(self, "parts", parts)  # frozen: normalise lists to tuples once
        names = tuple(self.names)
        if names and (len(names) != self.count or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"FusedColumn: names must be {self.count} non-empty strings (one per part), "
                             f"got {self.names!r}")
        object.__setattr__(self, "names", names)
        if self.head_dim is not None and not (_is_int(self.head_dim) and self.head_dim > 0):
            raise ValueError(f"FusedColumn: head_dim must be a positive int, got {self.head_dim!r}")

    @property
    def count(self) -> int:
        """Number of parts."""
        return self.parts if _is_int(self.parts) else len(self.parts)  # type: ignore[arg-type]

    def part_name(self, i: int) -> str:
        return self.names[i] if self.names else f"part{i}"

    def sizes(self, out_features: int) -> tuple[int, ...]:
        """The parts' output-feature counts for a projection of ``out_features``
        (ValueError when they do not add up)."""
        if _is_int(self.parts):
            if out_features % self.parts:
                raise ValueError(f"out_features ({out_features}) does not split into {self.parts} equal parts")
            return (out_features // self.parts,) * self.parts  # type: ignore[operator]
        sizes = tuple(p * (self.head_dim or 1) for p in self.parts)  # type: ignore[union-attr]
        if sum(sizes) != out_features:
            what = (f"head counts {list(self.parts)} x head_dim {self.head_dim} give {'+'.join(map(str, sizes))} "
                    f"= {sum(sizes)} features" if self.head_dim else f"split sizes {list(sizes)} sum to {sum(sizes)}")
            raise ValueError(f"{what}, but the weight's out_features is {out_features}")
        return sizes

    def problems(self, out_features: int, tp: int) -> list[str]:
        """What is wrong with this style for a projection of ``out_features`` at TP size
        ``tp`` (empty when it can be sharded): the sizes must add up to ``out_features``
        and every part must split evenly (whole heads with ``head_dim``)."""
        try:
            sizes = self.sizes(out_features)
        except ValueError as e:
            return [str(e)]
        out = []
        for i, size in enumerate(sizes):
            if self.head_dim is not None:
                heads = self.parts[i]  # type: ignore[index]
                if heads % tp:
                    out.append(f"part {self.part_name(i)!r} has {heads} heads ({size} features), not divisible by "
                               f"the TP size ({tp}): every rank needs whole heads")
            elif size % tp:
                out.append(f"part {self.part_name(i)!r} has {size} output features, not divisible by the TP size "
                           f"({tp})")
        return out

    def spec(self, out_features: int) -> ShardSpec:
        """The layout of the weight's output dim (and the bias): equal parts as
        ``ShardSpec(blocks=n)``, unequal ones with their ``sizes``."""
        sizes = self.sizes(out_features)
        if len(set(sizes)) == 1:
            return ShardSpec(dim=0, blocks=len(sizes))
        return ShardSpec(dim=0, sizes=sizes)

    def written(self) -> str:
        """This style as it is written in a plan: ``FusedColumn((48, 16, 16), names=('q', 'k', 'v'))``."""
        args = [repr(self.parts)]
        if self.names:
            args.append(f"names={self.names!r}")
        if self.head_dim is not None:
            args.append(f"head_dim={self.head_dim}")
        return f"FusedColumn({', '.join(args)})"

    def describe(self) -> str:
        """Short form for reports: ``fused_column(parts=3)``,
        ``fused_column(q=256, k=64, v=64)``, ``fused_column(heads q=8, k=2, v=2 x 32)``."""
        if _is_int(self.parts):
            return f"fused_column(parts={self.parts})"
        body = ", ".join(f"{self.part_name(i)}={p}" for i, p in enumerate(self.parts))  # type: ignore[arg-type]
        return f"fused_column(heads {body} x {self.head_dim})" if self.head_dim else f"fused_column({body})"
