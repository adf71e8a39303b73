"""The overlap method as a typed value: :class:`Method` (which algorithm),
:class:`OverlapMethod` (a method plus its chunk count) and :class:`Collective` (which
collective a window runs next to its GEMM).

Strings exist only at the edges: a Megatron YAML's ``method: pipeline`` / ``num_splits: 4``
and the Hydra settings become a :class:`Method` once, in :mod:`tp_fuse.overlap.config`
(ValueError naming the allowed values otherwise); a measured choice is written to and read
from the JSON choice file as its :attr:`OverlapMethod.label` (``"pipeline/4"``), parsed
once by :meth:`OverlapMethod.from_label` when the file is loaded. Between those edges --
the plan of a GEMM stage, the auto-tuner's candidates, the dispatch of
:mod:`tp_fuse.overlap.algorithms` -- the method travels as these values.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
from typing import Union

__all__ = ["CONFIG_METHODS", "LABEL_PATTERN", "Collective", "Method", "OverlapMethod", "candidates", "candidate_labels", "effective_splits"]


class Method(enum.StrEnum):
    """An overlap method. A ``StrEnum``, so ``Method.PIPELINE == "pipeline"`` (the YAML
    spelling) and ``str(m)`` is the spelling users wrote."""

    RING_EXCHANGE = "ring_exchange"  # chunks travel a ring while the GEMM of the chunk held runs
    PIPELINE = "pipeline"  # the rows in num_splits chunks: chunk i's collective || chunk i+1's GEMM
    BULK = "bulk"  # a whole collective behind an independent whole GEMM
    SYMM_MEM = "symm_mem"  # PyTorch's fused symmetric-memory ops (CUDA + NCCL only; auto only)
    UNFUSED = "unfused"  # no overlap: the collective and the whole GEMM one after the other
    AUTO = "auto"  # a config value, never dispatched: measure the candidates, run the fastest


class Collective(enum.StrEnum):
    """The collective of an overlap window: column-parallel ``[AllGather, BasicLinear]``,
    row-parallel ``[BasicLinear, ReduceScatter]`` or ``[BasicLinear, AllReduce]``. Its value
    is the fused ops' keyword for the comm op, and the spelling the compiled path's custom
    ops receive (their schema takes a ``str``)."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


#: The methods a config entry may name besides ``auto`` (Megatron's three).
CONFIG_METHODS: tuple[Method, ...] = (Method.RING_EXCHANGE, Method.PIPELINE, Method.BULK)

#: What an :attr:`OverlapMethod.label` looks like (fullmatch: `$` would accept a trailing newline).
LABEL_PATTERN = re.compile(r"(ring_exchange|bulk|unfused|symm_mem)|pipeline/([1-9][0-9]{0,5})")


@dataclasses.dataclass(frozen=True)
class OverlapMethod:
    """One runnable candidate: a method and, for ``pipeline``, its chunk count.

    ``splits`` is the effective number of chunks (at least 1) for ``PIPELINE`` and 0 for
    every other method. ``AUTO`` is not runnable and has no ``OverlapMethod``.
    """

    method: Method
    splits: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.method, Method) or self.method is Method.AUTO:
            raise ValueError(f"OverlapMethod: method must be a runnable Method, got {self.method!r}")
        s = self.splits
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"OverlapMethod: splits must be an int, got {s!r}")
        if (self.method is Method.PIPELINE) != (s > 0) or s < 0:
            raise ValueError(f"OverlapMethod: splits must be >= 1 for pipeline and 0 otherwise, got {self}")

    @property
    def label(self) -> str:
        """``"pipeline/4"``, ``"ring_exchange"``, ...: the choice file's and ``explain``'s spelling."""
        return f"pipeline/{self.splits}" if self.method is Method.PIPELINE else str(self.method)

    @classmethod
    def from_label(cls, label: str) -> "OverlapMethod":
        """Parse a :attr:`label` (the choice file's boundary); ValueError if it is none."""
        m = LABEL_PATTERN.fullmatch(label) if isinstance(label, str) else None
        if m is None:
            raise ValueError(
                f"not an overlap method label: {label!r} (ring_exchange, bulk, unfused, symm_mem or pipeline/<n>)"
            )
        return cls(Method.PIPELINE, int(m.group(2))) if m.group(2) else cls(Method(m.group(1)))

    @classmethod
    def fixed(cls, method: Method, num_splits: int, rows: int) -> "OverlapMethod":
        """A config entry's method run on ``rows`` rows (``pipeline``: effective splits)."""
        if method is Method.PIPELINE:
            return cls(method, effective_splits(num_splits, rows))
        return cls(method)


def effective_splits(num_splits: int, rows: int) -> int:
    """Chunks of a pipelined overlap: ``num_splits``, or one per row when a rank has fewer
    rows than that (a sequence shorter than the configured split count runs a shorter
    pipeline with the same result rather than failing where the unfused ops work)."""
    return max(1, min(num_splits, rows))


def candidates(methods: Iterable[Union[Method, str]], splits: Iterable[int], rows: int,
               extra: Iterable[OverlapMethod] = ()) -> list[OverlapMethod]:
    """What ``method: auto`` measures for a window that can use ``methods``: ``pipeline``
    once per distinct effective split count, then ``extra`` (methods the window can run
    besides the config's, e.g. ``symm_mem`` where PyTorch's fused ops exist), then
    ``unfused`` last."""
    out: list[OverlapMethod] = []
    for method in methods:
        method = Method(method)
        if method is Method.PIPELINE:
            for n in sorted(set(splits)):
                m = OverlapMethod.fixed(method, n, rows)
                if m not in out:
                    out.append(m)
        else:
            out.append(OverlapMethod(method))
    for m in extra:
        if not isinstance(m, OverlapMethod) or m.method is Method.UNFUSED or m in out:
            raise ValueError(f"candidates: extra candidate {m!r} is not a new overlap method")
        out.append(m)
    out.append(OverlapMethod(Method.UNFUSED))
    return out


def candidate_labels(methods: Iterable[Union[Method, str]], splits: Iterable[int], rows: int,
                     extra: Iterable[Union[OverlapMethod, str]] = ()) -> list[str]:
    """:func:`candidates` as labels (``["pipeline/2", "ring_exchange", "unfused"]``); an
    ``extra`` label is parsed with :meth:`OverlapMethod.from_label` (ValueError if none)."""
    typed = []
    for m in extra:
        if isinstance(m, str):
            try:
                m = OverlapMethod.from_label(m)
            except ValueError:
                raise ValueError(f"candidate_labels: extra label {m!r} is not a new method label") from None
        typed.append(m)
    try:
        return [m.label for m in candidates(methods, splits, rows, typed)]
    except ValueError as e:
        raise ValueError(f"candidate_labels: extra label is not a new method label ({e})") from None
