"""Feature base class: the calls a layer makes, with Transformer Engine's defaults.

Names and signatures follow ``transformer_engine.debug.features.api.TEDefaultFeatures``
(see ``docs/debug.md``). A feature overrides only the calls it needs; every other
call returns the default (nothing modified, FP8 allowed, nothing inspected).

Two kinds of calls:

* routing calls -- ``modify_tensor_enabled``, ``fp8_gemm_enabled``,
  ``inspect_tensor_enabled`` -- return ``(bool, next_iteration_or_None)`` (a plain
  bool is accepted too);
* GEMM calls -- ``modify_tensor`` (instead of the default quantization) and
  ``inspect_tensor`` (observe a tensor, its FP8 version and quantizer).

A layer that has any feature configured runs unfused (its fusions are rejected with
the reason ``debug features enabled on <layer>``); a layer with none runs the
normal fused path and never calls into the debug package.

Features are instantiated per :class:`~tp_fuse.debug.DebugSession` and get that
session's :class:`~tp_fuse.debug.stats.StatsBuffer`. The same classes are registered as
nvdlfw-inspect features (:mod:`tp_fuse.debug.inspect_api`); there the framework creates
them with no arguments and the ``transformer_engine`` namespace API hands them its buffer.
nvdlfw-inspect routes a call to a feature only when the feature's method is marked with
``nvdlfw_inspect.registry.api_method``: every override below is marked, the defaults of
this base class are not (they are what an unconfigured layer gets anyway).

Every file of this directory is executed on its own by nvdlfw-inspect when a user passes
it in ``feature_dirs`` (``import_and_exec_module``): imports here are absolute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Optional, Union

import torch
import torch.distributed as dist
from nvdlfw_inspect.registry import api_method

from tp_fuse.debug.config import FeatureSpec
from tp_fuse.debug.stats import StatsBuffer

__all__ = ["DebugFeature", "RoutingResult", "StatsLoggingFeature", "enabled_at"]

RoutingResult = Union[bool, tuple[bool, Optional[int]]]

_WINDOW_OPTIONS = {"freq", "start_step", "end_step"}


def enabled_at(config: dict[str, Any], iteration: int) -> tuple[bool, Optional[int]]:
    """TE's iteration window: on when ``start_step <= it <= end_step`` and ``it % freq == 0``.

    Returns ``(enabled, next_enabled_iteration or None)``.
    """
    freq = int(config.get("freq", 1))
    start = int(config.get("start_step", 0) or 0)
    end = config.get("end_step")
    if end is not None and iteration > int(end):
        return False, None
    first = max(iteration, start)
    nxt = first + (-first) % freq
    if end is not None and nxt > int(end):
        nxt_opt: Optional[int] = None
    else:
        nxt_opt = nxt
    if iteration >= start and iteration % freq == 0:
        return True, nxt_opt
    return False, nxt_opt


class DebugFeature:
    """Base class of debug features (TE's ``TEDefaultFeatures`` behaviour).

    Subclasses set :attr:`options` (option names they accept besides ``enabled``,
    ``tensors``/``tensors_struct``, ``gemms``/``gemms_struct``), may restrict
    :attr:`allowed_tensors`, and override :meth:`check` for value validation.

    Args:
        stats: where logging features record statistics.
    """

    options: ClassVar[frozenset[str]] = frozenset()
    allowed_tensors: ClassVar[Optional[frozenset[str]]] = None
    #: Whether the feature is scoped by tensors (logging, FakeQuant) or only by GEMMs.
    uses_tensors: ClassVar[bool] = True

    def __init__(self, stats: Optional[StatsBuffer] = None) -> None:
        # None: created by nvdlfw-inspect's registry; its namespace API sets the buffer.
        self.stats = stats

    # ---- configuration -----------------------------------------------------

    def validate(self, spec: FeatureSpec) -> None:
        """Check every option dict of ``spec``; ValueError names the key."""
        scopes = [(spec.where, spec.scope)]
        if spec.per_gemm is not None:
            scopes += [(f"{spec.where}.gemms_struct.{g}", s) for g, s in spec.per_gemm.items()]
        for where, scope in scopes:
            dicts: list[tuple[str, dict[str, Any]]] = [(where, scope.opts)]
            if scope.per_tensor is not None:
                if not self.uses_tensors:
                    raise ValueError(f"{where}: {spec.name} does not take tensors (it acts on whole GEMMs)")
                if self.allowed_tensors is not None:
                    bad = sorted(set(scope.per_tensor) - self.allowed_tensors)
                    if bad:
                        raise ValueError(
                            f"{where}.tensors: {spec.name} cannot act on {bad}; "
                            f"allowed: {sorted(self.allowed_tensors)}"
                        )
                dicts += [(f"{where}.tensors_struct.{t}", o) for t, o in scope.per_tensor.items()]
            for w, opts in dicts:
                unknown = sorted(set(opts) - self.options)
                if unknown:
                    raise ValueError(f"{w}: unknown option(s) {unknown} for {spec.name}; known: {sorted(self.options)}")
                self.check(opts, w)
        # With a GEMM list, each GEMM's scope decides the tensors; else the feature's own.
        effective = scopes[1:] if spec.per_gemm is not None else scopes
        for where, scope in effective:
            if self.uses_tensors and self.allowed_tensors is not None and scope.per_tensor is None:
                raise ValueError(
                    f"{where}: {spec.name} needs a tensors list (from {sorted(self.allowed_tensors)})"
                )

    def check(self, opts: dict[str, Any], where: str) -> None:
        """Validate option values (override). Default: the freq/start/end window."""
        _check_window(opts, where)

    # ---- routing calls -----------------------------------------------------

    def modify_tensor_enabled(
        self, config: dict[str, Any], layer_name: str, gemm: str, tensor_name: str, iteration: int
    ) -> RoutingResult:
        return False, None

    def fp8_gemm_enabled(self, config: dict[str, Any], layer_name: str, gemm: str, iteration: int) -> RoutingResult:
        return True, None

    def inspect_tensor_enabled(
        self, config: dict[str, Any], layer_name: str, tensor_name: str, iteration: int
    ) -> RoutingResult:
        return False, None

    # ---- GEMM calls --------------------------------------------------------

    def modify_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        default_quantizer: Any,
        iteration: int = 0,
        out: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} enables modify_tensor but does not implement it")

    def inspect_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        tensor_name: str,
        tensor: torch.Tensor,
        rowwise_quantized_tensor: Optional[torch.Tensor] = None,
        columnwise_quantized_tensor: Optional[torch.Tensor] = None,
        quantizer: Any = None,
        iteration: int = 0,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} enables inspect_tensor but does not implement it")


def _check_window(opts: dict[str, Any], where: str) -> None:
    for key in _WINDOW_OPTIONS & set(opts):
        v = opts[key]
        if key == "end_step" and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "freq" else 0):
            raise ValueError(f"{where}.{key}: expected an int >= {1 if key == 'freq' else 0}, got {v!r}")


def check_stats_option(opts: dict[str, Any], where: str, known: Iterable[str]) -> None:
    """``stats`` must be a non-empty list of known statistic names (when present)."""
    if "stats" not in opts:
        return
    stats = opts["stats"]
    known = list(known)
    if not isinstance(stats, list) or not stats or not all(isinstance(s, str) for s in stats):
        raise ValueError(f"{where}.stats: expected a non-empty list of names from {known}, got {stats!r}")
    bad = [s for s in stats if s not in known]
    if bad:
        raise ValueError(f"{where}.stats: unknown statistic(s) {bad}; known: {known}")


class StatsLoggingFeature(DebugFeature):
    """Base of the statistics-logging features: a required ``stats`` list (names from
    :attr:`known_stats`) recorded as ``debug/<layer>/<tensor>/<stat>`` in the
    freq/start_step/end_step window. Subclasses turn a tensor into components."""

    options = frozenset({"stats", "freq", "start_step", "end_step"})
    #: Statistic name -> (components it needs, formula); its keys are the valid names.
    known_stats: ClassVar[dict[str, Any]] = {}
    #: The feature's name in error messages and in a record's ``source``.
    feature_name: ClassVar[str] = ""

    def check(self, opts: dict[str, Any], where: str) -> None:
        _check_window(opts, where)
        check_stats_option(opts, where, self.known_stats)

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        if "stats" not in config:
            raise ValueError(f"{self.feature_name} on {layer_name}/{tensor_name}: option 'stats' is required")
        return enabled_at(config, iteration)

    def record(self, config: dict[str, Any], layer_name: str, tensor_name: str, iteration: int, comps: Any) -> None:
        """Add the components of ``config['stats']``; a weight once per iteration (every
        micro-batch sees the same one)."""
        if self.stats is None:
            raise RuntimeError(f"{self.feature_name}: no statistics buffer; attach it through a DebugSession "
                               "or nvdlfw_inspect.api.initialize(feature_dirs=[tp_fuse.debug.FEATURE_DIR])")
        self.stats.add(iteration, f"debug/{layer_name}/{tensor_name}", config["stats"], comps,
                       source=self.feature_name, once=tensor_name == "weight")
