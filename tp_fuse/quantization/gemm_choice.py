"""``autocast(gemms="auto")``: FP8 only for the Linears where it is faster, per GEMM shape.

FP8 GEMMs are up to ~2x faster than bf16 ones on FP8 tensor cores, but every FP8 GEMM
also pays for its casts (a read and a write of each operand, amax bookkeeping) and their
launches. At small shapes that overhead exceeds the GEMM savings and FP8 is slower than
bf16 (torchao's benchmark table; at hidden 128 FP8 can only lose). ``gemms="all"`` --
the default, Transformer Engine's semantics -- runs every GEMM under the recipe in FP8.
``gemms="auto"`` decides per ``BasicLinear`` and GEMM shape ``(M rows, N out, K in)``
whether its three GEMMs (forward, dgrad, wgrad) run FP8 or in the input's precision:

* **Prior** (:func:`prior_rule`): torchao's float8 tensorwise auto-filter, used when
  nothing is measured: on CPU (no FP8 hardware to measure; the CPU then runs the same
  split a GPU run starts from), for recipes without a measured candidate (block-scaled,
  NVFP4) and once the measuring budget is spent.
* **Measured** (CUDA, per-tensor recipes): at the first call with a new
  ``(M, N, K, dtype, device, recipe kind)``, one linear step is timed both ways with CUDA
  events -- three bf16 (input dtype) GEMMs against the casts of x, W and dy plus three
  FP8 GEMMs through ``tp_fuse.kernels`` (casts included) -- by
  :class:`~tp_fuse.overlap.auto.OverlapAutoTuner`'s machinery: warm-up, interleaved
  rounds, the minimum of each agreed with MAX over the autocast's amax-reduction group
  (every rank takes the same decision: a rank that skipped a quantizer would leave the
  amax all-reduce mismatched), the prior kept unless the other precision beats it by more
  than the measured noise, per-run time budgets.

Decisions are cached per shape in the :class:`GemmChoice` (the process-wide one for
``gemms="auto"``); the per-call cost is one tuple key and one dict look-up: no environment
reads, string formatting or measurements after the first call with a shape. A Linear
that runs in high precision does not create or register quantizers (no amax reduction
slot) and its backward runs in high precision too (``ctx.fp8`` is False).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import kernels
from ..overlap.auto import AutoDecision, Clock, OverlapAutoTuner
from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = [
    "ALL",
    "AUTO",
    "CudaEventClock",
    "GemmChoice",
    "GemmDecision",
    "decision_of",
    "default_choice",
    "prior_rule",
    "resolve_gemms",
    "traced_gemms_auto",
]

ALL = "all"
AUTO = "auto"
FP8, HP = "fp8", "hp"

# torchao's float8 "tensorwise" auto-filter (torchao/float8/float8_linear_utils.py,
# _auto_filter_for_tensorwise, used by _auto_filter_for_recipe): skip FP8 when a dim is not a
# multiple of 16, and "if K <= 4096 and N <= 1024: return False" with "K, N = mod.weight.shape".
# nn.Linear's weight is [out_features, in_features]: torchao's K is the OUT features and its N
# the IN features (its README's (M, K, N) table names them the other way round). We apply the
# rule as torchao's code executes it. The thresholds come from H100 benchmarks (its comment).
PRIOR_MAX_OUT = 4096
PRIOR_MAX_IN = 1024
DIM_MULTIPLE = 16

# Recipes whose FP8 step the measurement reproduces (per-tensor scales; current scaling adds
# the amax pass before each cast). Block-scaled recipes and NVFP4 use the prior.
_MEASURED_RECIPES = (DelayedScaling, Float8CurrentScaling)


def prior_rule(out_features: int, in_features: int) -> tuple[bool, str]:
    """torchao's rule (see the comment above): ``(runs FP8, why)`` for a Linear
    ``[out_features, in_features]``; the GEMM's row count does not enter it."""
    if out_features % DIM_MULTIPLE or in_features % DIM_MULTIPLE:
        return False, (f"prior: N={out_features} or K={in_features} is not a multiple of {DIM_MULTIPLE} "
                       "(torchao's float8 filter)")
    if out_features <= PRIOR_MAX_OUT and in_features <= PRIOR_MAX_IN:
        return False, (f"prior: torchao's tensorwise filter keeps N={out_features} <= {PRIOR_MAX_OUT} and "
                       f"K={in_features} <= {PRIOR_MAX_IN} in high precision")
    return True, (f"prior: torchao's tensorwise filter runs FP8 (N={out_features} > {PRIOR_MAX_OUT} or "
                  f"K={in_features} > {PRIOR_MAX_IN})")


@dataclasses.dataclass(frozen=True)
class GemmDecision:
    """Whether the GEMMs of a Linear with ``out_features`` x ``in_features`` at ``rows``
    rows run FP8, and why. ``source``: ``"prior"`` or ``"measured"``; ``hp_s`` /
    ``fp8_s``: the measured seconds of one linear step (forward + backward GEMMs, FP8
    casts included), max over the group's ranks; None when not measured."""

    fp8: bool
    rows: int
    out_features: int
    in_features: int
    recipe: str
    source: str
    reason: str
    hp_s: Optional[float] = None
    fp8_s: Optional[float] = None

    @property
    def ratio(self) -> Optional[float]:
        """FP8 time over high-precision time (< 1: FP8 is faster); None if not measured."""
        if self.hp_s is None or self.fp8_s is None or self.hp_s <= 0:
            return None
        return self.fp8_s / self.hp_s

    def describe(self) -> str:
        """``"M=4096 N=1024 K=1024 DelayedScaling: high precision (prior: ...)"``."""
        what = "FP8" if self.fp8 else "high precision"
        return f"M={self.rows} N={self.out_features} K={self.in_features} {self.recipe}: {what} ({self.reason})"


class CudaEventClock:
    """A :class:`~tp_fuse.overlap.auto.Clock` on CUDA events: seconds between an event
    recorded before ``fn`` and one after, on the current stream (idle gaps while the host
    launches count: a host-bound FP8 step is slower for real)."""

    def measure(self, label: str, fn: Callable[[], Any]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class _PrecisionTuner(OverlapAutoTuner):
    """The overlap tuner deciding between ``fp8`` and ``hp`` (no choice file)."""

    label_pattern = re.compile(r"fp8|hp")
    log_prefix = "fp8 gemms auto"

    def decision(self, signature: str) -> AutoDecision:
        return self._decisions[("linear", signature)]


def _agreement_device(group: Optional[dist.ProcessGroup], device: torch.device) -> torch.device:
    """Where the agreement all-reduces run: NCCL takes CUDA tensors, gloo CPU ones."""
    if not dist.is_initialized() or dist.get_backend(group) == "nccl":
        return device
    return torch.device("cpu")


class GemmChoice:
    """Decides and caches, per GEMM shape, whether a Linear's GEMMs run FP8 (module doc).

    Args:
        clock: what times the candidates (a ``Clock``: ``measure(label, fn) -> seconds``).
            None: :class:`CudaEventClock` on CUDA, and no measurement elsewhere (the prior
            decides). Given, it is used on every device (tests inject one on CPU).
        warmup, repeats, stage_budget_s, run_budget_s: as for ``OverlapAutoTuner``.
        log: called with one line per measured decision (e.g. ``print`` on rank 0).
    """

    def __init__(self, clock: Optional[Clock] = None, *, warmup: int = 2, repeats: int = 5,
                 stage_budget_s: float = 0.5, run_budget_s: float = 10.0,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self._tuner = _PrecisionTuner(clock, warmup=warmup, repeats=repeats, stage_budget_s=stage_budget_s,
                                      run_budget_s=run_budget_s, log=log)
        self._injected_clock = clock is not None
        # (rows, out, in, dtype, device, recipe type) -> decision: the per-call look-up.
        self._memo: dict[tuple[Any, ...], GemmDecision] = {}

    @property
    def decisions(self) -> list[GemmDecision]:
        """Every decision so far, in the order they were made."""
        return list(self._memo.values())

    @property
    def measured_count(self) -> int:
        return sum(d.source == "measured" for d in self._memo.values())

    def runs_fp8(self, op: Any, x: Optional[torch.Tensor], rows: Optional[int], state: Any) -> bool:
        """Whether ``op`` (a ``BasicLinear``) runs its GEMMs in FP8 for input ``x`` under the
        autocast ``state``; ``rows``: the GEMM's M when it is not ``x``'s (an all-gather
        before the GEMM). Records the decision on the op for ``explain``."""
        if x is None:
            raise ValueError(
                f"{type(op).__name__}.fp8_quantizers: under autocast(gemms='auto') whether the GEMMs run "
                "FP8 depends on their shape: pass the GEMM input (fp8_quantizers(x))"
            )
        if rows is None:
            rows = x.numel() // op.in_features
        recipe = state.recipe
        key = (rows, op.out_features, op.in_features, x.dtype, x.device, type(recipe))
        decision = self._memo.get(key)
        if decision is None:
            decision = self._decide(key, recipe, state.amax_reduction_group)
            self._memo[key] = decision
        op.__dict__["_fp8_gemm_decision"] = decision
        return decision.fp8

    def _decide(self, key: tuple[Any, ...], recipe: Recipe, group: Optional[dist.ProcessGroup]) -> GemmDecision:
        rows, n, k, dtype, device, recipe_type = key
        kind = recipe_type.__name__
        prior, why = prior_rule(n, k)
        unmeasured = None
        if not (self._injected_clock or device.type == "cuda"):
            unmeasured = f"not measured on {device.type}: no FP8 hardware"
        elif not isinstance(recipe, _MEASURED_RECIPES):
            unmeasured = f"not measured: no timed FP8 step for {kind}"
        elif rows == 0 or any(d % DIM_MULTIPLE for d in (rows, n, k)):
            # Every dim is some GEMM's N or K in one of the three: _scaled_mm needs multiples of 16.
            unmeasured = f"not measured: M, N and K must be positive multiples of {DIM_MULTIPLE}"
        if unmeasured is not None:
            return GemmDecision(prior, rows, n, k, kind, "prior", f"{why}; {unmeasured}")
        signature = f"M={rows} N={n} K={k} {str(dtype).removeprefix('torch.')} {kind} {device}"
        candidates = _step_candidates(rows, n, k, dtype, device, isinstance(recipe, Float8CurrentScaling))
        choice = self._tuner.decide("linear", signature, candidates, group, _agreement_device(group, device),
                                    default=FP8 if prior else HP)
        d = self._tuner.decision(signature)
        hp_s, fp8_s = d.times.get(HP), d.times.get(FP8)
        if d.source != "measured":
            return GemmDecision(prior, rows, n, k, kind, "prior", f"{why}; {d.note}", hp_s, fp8_s)
        ratio = f"FP8 step {fp8_s / hp_s:.2f}x the high-precision step" if hp_s else "no high-precision time"
        note = f"; {d.note}" if d.note else ""
        reason = f"measured: {ratio} ({fp8_s * 1e6:.0f} us vs {hp_s * 1e6:.0f} us){note}"
        return GemmDecision(choice == FP8, rows, n, k, kind, "measured", reason, hp_s, fp8_s)


def _step_candidates(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                     current_scaling: bool) -> dict[str, Any]:
    """One linear step at ``x [m, k]``, ``W [n, k]``, ``dy [m, n]`` both ways: ``hp`` the
    three GEMMs in ``dtype``; ``fp8`` the casts of x, W (forward format) and dy (with the
    transposes the backward GEMMs read) and the three FP8 GEMMs, through the same
    ``tp_fuse.kernels`` the ops call. Operands come from a private generator: measuring
    draws nothing from the training's RNG streams."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in ((m, k), (n, k), (m, n)))
    one = torch.ones((), dtype=torch.float32, device=device)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    def cast(t: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if current_scaling:  # the scale comes from this tensor's amax: one more pass
            torch.amax(t.abs())
        data, data_t, _ = kernels.quantize(t, one, fmt, transpose=True)
        assert data_t is not None
        return data, data_t

    def hp() -> None:
        torch.mm(x, w.t())
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    def fp8() -> None:
        x8, x8t = cast(x, e4m3)
        w8, w8t = cast(w, e4m3)
        kernels.fp8_gemm(x8, w8, one, one, dtype)  # y [m, n] = x W^T
        g8, g8t = cast(dy, e5m2)
        kernels.fp8_gemm(g8, w8t, one, one, dtype)  # dx [m, k] = dy W
        kernels.fp8_gemm(g8t, x8t, one, one, dtype)  # dW [n, k] = dy^T x

    return {HP: hp, FP8: fp8}


_DEFAULT: list[Optional[GemmChoice]] = [None]


def default_choice() -> GemmChoice:
    """The process-wide :class:`GemmChoice` of ``gemms="auto"`` (created at first use):
    every autocast of the process shares its cache, so each shape is measured once."""
    if _DEFAULT[0] is None:
        _DEFAULT[0] = GemmChoice()
    return _DEFAULT[0]


def resolve_gemms(fn: str, gemms: Any, outer: Optional[GemmChoice]) -> Optional[GemmChoice]:
    """The ``GemmChoice`` for ``autocast(gemms=...)`` (None: every GEMM FP8). ``None``
    inherits the enclosing autocast's (``outer``)."""
    if gemms is None:
        return outer
    if isinstance(gemms, GemmChoice):
        return gemms
    if gemms == ALL:
        return None
    if gemms == AUTO:
        return default_choice()
    raise ValueError(f"{fn}: gemms: expected 'all', 'auto' or a GemmChoice, got {gemms!r}")


class _TracedView:
    """What ``torch.compile``'d code sees: whether the autocast in force decides per GEMM
    (a plain attribute dynamo reads and guards on, like ``compile_state``'s recipe key)."""

    auto = False


_VIEW = _TracedView()


def traced_gemms_auto() -> bool:
    """Whether the autocast in force has ``gemms='auto'`` (traceable)."""
    return _VIEW.auto


def set_traced_gemms_auto(auto: bool) -> bool:
    """Set the mirror; returns the previous value for the caller to restore."""
    prev = _VIEW.auto
    _VIEW.auto = auto
    return prev


def decision_of(op: Any) -> Optional[GemmDecision]:
    """The last ``gemms="auto"`` decision a ``BasicLinear`` ran under (None: it has not run
    under ``auto``), for ``explain`` and the launcher's start-up lines."""
    return op.__dict__.get("_fp8_gemm_decision")
