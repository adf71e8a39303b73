"""Communication/GEMM overlap configuration, keyed by GEMM name (Megatron-LM style).

How the overlap fusions find their settings (explicit objects first):

* :class:`OverlapConfig` says, per GEMM stage (``"fc1_fprop"``, ``"fc1_dgrad"``, ...),
  which overlap method to use. It loads Megatron-LM ``--tp-comm-overlap-cfg`` YAML files
  as they are (:meth:`OverlapConfig.from_yaml`); missing entries take Megatron's defaults.
* :class:`TPOverlap` bundles a config with the :class:`tp_fuse.comm.UserBufferPool` that holds the
  communication workspaces. It is an ordinary object that the user creates and passes to
  the window's communication op, its one carrier: ``AllGather(tp_group, overlap=tp_overlap)``
  / ``ReduceScatter(..., overlap=...)`` / ``AllReduce(..., overlap=...)``; the GEMM is named
  by ``BasicLinear(..., userbuffers_options={"comm_name": "fc1"})`` (Transformer Engine's
  spelling).

  ``userbuffers_options={"overlap": tp_overlap}`` on the linear is still accepted: the
  matcher hands it to the comm op (the same object there is fine, a different one is a
  ValueError). A comm op without one uses the object Transformer Engine's
  ``initialize_ub(...)`` registered for the window's quantization mode, if that was called
  (the one process-wide state, as TE's call implies;
  :mod:`tp_fuse.overlap.userbuffers_setup`), else its own default ``TPOverlap()`` (Megatron
  defaults, a pool owned by that op object): ``TPCommOperation.window_overlap``.

The config is read when the fuser decides its fusions (first forward pass, and again when
the FP8 recipe changes); build a new ``Sequential`` after editing it.

GEMM stages and what each setting drives (column-parallel = ``[AllGather, BasicLinear]``,
row-parallel = ``[BasicLinear, ReduceScatter]`` or ``[BasicLinear, AllReduce]``):

============  ==================  ==========================================================
stage         column-parallel     row-parallel
============  ==================  ==========================================================
``*_fprop``   AG+GEMM:            GEMM+RS: ``pipeline`` (``num_splits`` chunks) or
              ``ring_exchange``   ``ring_exchange``; GEMM+AR: ``pipeline`` (chunked)
``*_dgrad``   dgrad GEMM + RS(dx) AG(dy) + dgrad GEMM: ``ring_exchange``
              ``bulk`` / ``pipeline`` / ``ring_exchange``
``*_wgrad``   ``bulk``: RS(dx)    not consulted (the wgrad GEMM reuses the all-gathered dy)
              behind wgrad GEMM
============  ==================  ==========================================================

``method: auto`` (per entry, or ``OverlapConfig(auto=True)`` for every entry not given
explicitly) measures the methods that apply to the window and no overlap at the first call
with a new shape and runs the fastest, the same on every TP rank
(:mod:`tp_fuse.overlap.auto`; the tuner is :attr:`TPOverlap.tuner`).

A method that cannot apply to a window (e.g. ``bulk`` for a forward GEMM, which has no
independent computation to hide behind) makes the fusion matcher reject the window with
that reason, which ``explain`` shows; nothing falls back silently.

GPU-only knobs of the Megatron files (``num_sm``, ``cga_size``, ``set_sm_margin``,
``atomic_gemm``, ``use_ce``, ``fp8_buf``, ``comm_priority``, ``gemm_priority``,
``pipeline_rs_overlap_first_gemm``) are accepted and reported by
:meth:`OverlapConfig.ignored_fields` (and in ``explain``), as are settings that have no
effect for the chosen method (``num_splits`` of ``ring_exchange``/``bulk``) and
``aggregate=1`` (not implemented by ``tp_fuse.comm.ring_exchange_ag_gemm``: one GEMM per chunk).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

from tp_fuse.comm import UserBufferPool

from ..safe_yaml import load_yaml, read_yaml_file
from .auto import OverlapAutoTuner
from .method import CONFIG_METHODS, Method

__all__ = [
    "GEMM_LAYERS",
    "GEMM_STAGES",
    "GemmOverlapConfig",
    "OverlapConfig",
    "TPOverlap",
]

#: Layer names of Megatron's overlap config (attention QKV/output projection, MLP fc1/fc2).
GEMM_LAYERS = ("qkv", "proj", "fc1", "fc2")
#: GEMM stages: forward, data gradient, weight gradient.
GEMM_STAGES = ("fprop", "dgrad", "wgrad")
#: What an entry's ``method`` may name: the methods of :data:`~tp_fuse.overlap.method.CONFIG_METHODS`,
#: or ``auto`` (measured per GEMM stage and shape, see :mod:`tp_fuse.overlap.auto`).
_ALLOWED = tuple(str(m) for m in (*CONFIG_METHODS, Method.AUTO))

# Knobs of Megatron/TE userbuffers that only mean something for the CUDA kernels.
_GPU_ONLY_FIELDS: dict[str, str] = {
    "num_sm": "SMs given to the communication kernel (GPU-only)",
    "cga_size": "CUDA cooperative-group array size (GPU-only)",
    "set_sm_margin": "reserves SMs for communication (GPU-only)",
    "atomic_gemm": "atomic GEMM with counters (GPU-only; comm here is point-to-point)",
    "use_ce": "copy-engine transfers (GPU-only)",
    "fp8_buf": "FP8 communication buffer: all-gathers under autocast always carry FP8 bytes",
    "comm_priority": "CUDA stream priority (GPU-only)",
    "gemm_priority": "CUDA stream priority (GPU-only)",
    "pipeline_rs_overlap_first_gemm": "TE kernel-ordering detail (GPU-only)",
}
_FIELDS = ("method", "num_splits", "aggregate", "enabled", *_GPU_ONLY_FIELDS)

# Megatron-LM / Transformer Engine defaults (te.module.base.initialize_ub):
# ring-exchange all-gathers, pipelined reduce-scatters with 4 splits, bulk backward overlaps.
_ROLE_DEFAULTS: dict[str, dict[str, tuple[Method, int]]] = {
    "column": {"fprop": (Method.RING_EXCHANGE, 4), "dgrad": (Method.BULK, 4), "wgrad": (Method.BULK, 4)},
    "row": {"fprop": (Method.PIPELINE, 4), "dgrad": (Method.RING_EXCHANGE, 4), "wgrad": (Method.BULK, 4)},
}
_LAYER_ROLE = {"qkv": "column", "fc1": "column", "proj": "row", "fc2": "row"}


@dataclasses.dataclass(frozen=True)
class GemmOverlapConfig:
    """Overlap settings of one GEMM stage (one top-level entry of a Megatron YAML file).

    Attributes:
        method: a :class:`~tp_fuse.overlap.method.Method` (given as one or as its YAML
            spelling ``"ring_exchange"``, ``"pipeline"``, ``"bulk"`` or ``"auto"``,
            converted here once; ``auto`` is measured:
            the methods that apply to the window and no overlap are timed at the first
            call with a new shape; see :mod:`tp_fuse.overlap.auto`).
        num_splits: chunks of a pipelined overlap (``pipeline``; with ``auto``, one more
            split count to try besides the tuner's).
        aggregate: Megatron's two-chunks-per-GEMM ring option; accepted, not implemented
            (reported by :meth:`ignored`).
        enabled: False switches overlap off for this GEMM stage (a tp-fuse extension of
            the YAML format; the fusion is rejected with "overlap disabled ... by config").
        gpu_only: the GPU-only knobs given for this entry, as ``(field, value)`` pairs.
        explicit: field names given explicitly (so ignored settings can be reported).
    """

    method: Method
    num_splits: int = 4
    aggregate: bool = False
    enabled: bool = True
    gpu_only: tuple[tuple[str, Any], ...] = ()
    explicit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # The config boundary: the YAML/Hydra string becomes a Method here, once.
        if not isinstance(self.method, str) or self.method not in _ALLOWED:
            raise ValueError(f"overlap method must be one of {_ALLOWED}, got {self.method!r}")
        object.__setattr__(self, "method", Method(self.method))
        n = self.num_splits
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_splits must be a positive int, got {n!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")

    def ignored(self) -> list[str]:
        """``"field=value (why)"`` for every setting that has no effect here."""
        out = [f"{k}={v!r} ({_GPU_ONLY_FIELDS[k]})" for k, v in self.gpu_only]
        if "num_splits" in self.explicit and self.method not in (Method.PIPELINE, Method.AUTO):
            out.append(f"num_splits={self.num_splits} (only the pipeline method splits)")
        if self.aggregate:
            out.append(
                "aggregate=1 (not implemented: tp_fuse.comm.ring_exchange_ag_gemm runs one GEMM per chunk)"
            )
        return out

    def describe(self) -> str:
        """``"pipeline (num_splits=4)"``, ``"ring_exchange"``, ..."""
        return f"pipeline (num_splits={self.num_splits})" if self.method is Method.PIPELINE else str(self.method)


def _parse_entry(key: str, raw: Any) -> GemmOverlapConfig:
    if not isinstance(raw, Mapping):
        raise ValueError(f"overlap config entry {key!r}: expected a mapping of fields, got {raw!r}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(
            f"overlap config entry {key!r}: unknown field(s) {unknown}; known fields: {list(_FIELDS)}"
        )
    if "method" not in raw:
        raise ValueError(f"overlap config entry {key!r}: 'method' is required (one of {_ALLOWED})")
    aggregate = raw.get("aggregate", False)
    if aggregate not in (0, 1, True, False):
        raise ValueError(f"overlap config entry {key!r}: aggregate must be 0/1, got {aggregate!r}")
    try:
        return GemmOverlapConfig(
            method=raw["method"],
            num_splits=raw.get("num_splits", 4),
            aggregate=bool(aggregate),
            enabled=raw.get("enabled", True),
            gpu_only=tuple((k, raw[k]) for k in _GPU_ONLY_FIELDS if k in raw),
            explicit=frozenset(raw),
        )
    except ValueError as e:
        raise ValueError(f"overlap config entry {key!r}: {e}") from None


def megatron_defaults(layers: Iterable[str] = GEMM_LAYERS) -> dict[str, GemmOverlapConfig]:
    """Megatron's default entry for every stage of ``layers`` (known layer names only)."""
    table = {}
    for layer in layers:
        for stage in GEMM_STAGES:
            method, splits = _ROLE_DEFAULTS[_LAYER_ROLE[layer]][stage]
            table[f"{layer}_{stage}"] = GemmOverlapConfig(method=method, num_splits=splits)
    return table


def static_default(key: str) -> Optional[tuple[Method, int]]:
    """Megatron's ``(method, num_splits)`` for a GEMM stage key (``"fc1_fprop"``, or an
    unnamed linear's ``"column_dgrad"``); None for a layer of unknown role. ``method: auto``
    falls back to it when measuring cannot tell the candidates apart."""
    prefix, _, stage = key.rpartition("_")
    role = _LAYER_ROLE.get(prefix, prefix)
    if role not in _ROLE_DEFAULTS or stage not in GEMM_STAGES:
        return None
    return _ROLE_DEFAULTS[role][stage]


def auto_defaults(layers: Iterable[str] = GEMM_LAYERS) -> dict[str, GemmOverlapConfig]:
    """``method: auto`` for every stage of ``layers``."""
    return {f"{layer}_{stage}": GemmOverlapConfig(method=Method.AUTO) for layer in layers for stage in GEMM_STAGES}


@dataclasses.dataclass
class OverlapConfig:
    """Overlap method per GEMM stage, plus a global switch.

    Args:
        gemms: entries by key ``"<layer>_<stage>"``; missing Megatron keys get Megatron's
            defaults (qkv/fc1 fprop ``ring_exchange``, proj/fc2 fprop ``pipeline`` with 4
            splits, qkv/fc1 dgrad/wgrad ``bulk``, proj/fc2 dgrad ``ring_exchange``).
        enabled: False switches every overlap fusion off.
        auto: missing entries (and unnamed GEMMs) take ``method: auto`` instead of
            Megatron's defaults; entries given explicitly keep their method.
        extra_layers: layer names besides ``qkv, proj, fc1, fc2`` that entries may use
            (e.g. ``("lm_head",)``); an extra layer needs an entry for each stage it runs.
        source: where the config came from (for messages).
    """

    gemms: dict[str, GemmOverlapConfig] = dataclasses.field(default_factory=dict)
    enabled: bool = True
    extra_layers: tuple[str, ...] = ()
    source: Optional[str] = None
    auto: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"OverlapConfig: enabled must be a bool, got {self.enabled!r}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"OverlapConfig: auto must be a bool, got {self.auto!r}")
        self.extra_layers = tuple(self.extra_layers)
        layers = (*GEMM_LAYERS, *self.extra_layers)
        known = {f"{layer}_{stage}" for layer in layers for stage in GEMM_STAGES}
        unknown = sorted(set(self.gemms) - known)
        if unknown:
            raise ValueError(
                f"OverlapConfig{self._from()}: unknown GEMM name(s) {unknown}; expected "
                f"<layer>_<stage> with layer in {list(layers)} and stage in {list(GEMM_STAGES)} "
                "(pass extra_layers=... for other layer names)"
            )
        for key, entry in self.gemms.items():
            if not isinstance(entry, GemmOverlapConfig):
                raise ValueError(f"OverlapConfig: entry {key!r} must be a GemmOverlapConfig, got {entry!r}")
        self.gemms = {**(auto_defaults() if self.auto else megatron_defaults()), **self.gemms}

    def _from(self) -> str:
        return f" ({self.source})" if self.source else ""

    # ---- construction ----------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        cfg: Mapping[str, Any],
        *,
        enabled: bool = True,
        extra_layers: Iterable[str] = (),
        source: Optional[str] = None,
        warn_ignored: bool = True,
        auto: bool = False,
    ) -> "OverlapConfig":
        """Build from a Megatron-style mapping ``{"fc1_fprop": {"method": ...}, ...}``
        (``auto``: entries it does not give are ``method: auto``)."""
        if cfg is None:
            cfg = {}
        if not isinstance(cfg, Mapping):
            raise ValueError(f"overlap config{f' ({source})' if source else ''}: expected a mapping, got {type(cfg).__name__}")
        config = cls(
            {str(k): _parse_entry(str(k), v) for k, v in cfg.items()},
            enabled=enabled,
            extra_layers=tuple(extra_layers),
            source=source,
            auto=auto,
        )
        ignored = config.ignored_fields()
        if warn_ignored and ignored:
            warnings.warn(
                f"OverlapConfig{config._from()}: settings without effect on this build: "
                + "; ".join(ignored),
                UserWarning,
                stacklevel=2,
            )
        return config

    @classmethod
    def from_yaml(
        cls,
        path_or_text: Union[str, os.PathLike],
        *,
        enabled: bool = True,
        extra_layers: Iterable[str] = (),
        warn_ignored: bool = True,
        auto: bool = False,
    ) -> "OverlapConfig":
        """Load a Megatron-LM ``tp_comm_overlap_cfg`` YAML file (or YAML text) as it is
        (``auto``: GEMM stages the file does not name are ``method: auto``).

        A YAML syntax error is a ValueError naming the file, line and column; the file is read
        bounded and without aliases (:mod:`tp_fuse.safe_yaml`).
        """
        text = os.fspath(path_or_text)
        if os.path.exists(text):  # a FIFO or device exists too: read_yaml_file says what it is
            source = text
            data = read_yaml_file(text, "OverlapConfig.from_yaml:")
        elif "\n" not in text and text.endswith((".yaml", ".yml")):
            raise ValueError(f"OverlapConfig.from_yaml: file not found: {text}")
        else:
            source = "<yaml text>"
            data = load_yaml(text, f"OverlapConfig.from_yaml: {source}")
        return cls.from_dict(
            data or {},
            enabled=enabled,
            extra_layers=extra_layers,
            source=source,
            warn_ignored=warn_ignored,
            auto=auto,
        )

    # ---- queries -----------------------------------------------------------

    def entry(self, key: str) -> GemmOverlapConfig:
        """The entry for ``"<layer>_<stage>"`` (ValueError naming the known keys otherwise)."""
        if key not in self.gemms:
            raise ValueError(
                f"OverlapConfig{self._from()}: no entry {key!r}; known: {sorted(self.gemms)}"
            )
        return self.gemms[key]

    def resolve(self, comm_name: Optional[str], stage: str, role: str) -> tuple[str, GemmOverlapConfig]:
        """``(key, entry)`` for a GEMM stage.

        ``comm_name`` None (an unnamed ``BasicLinear``) takes Megatron's defaults for the
        parallel ``role`` (``"column"`` or ``"row"``), or ``auto`` when the config is
        ``auto``, under the key ``"<role>_<stage>"``.
        """
        if stage not in GEMM_STAGES:
            raise ValueError(f"stage must be one of {GEMM_STAGES}, got {stage!r}")
        if role not in _ROLE_DEFAULTS:
            raise ValueError(f"role must be one of {tuple(_ROLE_DEFAULTS)}, got {role!r}")
        if comm_name is None:
            if self.auto:
                return f"{role}_{stage}", GemmOverlapConfig(method=Method.AUTO)
            method, splits = _ROLE_DEFAULTS[role][stage]
            return f"{role}_{stage}", GemmOverlapConfig(method=method, num_splits=splits)
        key = f"{comm_name}_{stage}"
        if key not in self.gemms:
            raise ValueError(
                f"BasicLinear comm_name {comm_name!r}: overlap config{self._from()} has no entry "
                f"{key!r}; known layers: {sorted({k.rsplit('_', 1)[0] for k in self.gemms})} "
                "(add the layer with OverlapConfig(..., extra_layers=...))"
            )
        return key, self.gemms[key]

    def disable(self, *keys: str) -> "OverlapConfig":
        """A copy with overlap off for ``keys`` (``"fc2_fprop"``, or ``"fc2"`` for all stages)."""
        gemms = dict(self.gemms)
        for key in keys:
            targets = [key] if key in gemms else [f"{key}_{s}" for s in GEMM_STAGES if f"{key}_{s}" in gemms]
            if not targets:
                raise ValueError(f"OverlapConfig.disable: unknown GEMM name {key!r}; known: {sorted(gemms)}")
            for t in targets:
                gemms[t] = dataclasses.replace(gemms[t], enabled=False)
        return OverlapConfig(
            gemms, enabled=self.enabled, extra_layers=self.extra_layers, source=self.source, auto=self.auto
        )

    def with_entry(self, key: str, **fields: Any) -> "OverlapConfig":
        """A copy with ``fields`` of entry ``key`` replaced (e.g. ``method="pipeline"``)."""
        base = self.entry(key)
        entry = dataclasses.replace(base, explicit=base.explicit | frozenset(fields), **fields)
        return OverlapConfig(
            {**self.gemms, key: entry}, enabled=self.enabled, extra_layers=self.extra_layers, source=self.source,
            auto=self.auto,
        )

    def ignored_fields(self) -> list[str]:
        """``"<key>.<field>=<value> (why)"`` for every accepted setting without effect here."""
        return [f"{key}.{item}" for key in sorted(self.gemms) for item in self.gemms[key].ignored()]


class TPOverlap:
    """An overlap config plus the workspace pool of the overlap fusions that use it.

    Pass one object to the ops of a model (see the module docstring). Workspaces are
    named after the GEMM stage (``"fc1_fprop"``...), so all layers with the same
    ``comm_name`` share one set of buffers, allocated once and reused every step.

    Args:
        config: the :class:`OverlapConfig` (default: Megatron's defaults, enabled).
        pool: a :class:`tp_fuse.comm.UserBufferPool` (default: a new one owned by this object).
        save_gathered_input: column-parallel ``[AllGather, BasicLinear]``: keep the
            all-gathered input from the forward pass for the weight gradient instead of
            keeping this rank's shard and all-gathering it again in the backward pass
            (behind the dgrad GEMM). False (Megatron's choice) keeps activation memory at
            1/tp; True trades ``tp`` times the activation memory for one collective less.
        check_shapes: also run comm's collective shape-agreement check (one small
            all-gather) before each overlapped GEMM; local checks always run.
        tuner: the :class:`~tp_fuse.overlap.auto.OverlapAutoTuner` that measures and
            caches the choices of ``method: auto`` GEMM stages (default: a new one with a
            wall clock and no choice file). One tuner per model: GEMM stages with the same
            name and shapes (the same ``comm_name`` in every layer) are measured once.
    """

    def __init__(
        self,
        config: Optional[OverlapConfig] = None,
        pool: Any = None,
        *,
        save_gathered_input: bool = False,
        check_shapes: bool = False,
        tuner: Optional[OverlapAutoTuner] = None,
    ) -> None:

        if config is None:
            config = OverlapConfig()
        if not isinstance(config, OverlapConfig):
            raise ValueError(f"TPOverlap: config must be an OverlapConfig, got {type(config).__name__}")
        if pool is None:
            pool = UserBufferPool()
        if not isinstance(pool, UserBufferPool):
            raise ValueError(f"TPOverlap: pool must be a tp_fuse.comm.UserBufferPool, got {type(pool).__name__}")
        for name, value in (("save_gathered_input", save_gathered_input), ("check_shapes", check_shapes)):
            if not isinstance(value, bool):
                raise ValueError(f"TPOverlap: {name} must be a bool, got {value!r}")
        if tuner is None:
            tuner = OverlapAutoTuner()
        if not isinstance(tuner, OverlapAutoTuner):
            raise ValueError(f"TPOverlap: tuner must be an OverlapAutoTuner, got {type(tuner).__name__}")
        self.config = config
        self.pool = pool
        self.tuner = tuner
        self.save_gathered_input = save_gathered_input
        self.check_shapes = check_shapes

    def __repr__(self) -> str:
        return (
            f"TPOverlap(enabled={self.config.enabled}, source={self.config.source!r}, "
            f"save_gathered_input={self.save_gathered_input}, pool_bytes={self.pool.total_bytes})"
        )
