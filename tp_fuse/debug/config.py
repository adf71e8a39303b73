"""Debug feature YAML: which layers get which features (Transformer Engine's format).

A file holds one or more named sections::

    log_mlp_stats:                      # section name (free text)
      enabled: true
      layers:
        layer_name_regex_pattern: .*fc[12]   # re.match against the layer name
        # layer_types: [qkv, proj]           # or: any of these substrings
      transformer_engine:               # feature namespace ("tp_fuse" works too)
        LogTensorStats:
          enabled: true
          tensors: [activation, gradient, weight, output, wgrad, dgrad]
          stats: [min, max, mean, std, l1_norm, l2_norm, amax, dynamic_range]
          freq: 1                       # every N iterations
          start_step: 0                 # optional window
          end_step: null
        DisableFP8GEMM:
          enabled: true
          gemms: [dgrad, wgrad]

Per-tensor or per-GEMM options can be given as lists of dicts instead
(``tensors_struct: [{tensor: activation, stats: [max], freq: 2}]``,
``gemms_struct: [{gemm: fprop, tensors: [activation]}]``) exactly as in TE.
Every error names the offending key (``section.transformer_engine.Feature.key``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Union

from ..safe_yaml import read_yaml_file

__all__ = ["GEMMS", "TENSORS", "FeatureSpec", "Section", "load_debug_config"]

GEMMS = ("fprop", "dgrad", "wgrad")
TENSORS = ("activation", "weight", "gradient", "output", "wgrad", "dgrad")
_NAMESPACES = ("transformer_engine", "tp_fuse")
_SECTION_KEYS = {"enabled", "layers", *_NAMESPACES}
_LAYER_KEYS = {"layer_name_regex_pattern", "layer_types"}


@dataclasses.dataclass
class _Scope:
    """Options plus an optional per-tensor restriction (``tensors``/``tensors_struct``)."""

    opts: dict[str, Any]
    per_tensor: Optional[dict[str, dict[str, Any]]]  # None: every tensor

    def for_tensor(self, tensor: Optional[str]) -> Optional[dict[str, Any]]:
        cfg = dict(self.opts)
        if tensor is None:
            return cfg
        if self.per_tensor is None:
            return cfg
        if tensor not in self.per_tensor:
            return None
        cfg.update(self.per_tensor[tensor])
        return cfg


@dataclasses.dataclass
class FeatureSpec:
    """One feature's options in one section.

    ``scope``: options that apply everywhere, restricted to some tensors when the
    YAML listed ``tensors``/``tensors_struct``. ``per_gemm``: when the YAML listed
    ``gemms``/``gemms_struct``, the scope of each covered GEMM (its own options
    merged over the feature's).
    """

    name: str
    where: str
    scope: _Scope
    per_gemm: Optional[dict[str, _Scope]]

    def config_for(self, gemm: Optional[str] = None, tensor: Optional[str] = None) -> Optional[dict[str, Any]]:
        """The merged options for ``(gemm, tensor)``, or None if the feature does not cover it.

        ``gemm=None`` (calls without a GEMM, such as ``inspect_tensor``) is covered when
        any listed GEMM covers the tensor.
        """
        if self.per_gemm is None:
            return self.scope.for_tensor(tensor)
        gemms = list(self.per_gemm) if gemm is None else [gemm]
        for g in gemms:
            scope = self.per_gemm.get(g)
            if scope is None:
                continue
            cfg = scope.for_tensor(tensor)
            if cfg is not None:
                return cfg
        return None


@dataclasses.dataclass
class Section:
    """A named section: a layer selector and the features it enables."""

    name: str
    regex: Optional[re.Pattern[str]]
    layer_types: Optional[list[str]]
    features: dict[str, FeatureSpec]

    def matches(self, layer_name: str) -> bool:
        if self.regex is not None and self.regex.match(layer_name) is None:
            return False
        if self.layer_types is not None and not any(t in layer_name for t in self.layer_types):
            return False
        return True


def _names_list(value: Any, allowed: tuple[str, ...], where: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: expected a list of names from {allowed}, got {value!r}")
    bad = [v for v in value if v not in allowed]
    if bad:
        raise ValueError(f"{where}: unknown name(s) {bad}; expected names from {allowed}")
    return value


def _struct(value: Any, key: str, allowed: tuple[str, ...], where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of mappings with a {key!r} key, got {value!r}")
    out: dict[str, dict[str, Any]] = {}
    for i, item in enumerate(value):
        if not isinstance(item, dict) or key not in item:
            raise ValueError(f"{where}[{i}]: expected a mapping with a {key!r} key, got {item!r}")
        opts = dict(item)
        name = opts.pop(key)
        _names_list([name], allowed, f"{where}[{i}].{key}")
        if name in out:
            raise ValueError(f"{where}[{i}]: {key} {name!r} listed twice")
        out[name] = opts
    return out


def _scope(opts: dict[str, Any], inherited: Optional[_Scope], where: str) -> _Scope:
    """Split ``tensors``/``tensors_struct`` out of ``opts`` (validated)."""
    opts = dict(opts)
    per_tensor = inherited.per_tensor if inherited is not None else None
    if "tensors_struct" in opts:
        if "tensors" in opts:
            raise ValueError(f"{where}: give either tensors or tensors_struct, not both")
        per_tensor = _struct(opts.pop("tensors_struct"), "tensor", TENSORS, f"{where}.tensors_struct")
    elif "tensors" in opts:
        per_tensor = {t: {} for t in _names_list(opts.pop("tensors"), TENSORS, f"{where}.tensors")}
    base = dict(inherited.opts) if inherited is not None else {}
    base.update(opts)
    return _Scope(base, per_tensor)


def _feature(name: str, raw: Any, where: str) -> Optional[FeatureSpec]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of options, got {raw!r}")
    opts = dict(raw)
    enabled = opts.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"{where}.enabled: expected true/false, got {enabled!r}")
    if not enabled:
        return None
    gemm_opts: Optional[dict[str, dict[str, Any]]] = None
    if "gemms_struct" in opts:
        if "gemms" in opts:
            raise ValueError(f"{where}: give either gemms or gemms_struct, not both")
        gemm_opts = _struct(opts.pop("gemms_struct"), "gemm", GEMMS, f"{where}.gemms_struct")
    elif "gemms" in opts:
        gemm_opts = {g: {} for g in _names_list(opts.pop("gemms"), GEMMS, f"{where}.gemms")}
    scope = _scope(opts, None, where)
    per_gemm = None
    if gemm_opts is not None:
        per_gemm = {g: _scope(o, scope, f"{where}.gemms_struct.{g}") for g, o in gemm_opts.items()}
    return FeatureSpec(name=name, where=where, scope=scope, per_gemm=per_gemm)


def load_debug_config(source: Union[str, os.PathLike, dict[str, Any]]) -> list[Section]:
    """Parse a debug YAML file (path) or an already-loaded mapping into sections.

    Disabled sections and features are dropped. Feature names are checked later,
    against the session's feature classes.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):  # a FIFO or device exists: read_yaml_file says what it is
            raise ValueError(f"debug config: no such file: {path!r}")
        data = read_yaml_file(path, "debug config")
        origin = path
    else:
        data, origin = source, "<dict>"
    if not isinstance(data, dict) or not data:
        raise ValueError(f"debug config {origin}: expected a non-empty mapping of sections, got {data!r}")
    sections: list[Section] = []
    for sec_name, raw in data.items():
        where = str(sec_name)
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a mapping, got {raw!r}")
        unknown = sorted(set(raw) - _SECTION_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_SECTION_KEYS)}")
        enabled = raw.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"{where}.enabled: expected true/false, got {enabled!r}")
        if not enabled:
            continue
        layers = raw.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise ValueError(
                f"{where}.layers: expected a mapping with layer_name_regex_pattern and/or layer_types, got {layers!r}"
            )
        unknown = sorted(set(layers) - _LAYER_KEYS)
        if unknown:
            raise ValueError(f"{where}.layers: unknown key(s) {unknown}; known: {sorted(_LAYER_KEYS)}")
        regex = None
        if "layer_name_regex_pattern" in layers:
            try:
                regex = re.compile(str(layers["layer_name_regex_pattern"]))
            except re.error as exc:
                raise ValueError(f"{where}.layers.layer_name_regex_pattern: invalid regex: {exc}") from exc
        types_ = None
        if "layer_types" in layers:
            types_ = layers["layer_types"]
            if not isinstance(types_, list) or not all(isinstance(t, str) for t in types_):
                raise ValueError(f"{where}.layers.layer_types: expected a list of strings, got {types_!r}")
        features: dict[str, FeatureSpec] = {}
        for ns in _NAMESPACES:
            block = raw.get(ns)
            if block is None:
                continue
            if not isinstance(block, dict):
                raise ValueError(f"{where}.{ns}: expected a mapping of features, got {block!r}")
            for fname, fraw in block.items():
                if fname in features:
                    raise ValueError(f"{where}: feature {fname} given twice")
                spec = _feature(str(fname), fraw, f"{where}.{ns}.{fname}")
                if spec is not None:
                    features[str(fname)] = spec
        sections.append(Section(name=where, regex=regex, layer_types=types_, features=features))
    return sections
