"""Fusion registry, sliding-window matching and the fusion decision log.

A fusion function takes the current op list and returns a new one in which
some runs of ops were replaced by fused ops:

    def fuse_my_ops(ops: list[FusibleOperation], **kwargs) -> list[FusibleOperation]

It receives keyword arguments ``recipe`` (the active FP8 recipe or None) and
``fusion_log`` (a :class:`FusionLog` to record why windows did or did not
fuse). Functions written for Transformer Engine's signature ``func(ops, *, recipe)``
are called without ``fusion_log`` (see :func:`call_fusion`).

Built-in fusions are written with :func:`fuse_by_window`, whose matcher
returns :class:`Fuse`, :class:`Reject` (with the reason) or ``None`` (the
window does not start with the op this fusion is about), so that every window
a fusion considered and rejected has a reason that ``explain`` can show.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from .op import FusibleOperation, op_display_name

FusionFunction = Callable[..., list[FusibleOperation]]

# The registry is module state by design: the public API
# (register_forward_fusion / register_backward_fusion) is process-wide in
# Transformer Engine too, and fusions are pure functions of the op list.
_FORWARD_BACKWARD_FUSIONS: list[FusionFunction] = []
_FORWARD_FUSIONS: list[FusionFunction] = []
_BACKWARD_FUSIONS: list[FusionFunction] = []


def register_forward_backward_fusion(func: FusionFunction, prepend: bool = False) -> FusionFunction:
    """Register a joint fusion: its fused ops run BOTH the forward and the backward pass.

    Joint fusions are applied first, to the basic ops; the forward-only and
    backward-only fusions then run on the result, so a joint fused op appears in both
    op lists (the same object). Unlike a forward-only or backward-only fused op, a joint
    one need not be interchangeable with the basic ops in each pass separately: its
    forward may save state that only its own backward understands. Later registrations
    run after earlier ones unless ``prepend``. Returns ``func`` (usable as a decorator).
    """
    _register(_FORWARD_BACKWARD_FUSIONS, func, prepend)
    return func


def register_forward_fusion(func: FusionFunction, prepend: bool = False) -> FusionFunction:
    """Register a fusion function applied when fusing forward passes.

    Later registrations run after earlier ones unless ``prepend`` is true.
    Returns ``func`` so it can be used as a decorator.
    """
    _register(_FORWARD_FUSIONS, func, prepend)
    return func


def register_backward_fusion(func: FusionFunction, prepend: bool = False) -> FusionFunction:
    """Register a fusion function applied when fusing backward passes."""
    _register(_BACKWARD_FUSIONS, func, prepend)
    return func


def _register(registry: list[FusionFunction], func: FusionFunction, prepend: bool) -> None:
    if not callable(func):
        raise ValueError(f"fusion function must be callable, got {type(func).__name__}")
    if func in registry:
        return
    if prepend:
        registry.insert(0, func)
    else:
        registry.append(func)


def forward_backward_fusions() -> tuple[FusionFunction, ...]:
    return tuple(_FORWARD_BACKWARD_FUSIONS)


def forward_fusions() -> tuple[FusionFunction, ...]:
    return tuple(_FORWARD_FUSIONS)


def backward_fusions() -> tuple[FusionFunction, ...]:
    return tuple(_BACKWARD_FUSIONS)


def call_fusion(
    func: FusionFunction, ops: list[FusibleOperation], recipe: Any, fusion_log: "FusionLog"
) -> list[FusibleOperation]:
    """``func(ops, recipe=recipe[, fusion_log=fusion_log])``: the log is passed only to
    functions that take it (a ``fusion_log`` parameter or ``**kwargs``), so fusion
    functions written for Transformer Engine (``func(ops, *, recipe)``) run unchanged."""
    if _accepts_fusion_log(func):
        return list(func(ops, recipe=recipe, fusion_log=fusion_log))
    return list(func(ops, recipe=recipe))


@functools.lru_cache(maxsize=None)
def _accepts_fusion_log(func: FusionFunction) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins / C callables: assume the full protocol
        return True
    return any(p.name == "fusion_log" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclasses.dataclass
class FusionRecord:
    """One decision: a window fused, or a window rejected with a reason."""

    direction: str  # "forward" | "backward"
    fusion: str  # name of the fusion function
    window: str  # e.g. "BasicLinear[0] Bias[1] GELU[2]"
    fused: bool
    reason: str  # why rejected, or what the fused op does


class FusionLog:
    """Collects fusion decisions of one fuser for ``explain``."""

    def __init__(self) -> None:
        self.records: list[FusionRecord] = []
        self._direction = "forward"
        self._fusion = "?"
        # Index of each basic op in the fuser, so messages name positions.
        self._positions: dict[int, int] = {}

    def begin(self, direction: str, fusion: FusionFunction, positions: dict[int, int]) -> None:
        self._direction = direction
        self._fusion = getattr(fusion, "__name__", type(fusion).__name__)
        self._positions = positions

    def describe(self, ops: Sequence[FusibleOperation]) -> str:
        parts = []
        for op in ops:
            basic = op.basic_op_list
            pos = self._positions.get(id(basic[0])) if basic else None
            parts.append(op_display_name(op, pos))
        return " ".join(parts)

    def fused(self, ops: Sequence[FusibleOperation], detail: str = "") -> None:
        self.records.append(
            FusionRecord(self._direction, self._fusion, self.describe(ops), True, detail)
        )

    def rejected(self, ops: Sequence[FusibleOperation], reason: str) -> None:
        self.records.append(
            FusionRecord(self._direction, self._fusion, self.describe(ops), False, reason)
        )


@dataclasses.dataclass
class Fuse:
    """Matcher result: replace the first ``length`` ops with ``op``."""

    op: FusibleOperation
    length: int
    detail: str = ""


@dataclasses.dataclass
class Reject:
    """Matcher result: the window of ``length`` ops was considered, not fused."""

    reason: str
    length: int = 1


MatchResult = Optional[Union[Fuse, Reject]]


def fuse_by_window(
    ops: list[FusibleOperation],
    matcher: Callable[[Sequence[FusibleOperation]], MatchResult],
    fusion_log: Optional[FusionLog] = None,
) -> list[FusibleOperation]:
    """Scan ``ops`` left to right, letting ``matcher`` fuse windows.

    ``matcher`` sees the remaining ops starting at the current position and
    returns ``Fuse`` (consume a window), ``Reject`` (record why the window that
    starts here did not fuse) or ``None`` (this position is not a candidate).

    A window containing an op with ``tp_fuse.debug`` features is rejected: those
    features need the op's own GEMM path (see :func:`debug_blocked`).
    """
    out: list[FusibleOperation] = []
    i = 0
    while i < len(ops):
        result = matcher(ops[i:])
        if isinstance(result, Fuse):
            assert 1 <= result.length <= len(ops) - i, "matcher consumed past the end"
            blocked = debug_blocked(ops[i : i + result.length])
            if blocked is not None:
                result = Reject(f"debug features enabled on {blocked}", result.length)
        if isinstance(result, Fuse):
            if fusion_log is not None:
                fusion_log.fused(ops[i : i + result.length], result.detail)
            out.append(result.op)
            i += result.length
            continue
        if isinstance(result, Reject) and fusion_log is not None:
            fusion_log.rejected(ops[i : i + max(1, result.length)], result.reason)
        out.append(ops[i])
        i += 1
    return out


def debug_blocked(ops: Sequence[FusibleOperation]) -> Optional[str]:
    """Name of the first layer in ``ops`` with debug features enabled, or None.

    Ops carry ``debug_hooks`` (a ``tp_fuse.debug.LinearDebugHooks``) only when a debug
    session or FP8-stats collector is attached; only configured features block fusion.
    """
    for op in ops:
        for basic in op.basic_op_list:
            hooks = getattr(basic, "debug_hooks", None)
            if hooks is not None and hooks.features_enabled:
                return hooks.layer_name
    return None


def describe_next(window: Sequence[FusibleOperation], k: int) -> str:
    """Name of the op at position ``k`` of ``window`` for rejection reasons, or
    what lies there when the window ends first."""
    return type(window[k]).__name__ if len(window) > k else "nothing (end of the fused group)"


def type_names(ops: Sequence[FusibleOperation]) -> str:
    return ", ".join(type(op).__name__ for op in ops)
