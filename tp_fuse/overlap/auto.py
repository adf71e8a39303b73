"""``method: auto``: measured choice of the overlap method per GEMM stage and shape.

Which overlap method is fastest depends on the shape, the precision, the transport and the
machine; a fixed table cannot know. An :class:`OverlapAutoTuner` (held by the
:class:`~tp_fuse.overlap.config.TPOverlap` of a model) decides at the first call of a GEMM
stage with a new *signature* (GEMM key such as ``"fc1_fprop"``, local input shape, dtype,
FP8 recipe kind, TP size):

1. the fused op prepares its operands once (FP8 casts and amax recording happen there,
   exactly once, so measuring records no extra amax values), then hands the tuner one
   callable per candidate: the overlap methods that apply to the window
   (``ring_exchange``, ``pipeline/<num_splits>``, ``bulk``), on CUDA with symmetric
   memory PyTorch's fused ops (``symm_mem``, forward AG+GEMM and GEMM+RS windows; see
   :mod:`tp_fuse.overlap.symm_mem`) and ``unfused`` (the same collective, then the whole
   GEMM: no overlap);
2. every rank runs each candidate ``warmup`` times untimed, then up to ``repeats`` rounds
   timed, candidates interleaved, in the same order on every rank (each candidate
   communicates). Measuring is bounded: a round starts only while the stage's timed
   seconds are under ``stage_budget_s`` (agreed over the group after each round), and once
   the tuner's timed seconds reach ``run_budget_s`` new stages are not measured at all:
   they take the static default (Megatron's method for the stage, else ``unfused``);
3. each candidate's minimum and median time are all-reduced with MAX over the TP group (a
   method is as slow as its slowest rank). The minimum decides (machine noise only ever
   adds time); the fastest candidate wins (ties: the earlier one in candidate order)
   unless it beats the static default by less than the noise -- the larger relative
   spread ``(median - min) / min`` of the two, at least 2 % -- in which case the default
   is kept: a choice the measurement cannot support is not made. Every rank sees the
   same numbers, so every rank makes the same choice;
4. the decision is cached per (GEMM key, signature) and, with ``choice_file``, saved as
   JSON; a tuner built with an existing file reuses its choices without measuring
   (resume, and every rank of every run that shares the file).

Time comes from a clock object (:class:`WallClock` by default), so tests can pass a fake
one that prefers each candidate in turn. All candidates compute the same function (equal
within the tolerance of their GEMM precision); the fused op runs the chosen candidate once
more for the result it returns.

The choice file is untrusted input: it is parsed with :func:`json.loads` (no code runs)
and every field is checked; a malformed file is a ValueError naming the file and the
field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from tp_fuse import comm

from ..safe_files import read_regular_file, write_atomic
from .method import LABEL_PATTERN, Method, candidate_labels

__all__ = [
    "AutoDecision",
    "Clock",
    "OverlapAutoTuner",
    "WallClock",
    "candidate_labels",
]

CHOICE_FILE_FORMAT = "tp_fuse.overlap_choices"
CHOICE_FILE_VERSION = 1
_MAX_CHOICE_FILE_BYTES = 16 * 1024 * 1024


def _is_label(label: object) -> bool:
    """Whether ``label`` spells an :class:`OverlapMethod` (the choice file's boundary)."""
    return isinstance(label, str) and LABEL_PATTERN.fullmatch(label) is not None


class Clock(Protocol):
    """What the tuner times with: run ``fn`` (candidate ``label``) once, return seconds."""

    def measure(self, label: str, fn: Callable[[], Any]) -> float: ...


class WallClock:
    """Wall-clock time of one call; on CUDA the device is synchronized before and after, so
    the time covers the kernels and transfers the call queued."""

    def measure(self, label: str, fn: Callable[[], Any]) -> float:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class AutoDecision:
    """One choice: for GEMM stage ``gemm`` at ``signature``, candidate ``choice``.

    ``times`` are seconds per candidate (minimum over the timed rounds, max over TP
    ranks), empty when the choice came from a file without times or was not measured.
    ``spread``: per candidate ``(median - min) / min``, the noise of its samples.
    ``source``: ``"measured"``, ``"budget"`` (not measured: the run's tuning budget was
    spent) or the path of the choice file it was read from. ``cost_s``: wall time the
    measurement took. ``note``: why the choice is not simply the fastest, if it is not.
    ``default``: the static choice the tuner falls back to for this stage.
    """

    gemm: str
    signature: str
    choice: str
    candidates: tuple[str, ...]
    times: Mapping[str, float]
    source: str = "measured"
    cost_s: float = 0.0
    spread: Mapping[str, float] = dataclasses.field(default_factory=dict)
    note: str = ""
    default: str = ""

    def describe(self) -> str:
        """``"fc2_fprop [x 256x2x64 float32, fp32, tp=2]: pipeline/2 1.20 ms +-3%, ... -> ring_exchange (measured)"``."""
        parts = []
        for c in self.candidates:
            if c not in self.times:
                parts.append(f"{c} (not timed)")
                continue
            noise = f" +-{self.spread[c] * 100:.0f}%" if c in self.spread else ""
            parts.append(f"{c} {self.times[c] * 1e3:.3f} ms{noise}")
        if self.source == "measured":
            src = f"measured, measuring took {self.cost_s * 1e3:.1f} ms"
        elif self.source == "budget":
            src = "not measured"
        else:
            src = f"from {self.source}"
        note = f"; {self.note}" if self.note else ""
        return f"{self.gemm} [{self.signature}]: {', '.join(parts)} -> {self.choice} ({src}{note})"

    def to_json(self) -> dict[str, Any]:
        return {
            "gemm": self.gemm,
            "signature": self.signature,
            "choice": self.choice,
            "candidates": list(self.candidates),
            "times_s": {k: float(v) for k, v in self.times.items()},
        }


class OverlapAutoTuner:
    """Measures, agrees on and caches overlap-method choices (see the module docstring).

    Args:
        clock: a :class:`Clock` (default :class:`WallClock`).
        warmup: untimed runs per candidate before timing (first calls allocate workspaces).
        repeats: at most this many timed rounds (one run of every candidate each).
        stage_budget_s: a new round starts only while one stage's timed seconds (as the
            clock reports them, summed over candidates and rounds) are below this; at
            least one round always runs.
        run_budget_s: once this tuner's timed seconds reach this, new stages are not
            measured: they take the static default.
        splits: ``num_splits`` values tried for ``pipeline`` (besides a config's own).
        choice_file: JSON file of earlier choices: read at construction if it exists (its
            choices are used without measuring) and, with ``write_choices``, rewritten
            after every new decision.
        write_choices: whether this process writes ``choice_file`` (give it to one rank).
        log: called with one line per new decision (e.g. ``print`` on rank 0).
    """

    #: Candidate labels this tuner decides between (a subclass deciding something else,
    #: e.g. ``tp_fuse.quantization.gemm_choice``, names its own), and its log lines' prefix.
    label_pattern: re.Pattern[str] = LABEL_PATTERN
    log_prefix = "overlap auto"

    def __init__(
        self,
        clock: Optional[Clock] = None,
        *,
        warmup: int = 1,
        repeats: int = 5,
        stage_budget_s: float = 2.0,
        run_budget_s: float = 20.0,
        splits: Sequence[int] = (2, 4),
        choice_file: Optional[str | os.PathLike] = None,
        write_choices: bool = False,
        log: Optional[Callable[[str], None]] = None,
    ) -> None:
        for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"OverlapAutoTuner: {name} must be an int >= {low}, got {value!r}")
        for name, value in (("stage_budget_s", stage_budget_s), ("run_budget_s", run_budget_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"OverlapAutoTuner: {name} must be a finite number of seconds > 0, got {value!r}")
        splits = tuple(splits)
        if not splits or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in splits):
            raise ValueError(f"OverlapAutoTuner: splits must be positive ints, got {splits!r}")
        if clock is not None and not callable(getattr(clock, "measure", None)):
            raise ValueError(f"OverlapAutoTuner: clock needs a measure(label, fn) method, got {type(clock).__name__}")
        if write_choices and choice_file is None:
            raise ValueError("OverlapAutoTuner: write_choices=True needs a choice_file")
        self.clock: Clock = clock if clock is not None else WallClock()
        self.warmup, self.repeats, self.splits = warmup, repeats, splits
        self.stage_budget_s, self.run_budget_s = float(stage_budget_s), float(run_budget_s)
        self.choice_file = None if choice_file is None else os.fspath(choice_file)
        self.write_choices = write_choices
        self.log = log
        self._decisions: dict[tuple[str, str], AutoDecision] = {}
        # File choices confirmed to be the same on every rank of the group.
        self._agreed: set[tuple[str, str]] = set()
        #: Wall seconds spent measuring (all decisions of this tuner, warm-up included).
        self.measure_seconds = 0.0
        #: Timed seconds as the clock reported them (what the budgets count).
        self.timed_seconds = 0.0
        # lexists: a planted link (even a dangling one) is reported by the reader, not skipped.
        if self.choice_file is not None and os.path.lexists(self.choice_file):
            for d in load_choice_file(self.choice_file):
                self._decisions[(d.gemm, d.signature)] = d

    # ---- queries -----------------------------------------------------------

    @property
    def decisions(self) -> list[AutoDecision]:
        """Every decision so far (measured or from the file), in the order they were made."""
        return list(self._decisions.values())

    def decisions_for(self, gemm: str) -> list[AutoDecision]:
        return [d for d in self._decisions.values() if d.gemm == gemm]

    def measured_count(self) -> int:
        return sum(d.source == "measured" for d in self._decisions.values())

    # ---- deciding ----------------------------------------------------------

    def decide(
        self,
        gemm: str,
        signature: str,
        candidates: Mapping[str, Callable[[], Any]],
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        default: Optional[str] = None,
    ) -> str:
        """The candidate label to run for ``(gemm, signature)``; measured on a cache miss.

        ``default``: the static choice (Megatron's method for the stage) kept when the
        measurement cannot tell it from the fastest, and taken unmeasured once the run's
        budget is spent; ``unfused`` when None or not a candidate. Every rank of ``group``
        must call this with the same ``candidates`` in the same order at the same point
        (each candidate communicates over ``group``).
        """
        labels = tuple(candidates)
        assert labels and all(self.label_pattern.fullmatch(lb) for lb in labels), labels
        if default not in labels:
            default = Method.UNFUSED if Method.UNFUSED in labels else labels[0]
        key = (gemm, signature)
        known = self._decisions.get(key)
        if known is not None and known.choice not in candidates:
            where = f"choice file {known.source}" if known.source != "measured" else "cache"
            raise ValueError(
                f"{where}: choice {known.choice!r} for {gemm} [{signature}] is not a candidate of "
                f"this window (candidates: {list(labels)})"
            )
        if known is not None and (known.source == "measured" or key in self._agreed):
            return known.choice
        # First lookup of this key here: a choice read from a file is used only if every rank
        # read the same one; otherwise all measure together (a rank whose run directory lacks
        # the file must not measure alone: its collectives would meet nobody).
        idx = labels.index(known.choice) if known is not None else 0
        spent = 1.0 if self.timed_seconds >= self.run_budget_s else 0.0
        flags = torch.tensor([0.0 if known is not None else 1.0, idx, -idx, spent], dtype=torch.float64)
        need, hi, neg_lo, spent = self._max_over(flags, group, device).cpu().tolist()
        if need == 0 and hi == -neg_lo:
            assert known is not None
            self._agreed.add(key)
            return known.choice
        if spent:  # some rank's budget is spent: every rank takes the default, unmeasured
            return self._record(AutoDecision(
                gemm, signature, default, labels, {}, "budget",
                note=f"tuning budget of {self.run_budget_s:g} s spent, static default", default=default))
        start = time.perf_counter()
        for _ in range(self.warmup):
            for label in labels:
                candidates[label]()
        samples: dict[str, list[float]] = {label: [] for label in labels}
        for _ in range(self.repeats):
            for label in labels:  # interleaved: machine noise hits every candidate alike
                seconds = float(self.clock.measure(label, candidates[label]))
                if not math.isfinite(seconds) or seconds < 0:
                    raise ValueError(f"OverlapAutoTuner: clock returned {seconds!r} for {label}")
                samples[label].append(seconds)
            # Another round only if every rank is still inside the stage budget (agreed:
            # each round communicates, so all ranks must run the same number of rounds).
            elapsed = torch.tensor([sum(map(sum, samples.values()))], dtype=torch.float64)
            if self._max_over(elapsed, group, device).item() >= self.stage_budget_s:
                break
        self.timed_seconds += sum(map(sum, samples.values()))
        local = torch.tensor([min(samples[lb]) for lb in labels] + [statistics.median(samples[lb]) for lb in labels],
                             dtype=torch.float64)
        # float64 on the group's device: gloo takes CPU tensors, NCCL CUDA ones.
        agreed = self._max_over(local, group, device).cpu().tolist()
        times, medians = agreed[: len(labels)], agreed[len(labels):]
        spread = {lb: (m - t) / t if t > 0 else 0.0 for lb, t, m in zip(labels, times, medians)}
        best = min(range(len(labels)), key=lambda i: (times[i], i))
        choice, note = labels[best], ""
        d = labels.index(default)
        if best != d:
            noise = max(spread[labels[best]], spread[default], 0.02)
            if times[d] - times[best] <= noise * times[best]:
                choice = default
                note = (f"{labels[best]} is faster by {(times[d] / times[best] - 1) * 100:.1f}%, within the "
                        f"noise of {noise * 100:.0f}%: static default kept")
        cost = time.perf_counter() - start
        self.measure_seconds += cost
        return self._record(AutoDecision(gemm, signature, choice, labels, dict(zip(labels, times)), "measured",
                                         cost, spread, note, default))

    @staticmethod
    def _max_over(t: torch.Tensor, group: Optional[dist.ProcessGroup], device: torch.device) -> torch.Tensor:
        """``t`` all-reduced with MAX over ``group`` (on the group's device). ``group=None``
        outside ``torch.distributed`` is one process: nothing to agree with."""
        if group is None and not dist.is_initialized():
            return t
        return comm.all_reduce(t.to(device), group, op=dist.ReduceOp.MAX)

    def _record(self, decision: AutoDecision) -> str:
        self._decisions[(decision.gemm, decision.signature)] = decision
        if self.log is not None:
            self.log(f"{self.log_prefix}: {decision.describe()} [tuning so far {self.timed_seconds:.2f} s timed, "
                     f"budget {self.run_budget_s:g} s]")
        if self.write_choices:
            assert self.choice_file is not None
            save_choice_file(self.choice_file, self.decisions)
        return decision.choice


# ---- the choice file ------------------------------------------------------------------


def save_choice_file(path: str, decisions: Iterable[AutoDecision]) -> None:
    """Write ``decisions`` to ``path`` atomically (temporary file, then rename). Choices
    made without measuring (the budget was spent) are left out: a later run measures them."""
    doc = {
        "format": CHOICE_FILE_FORMAT,
        "version": CHOICE_FILE_VERSION,
        "choices": [d.to_json() for d in decisions if d.source != "budget"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True))


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def load_choice_file(path: str) -> list[AutoDecision]:
    """Parse and validate a choice file (untrusted: JSON only, every field checked)."""

    def bad(field: str, msg: str) -> ValueError:
        return ValueError(f"overlap choice file {path}: {field}: {msg}")

    # A link, FIFO, device or directory at this name is refused and the read is bounded
    # (getsize is 0 for /dev/zero; open() of a FIFO waits for a writer forever).
    raw = read_regular_file(path, _MAX_CHOICE_FILE_BYTES, "overlap choice file")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad("<file>", f"not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise bad("<top level>", f"expected an object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - {"format", "version", "choices"})
    if unknown:
        raise bad("<top level>", f"unknown field(s) {unknown}")
    if doc.get("format") != CHOICE_FILE_FORMAT:
        raise bad("format", f"expected {CHOICE_FILE_FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != CHOICE_FILE_VERSION:
        raise bad("version", f"expected {CHOICE_FILE_VERSION}, got {doc.get('version')!r}")
    entries = doc.get("choices")
    if not isinstance(entries, list):
        raise bad("choices", f"expected a list, got {type(entries).__name__}")
    out: list[AutoDecision] = []
    seen: set[tuple[str, str]] = set()
    for i, e in enumerate(entries):
        where = f"choices[{i}]"
        if not isinstance(e, dict):
            raise bad(where, f"expected an object, got {type(e).__name__}")
        unknown = sorted(set(e) - {"gemm", "signature", "choice", "candidates", "times_s"})
        if unknown:
            raise bad(where, f"unknown field(s) {unknown}")
        for key in ("gemm", "signature", "choice"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise bad(f"{where}.{key}", f"expected a non-empty string, got {e.get(key)!r}")
        if not _is_label(e["choice"]):
            raise bad(f"{where}.choice", f"{e['choice']!r} is not a method label "
                      "(ring_exchange, bulk, unfused, symm_mem or pipeline/<num_splits>)")
        cands = e.get("candidates", [e["choice"]])
        if not isinstance(cands, list) or not all(_is_label(c) for c in cands):
            raise bad(f"{where}.candidates", f"expected a list of method labels, got {cands!r}")
        if e["choice"] not in cands:
            raise bad(f"{where}.choice", f"{e['choice']!r} is not among candidates {cands}")
        times = e.get("times_s", {})
        if not isinstance(times, dict) or not all(
            k in cands and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for k, v in times.items()
        ):
            raise bad(f"{where}.times_s", f"expected {{candidate: seconds >= 0}}, got {times!r}")
        key = (e["gemm"], e["signature"])
        if key in seen:
            raise bad(where, f"a second entry for {e['gemm']} [{e['signature']}]")
        seen.add(key)
        out.append(AutoDecision(e["gemm"], e["signature"], e["choice"], tuple(cands),
                                {k: float(v) for k, v in times.items()}, source=path))
    return out
