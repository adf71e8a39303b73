"""tp_fuse's debug features on NVIDIA's nvdlfw-inspect framework (Transformer Engine's debug API).

A Transformer Engine user's debug code runs as written::

    import nvdlfw_inspect.api as debug_api
    import tp_fuse.debug

    debug_api.initialize(config_file="debug.yaml", feature_dirs=[tp_fuse.debug.FEATURE_DIR])
    model = ...                                   # tp_fuse ops / layers
    debug_api.infer_and_assign_layer_names(model) # TE's layer naming (or tp_fuse.debug.attach_debug_api)
    for step in ...:
        loss = model(x); loss.backward(); opt.step()
        debug_api.step()                          # logs this step's statistics
    debug_api.end_debug()

``FEATURE_DIR`` (``tp_fuse/debug/features``) sits where Transformer Engine's
``transformer_engine/debug/features`` does. nvdlfw-inspect executes its files;
``_register_with_nvdlfw_inspect.py`` then registers :class:`TransformerEngineAPI` as the
``transformer_engine`` namespace (TE's YAML key) and every built-in feature under its TE
name (LogTensorStats, LogFp8TensorStats, DisableFP8GEMM, DisableFP8Layer, FakeQuant,
PerTensorScaling).

What the framework does (and tp_fuse therefore does not, on this path): reading the YAML,
``enabled`` sections, matching layers (``layer_name_regex_pattern``, ``layer_types``,
``layer_numbers``, ``exact_layer_names``), refusing unknown features and two sections on
one layer, the iteration counter (``step()``, ``initialize_training_step``), caching routing
decisions, and the statistics loggers (``statistics_logger``, ``tb_writer``, its default file
logger under ``log_dir``). What tp_fuse adds: each feature's options are checked on first
use with the same messages as :class:`~tp_fuse.debug.DebugSession` (ValueError naming
``<layer>: transformer_engine.<Feature>.<key>``), and statistics are combined over
micro-batches and the reduction group (``debug_api.set_tensor_reduction_group``, default:
all ranks) and logged once per ``step()`` as ``<layer>_<tensor>_<stat>`` (TE's names).

Global state: nvdlfw-inspect keeps one debug manager per process
(``nvdlfw_inspect.api.DEBUG_MANAGER``); that is what TE's entry point implies. tp_fuse's
state lives in the namespace API object the framework creates per ``initialize`` (its
statistics buffer) and in the ops' ``debug_hooks``. For several independent configurations
in one process, use :class:`~tp_fuse.debug.DebugSession` objects instead.

Layers: a ``BasicLinear`` joins when it has a debug layer name -- ``attach_debug_api(model)``
gives every one tp_fuse's name (``layers.0.fc1``; see :func:`~tp_fuse.debug.name_linears`);
otherwise, at its first forward pass, an op whose ``name`` attribute was set (by
``debug_api.infer_and_assign_layer_names(model)`` or by hand) joins under that name, the
``.basic_linear`` suffix of an ``ops.Linear``'s inner op dropped (so it is the
``ops.Linear``'s name). A layer some config section selects runs unfused, like a layer with
``DebugSession`` features; the others keep their fusions.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Optional

import torch
from nvdlfw_inspect.base import BaseNamespaceAPI

from ..ops.hooks import register_first_forward_hook
from .api_state import NAMESPACE, debug_api_initialized, layer_has_config
from .config import GEMMS, TENSORS, _feature
from .features.api import DebugFeature
from .hooks import LinearDebugHooks
from .naming import hooks_for, name_linears
from .stats import StatsBuffer

__all__ = ["FEATURE_DIR", "NAMESPACE", "TransformerEngineAPI", "attach_debug_api", "debug_api_initialized"]

#: The directory to pass as nvdlfw-inspect's ``feature_dirs`` (TE's ``debug/features``).
FEATURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "features")

#: Keyword arguments each call must get (the feature is chosen by them), as in TE.
_REQUIRED_KWARGS = {
    "fp8_gemm_enabled": ("gemm",),
    "modify_tensor_enabled": ("gemm", "tensor_name"),
    "modify_tensor": ("gemm", "tensor_name"),
    "inspect_tensor": ("tensor_name",),
    "inspect_tensor_enabled": ("tensor_name",),
    "inspect_tensor_postquantize": ("tensor_name",),
    "inspect_tensor_postquantize_enabled": ("tensor_name",),
}
#: Calls several features may answer at once (the others: at most one feature per tensor).
_MULTI = {"fp8_gemm_enabled", "inspect_tensor", "inspect_tensor_enabled",
          "inspect_tensor_postquantize", "inspect_tensor_postquantize_enabled"}


class _Defaults(DebugFeature):
    """What an unconfigured layer gets: TE's ``TEDefaultFeatures`` answers."""

    def inspect_tensor(self, *args: Any, **kwargs: Any) -> None:
        return None

    def inspect_tensor_postquantize(self, *args: Any, **kwargs: Any) -> None:
        return None

    def inspect_tensor_postquantize_enabled(self, *args: Any, **kwargs: Any):
        return False, None


class TransformerEngineAPI(BaseNamespaceAPI):
    """The ``transformer_engine`` namespace of nvdlfw-inspect, routing to tp_fuse's features.

    Created by nvdlfw-inspect at ``initialize`` (registered by the features directory);
    owns the statistics buffer its logging features write into, which ``step()`` reduces
    and hands to nvdlfw-inspect's ``MetricLogger``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._default_api_impl = _Defaults()
        self.stats = StatsBuffer()
        # Routing decisions nvdlfw-inspect may cache (per call site, layer and these kwargs).
        self._cacheable_api_kwargs_map = {
            "fp8_gemm_enabled": ["gemm"],
            "modify_tensor_enabled": ["gemm", "tensor_name"],
            "modify_tensor": ["gemm", "tensor_name"],
            "inspect_tensor": ["tensor_name"],
            "inspect_tensor_enabled": ["tensor_name"],
        }
        # (feature, id(raw config)) -> validated FeatureSpec; the raw dict is kept alive
        # beside it so the id cannot be reused by another dict.
        self._specs: dict[tuple[str, int], tuple[Any, Any]] = {}

    def set_features(self, features: dict[str, Any]) -> None:
        super().set_features(features)
        for feature in features.values():
            if isinstance(feature, DebugFeature):
                feature.stats = self.stats

    # ---- nvdlfw-inspect's hooks ----------------------------------------------

    def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
        for key in _REQUIRED_KWARGS.get(api_name, ("gemm", "tensor_name")):
            if key not in kwargs:
                raise ValueError(f"debug_api.{NAMESPACE}.{api_name}: keyword argument {key!r} is required "
                                 f"(the feature is chosen by {list(_REQUIRED_KWARGS.get(api_name, ()))})")
        if "gemm" in kwargs and kwargs["gemm"] not in GEMMS:
            raise ValueError(f"debug_api.{NAMESPACE}.{api_name}: gemm={kwargs['gemm']!r}; expected one of {GEMMS}")
        if "tensor_name" in kwargs and kwargs["tensor_name"] not in TENSORS:
            raise ValueError(f"debug_api.{NAMESPACE}.{api_name}: tensor_name={kwargs['tensor_name']!r}; "
                             f"expected one of {TENSORS}")

    def routing_condition(self, api_name: str, config: dict[str, Any], layer_name: str, feature_obj: Any,
                          **kwargs: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """Whether ``feature_obj`` covers this call, and its options for it.

        The feature's YAML block is validated once (ValueError naming the key) and scoped
        by ``gemms``/``gemms_struct`` and ``tensors``/``tensors_struct`` as in TE.
        """
        name = type(feature_obj).__name__
        key = (name, id(config))
        if key not in self._specs:
            where = f"{layer_name}: {NAMESPACE}.{name}"
            spec = _feature(name, config, where)
            if spec is not None and isinstance(feature_obj, DebugFeature):
                feature_obj.validate(spec)
            self._specs[key] = (spec, config)
        spec = self._specs[key][0]
        if spec is None:  # enabled: false
            return False, None
        gemm = kwargs.get("gemm") if "gemm" in _REQUIRED_KWARGS.get(api_name, ("gemm",)) else None
        tensor = kwargs.get("tensor_name") if "tensor_name" in _REQUIRED_KWARGS.get(api_name, ()) else None
        cfg = spec.config_for(gemm, tensor)
        if cfg is None:
            return False, None
        # nvdlfw-inspect treats an empty dict as "use the raw config": hand it a marker key.
        cfg = copy.deepcopy(cfg)
        cfg.setdefault("_feature", name)
        return True, cfg

    def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
        if api_name.endswith("_enabled"):
            ok = isinstance(ret, bool) or (isinstance(ret, tuple) and len(ret) == 2 and isinstance(ret[0], bool))
            if not ok:
                raise ValueError(f"{api_name}: a feature returned {ret!r}; expected bool or (bool, next_iteration)")
        elif api_name in ("inspect_tensor", "inspect_tensor_postquantize") and ret is not None:
            raise ValueError(f"{api_name}: a feature returned {type(ret).__name__}; expected None")
        elif api_name == "modify_tensor" and not isinstance(ret, torch.Tensor):
            raise ValueError(f"modify_tensor: a feature returned {type(ret).__name__}; expected a tensor")

    def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
        return api_name in _MULTI

    def handle_multi_feature_output(self, api_name: str, multi_feature_outputs: Any, features_to_invoke: Any,
                                    **kwargs: Any) -> Any:
        """Combine the answers of several features: FP8 runs when every feature allows it;
        a tensor is inspected when any feature wants it; next iteration is the earliest."""
        outs = list(multi_feature_outputs.values()) if isinstance(multi_feature_outputs, dict) \
            else list(multi_feature_outputs)
        if api_name.endswith("_enabled"):
            flags = [o[0] if isinstance(o, tuple) else o for o in outs]
            run = all(flags) if api_name == "fp8_gemm_enabled" else any(flags)
            nexts = [o[1] for o in outs if isinstance(o, tuple) and o[1] is not None]
            return run, (min(nexts) if nexts else None)
        return None  # inspect calls return nothing

    # ---- called by nvdlfw-inspect's step() / end_debug() --------------------

    def step(self) -> None:
        """Reduce the statistics recorded so far and log them (TE: ``STATS_BUFFERS.log_stats()``).

        Collective over the reduction group: every rank calls ``debug_api.step()``.
        """
        # "import ... as": a from-import would ask the module's __getattr__ for __path__,
        # which nvdlfw-inspect answers with a namespace look-up error.
        import nvdlfw_inspect.api as debug_api
        from nvdlfw_inspect.logging import MetricLogger

        for iteration, stats in self.stats.collect(debug_api.get_tensor_reduction_group()):
            for name, value in stats.items():
                # "debug/<layer>/<tensor>/<stat>" -> TE's "<layer>_<tensor>_<stat>".
                _, rest = name.split("/", 1)
                layer, tensor, stat = rest.rsplit("/", 2)
                MetricLogger.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)

    def end_debug(self) -> None:
        self.stats = StatsBuffer()
        self._specs.clear()


def check_namespace_registered() -> None:
    """ValueError unless ``initialize`` was given tp_fuse's features directory."""
    from nvdlfw_inspect.registry import Registry

    if NAMESPACE not in Registry.data or not isinstance(Registry.data[NAMESPACE].api, TransformerEngineAPI):
        raise ValueError(
            "nvdlfw_inspect.api.initialize(...) was called without tp_fuse's features: pass "
            f"feature_dirs=[tp_fuse.debug.FEATURE_DIR] (= {FEATURE_DIR!r})"
        )


def attach_debug_api(model: torch.nn.Module, *, tp_group: Optional[torch.distributed.ProcessGroup] = None) -> list[str]:
    """Route ``model``'s ``BasicLinear`` GEMMs through nvdlfw-inspect, under tp_fuse's layer
    names (:func:`~tp_fuse.debug.name_linears`: ``layers.0.fc1``, ...).

    Call after ``debug_api.initialize`` and before the first forward pass (fusion decisions
    are made then). Returns the names of the layers some config section selects. ValueError
    when the debug API is not initialized with tp_fuse's features, or when a layer already
    has a :class:`~tp_fuse.debug.DebugSession`.
    """
    if not debug_api_initialized():
        raise ValueError("attach_debug_api: call nvdlfw_inspect.api.initialize(config_file=..., "
                         "feature_dirs=[tp_fuse.debug.FEATURE_DIR]) first")
    check_namespace_registered()
    selected = []
    for name in name_linears(model):
        hooks = hooks_for(name, tp_group)
        hooks.use_debug_api()
        if layer_has_config(hooks.layer_name):
            selected.append(hooks.layer_name)
    return selected


def attach_named_op(op: Any) -> None:
    """At an op's first forward pass under the debug API: join under its ``name`` attribute
    (TE's naming), if it has one and no hooks of its own."""
    name = getattr(op, "name", None)
    if not isinstance(name, str) or not name:
        return
    suffix = ".basic_linear"  # ops.Linear's inner op: the layer is the ops.Linear
    layer_name = name[: -len(suffix)] if name.endswith(suffix) else name
    check_namespace_registered()
    hooks = getattr(op, "debug_hooks", None)
    if hooks is None:
        hooks = LinearDebugHooks("", layer_name)
        op.debug_hooks = hooks
    if hooks.session is None and not hooks.uses_debug_api:
        hooks.use_debug_api()


@register_first_forward_hook
def join_debug_api_at_first_forward(op: Any) -> None:
    """The op layer's first-forward hook (``tp_fuse.ops.hooks``): a GEMM op joins the debug API
    under its ``name`` when ``nvdlfw_inspect.api.initialize`` is in force; otherwise one
    ``sys.modules`` look-up."""
    if debug_api_initialized():
        attach_named_op(op)
