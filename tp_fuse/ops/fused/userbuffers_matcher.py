"""The one matcher of the tensor-parallel overlap fusions (Transformer Engine's
``UserbuffersForwardLinear`` / ``UserbuffersBackwardLinear`` and the GEMM+all-reduce).

A window is a collective next to a GEMM:

* column-parallel ``[AllGather, BasicLinear(, Bias)]``,
* row-parallel ``[BasicLinear(, Bias), ReduceScatter]`` or ``[BasicLinear(, Bias), AllReduce]``.

Each (direction, collective) has one row of :data:`_RULES`: the GEMM stage and parallel
role whose config entry decides the method, the methods that cannot apply to the window
(with the reason the matcher rejects them with), the fused op that runs it, and what an
FP8 all-gather of the window moves. :func:`_match` applies a row to a window; every window
it does not fuse gets a reason for ``explain``:

* the collective does not sit next to a GEMM (``AllGather followed by LayerNorm, not
  BasicLinear: ...``, ``ReduceScatter preceded by GELU, not BasicLinear(+Bias): ...``);
* a Bias that cannot go into the GEMM's epilogue (column-parallel: the window fuses without
  it, and says so; row-parallel: the Bias sits between GEMM and collective, no fusion);
* TP size 1, a ``BasicLinear`` that all-reduces its own dgrad, overlap disabled by the
  config or for the GEMM stage, a method that does not apply to the window;
* FP8 all-gathers without one scale on every TP rank.

The registered fusion functions are three entry points into the one matcher (their names
are what ``explain`` records as the fusion): forward all-gather/reduce-scatter windows,
forward all-reduce windows (a separate pass, so that ``[AllGather, AllReduce]`` is reported
from both sides), and backward windows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from ...overlap.method import Collective, Method
from ..basic._tp import TPCommOperation
from ..basic.all_gather import AllGather
from ..basic.all_reduce import AllReduce
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.reduce_scatter import ReduceScatter
from ..fusion import Fuse, FusionLog, MatchResult, Reject, describe_next, fuse_by_window
from ..op import FusibleOperation
from .forward_linear_bias_activation import linear_bias_mismatch
from .userbuffers_backward_linear import UserbuffersBackwardLinear
from .userbuffers_common import (
    fp8_gather_problem,
    gemm_label,
    plan_overlap,
)
from .userbuffers_forward_linear import UserbuffersForwardLinear
from .userbuffers_forward_linear_all_reduce import UserbuffersForwardLinearAllReduce

__all__ = [
    "fuse_userbuffers_backward_linear",
    "fuse_userbuffers_forward_linear",
    "fuse_userbuffers_forward_linear_all_reduce",
]

_BULK_NEEDS_INDEPENDENT = "bulk hides a collective behind an independent computation, but "


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one kind of window fuses in one direction.

    ``no_gemm``: what is missing when the collective has no GEMM beside it (the end of the
    rejection reason); ``unsupported``: method -> why this window cannot use it;
    ``gathers_fp8``: what an FP8 all-gather of this window moves (``"the input of"``,
    ``"dy of"``; None: nothing FP8 is gathered), checked for one scale on all TP ranks.
    """

    collective: type
    stage: str
    role: str
    fused_op: type
    no_gemm: str
    unsupported: Mapping[Method, str] = dataclasses.field(default_factory=dict)
    gathers_fp8: Optional[str] = None


_RULES: dict[tuple[str, type], _Rule] = {
    ("forward", AllGather): _Rule(
        AllGather, "fprop", "column", UserbuffersForwardLinear, "no GEMM to overlap the gather with",
        {
            Method.PIPELINE: "pipeline overlaps a reduce-scatter (Megatron uses it for proj/fc2 fprop); "
            "an all-gather+GEMM overlaps by ring_exchange",
            Method.BULK: _BULK_NEEDS_INDEPENDENT + "this GEMM needs the gathered input; use ring_exchange",
        },
        gathers_fp8="the input of",
    ),
    ("forward", ReduceScatter): _Rule(
        ReduceScatter, "fprop", "row", UserbuffersForwardLinear, "no GEMM to overlap the reduce-scatter with",
        {Method.BULK: _BULK_NEEDS_INDEPENDENT + "the reduce-scatter needs this GEMM's output; use pipeline or "
                                                "ring_exchange"},
    ),
    ("forward", AllReduce): _Rule(
        AllReduce, "fprop", "row", UserbuffersForwardLinearAllReduce, "no GEMM to overlap the all-reduce with",
        {
            Method.RING_EXCHANGE: "a GEMM+all-reduce overlaps by chunks (method pipeline, num_splits chunks); "
            "ring_exchange applies to all-gathers and reduce-scatters",
            Method.BULK: _BULK_NEEDS_INDEPENDENT + "the all-reduce needs this GEMM's output; use pipeline",
        },
    ),
    ("backward", AllGather): _Rule(
        AllGather, "dgrad", "column", UserbuffersBackwardLinear,
        "no dgrad GEMM to overlap the reduce-scatter of dx with",
    ),
    ("backward", ReduceScatter): _Rule(
        ReduceScatter, "dgrad", "row", UserbuffersBackwardLinear, "no dgrad GEMM to overlap the all-gather of dy with",
        {
            Method.PIPELINE: "pipeline overlaps a reduce-scatter; this backward all-gathers dy, which overlaps "
            "with the dgrad GEMM by ring_exchange",
            Method.BULK: _BULK_NEEDS_INDEPENDENT + "the dgrad GEMM needs the gathered dy; use ring_exchange",
        },
        gathers_fp8="dy of",
    ),
}

# The fused ops' keyword (and ``mode``) for each collective.
_MODE = {AllGather: Collective.ALL_GATHER, ReduceScatter: Collective.REDUCE_SCATTER, AllReduce: Collective.ALL_REDUCE}

# Column-parallel bulk dgrad: the wgrad entry decides whether RS(dx) hides behind the wgrad GEMM.
_WGRAD_UNSUPPORTED = {
    m: "only bulk overlaps the dx reduce-scatter with the wgrad GEMM" for m in (Method.PIPELINE, Method.RING_EXCHANGE)
}


# ---- the shape of a window (the same rules for fprop, dgrad and all-reduce overlap) ----


def _linear_then_bias(window: Sequence[FusibleOperation], start: int) -> tuple[Optional[Bias], int]:
    """``(Bias or None, index after it)`` for the ops following a BasicLinear at ``start``."""
    if len(window) > start and isinstance(window[start], Bias):
        return window[start], start + 1  # type: ignore[return-value]
    return None, start


def _gemm_then(
    window: Sequence[FusibleOperation], collective: type, collective_name: str
) -> Union[None, Reject, tuple[BasicLinear, Optional[Bias], TPCommOperation, int]]:
    """``[BasicLinear(, Bias), collective]`` at the start of ``window`` as
    ``(linear, bias, comm_op, length)``; None when the window is not that shape (other
    fusions report on it); a Reject when the Bias cannot go into the GEMM's epilogue."""
    linear = window[0]
    bias, k = _linear_then_bias(window, 1)
    if len(window) <= k or not isinstance(window[k], collective):
        return None
    why = linear_bias_mismatch(linear, bias) if bias is not None else None  # type: ignore[arg-type]
    if why is not None:
        return Reject(f"{why}: the Bias sits between GEMM and {collective_name}", k + 1)
    return linear, bias, window[k], k + 1  # type: ignore[return-value]


def _collective_without_gemm(
    window: Sequence[FusibleOperation], collective: type, no_gemm: str
) -> Optional[Reject]:
    """Reject ``[X, collective]`` where X is neither BasicLinear nor Bias, saying ``no_gemm``
    (what is missing); a Bias first is left alone: its window starts at the BasicLinear."""
    first = window[0]
    if len(window) > 1 and isinstance(window[1], collective) and not isinstance(first, Bias):
        return Reject(
            f"{collective.__name__} preceded by {type(first).__name__}, not BasicLinear(+Bias): {no_gemm}",
            2,
        )
    return None


def _window(
    window: Sequence[FusibleOperation], rule: _Rule, fusion_log: Optional[FusionLog]
) -> MatchResult | tuple[BasicLinear, Any, TPCommOperation, int]:
    """``(linear, bias or None, comm op, length)`` of the window at the start of ``window``,
    a Reject with the reason it is no window, or None (not this rule's shape)."""
    if rule.collective is AllGather:
        ag, linear = window[0], window[1] if len(window) > 1 else None
        if not isinstance(linear, BasicLinear):
            return Reject(f"AllGather followed by {describe_next(window, 1)}, not BasicLinear: {rule.no_gemm}",
                          min(2, len(window)))
        bias, length = _linear_then_bias(window, 2)
        mismatch = linear_bias_mismatch(linear, bias) if bias is not None else None  # type: ignore[arg-type]
        if mismatch is not None:
            # The Bias stays outside; the all-gather still overlaps with the GEMM.
            if fusion_log is not None:
                fusion_log.rejected(window[:3], f"{mismatch}; fusing AllGather+BasicLinear alone")
            bias, length = None, 2
        return linear, bias, ag, length  # type: ignore[return-value]
    if not isinstance(window[0], BasicLinear):
        return _collective_without_gemm(window, rule.collective, rule.no_gemm)
    name = "all-reduce" if rule.collective is AllReduce else "reduce-scatter"
    return _gemm_then(window, rule.collective, name)


def _match(window: Sequence[FusibleOperation], rule: _Rule, recipe: Any,
           fusion_log: Optional[FusionLog]) -> MatchResult:
    found = _window(window, rule, fusion_log)
    if not isinstance(found, tuple):
        return found
    linear, bias, comm_op, length = found
    quantized = recipe is not None
    plan = plan_overlap(comm_op, linear, rule.stage, rule.role, rule.unsupported, quantized=quantized)
    if isinstance(plan, str):
        return Reject(plan, length)
    if rule.fused_op is UserbuffersBackwardLinear and linear.delay_wgrad_compute:
        # Its wgrad GEMM overlaps the window's collective: it cannot wait for backward_dw().
        raise ValueError(f"BasicLinear {gemm_label(linear)}: delay_wgrad_compute=True is not supported with the userbuffers "
                         "backward overlap (TPOverlap); disable the overlap for this GEMM's backward or leave "
                         "delay_wgrad_compute False")
    if quantized and rule.gathers_fp8 is not None:
        problem = fp8_gather_problem(comm_op.process_group, f"{rule.gathers_fp8} {gemm_label(linear)}")
        if problem is not None:
            return Reject(problem, length)
    kwargs: dict[str, Any] = {"linear": linear, "bias": bias, "plan": plan, "fp8": quantized, "recipe": recipe,
                              _MODE[rule.collective]: comm_op}
    if rule.fused_op is UserbuffersBackwardLinear and rule.collective is AllGather:
        kwargs["wgrad_plan"], kwargs["wgrad_note"] = None, ""
        if plan.entry.method in (Method.BULK, Method.AUTO):
            wplan = plan_overlap(comm_op, linear, "wgrad", "column", _WGRAD_UNSUPPORTED, quantized=quantized)
            kwargs["wgrad_plan" if not isinstance(wplan, str) else "wgrad_note"] = wplan
    op = rule.fused_op(**kwargs)
    return Fuse(op, length, op.fusion_summary())


def _fuse(ops: list[FusibleOperation], direction: str, gemm_first: type, recipe: Any,
          fusion_log: Optional[FusionLog], *, all_gather: bool) -> list[FusibleOperation]:
    """Scan ``ops`` for the windows of ``direction``: ``[AllGather, BasicLinear(, Bias)]``
    when ``all_gather``, and ``[BasicLinear(, Bias), gemm_first]``."""
    ag_rule = _RULES[(direction, AllGather)] if all_gather else None
    rule = _RULES[(direction, gemm_first)]

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        if ag_rule is not None and isinstance(window[0], AllGather):
            return _match(window, ag_rule, recipe, fusion_log)
        return _match(window, rule, recipe, fusion_log)

    return fuse_by_window(ops, matcher, fusion_log)


def fuse_userbuffers_forward_linear(
    ops: list[FusibleOperation], *, recipe: Any = None, fusion_log: Optional[FusionLog] = None, **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[AllGather, BasicLinear(, Bias)]`` and ``[BasicLinear(, Bias), ReduceScatter]``
    windows with :class:`UserbuffersForwardLinear`, as the overlap config says."""
    return _fuse(ops, "forward", ReduceScatter, recipe, fusion_log, all_gather=True)


def fuse_userbuffers_forward_linear_all_reduce(
    ops: list[FusibleOperation], *, recipe: Any = None, fusion_log: Optional[FusionLog] = None, **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[BasicLinear(, Bias), AllReduce]`` windows with
    :class:`UserbuffersForwardLinearAllReduce`, as the overlap config says."""
    return _fuse(ops, "forward", AllReduce, recipe, fusion_log, all_gather=False)


def fuse_userbuffers_backward_linear(
    ops: list[FusibleOperation], *, recipe: Any = None, fusion_log: Optional[FusionLog] = None, **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[AllGather, BasicLinear(, Bias)]`` and ``[BasicLinear(, Bias), ReduceScatter]``
    windows with :class:`UserbuffersBackwardLinear`, as the overlap config says."""
    return _fuse(ops, "backward", ReduceScatter, recipe, fusion_log, all_gather=True)
