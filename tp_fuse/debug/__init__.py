"""Debug / inspect API: per-layer tensor statistics and FP8 experiments.

Follows Transformer Engine's debug feature API (Nvidia-DL-Framework-Inspect): a YAML
config selects layers by name and enables features (``LogTensorStats``,
``LogFp8TensorStats``, ``DisableFP8GEMM``, ``FakeQuant``, or your own
:class:`DebugFeature` subclasses); each ``BasicLinear`` GEMM makes the routing and
GEMM calls of that API. State lives in a :class:`DebugSession` object, not in a
global. A layer with a feature runs unfused; a layer without runs fully fused.

The same features are nvdlfw-inspect features (TE's debug API): pass
``feature_dirs=[tp_fuse.debug.FEATURE_DIR]`` to ``nvdlfw_inspect.api.initialize`` and a TE
user's YAML and ``debug_api`` calls work (:mod:`tp_fuse.debug.inspect_api`).

:class:`Fp8StatsCollector` is the always-cheap FP8 scaling-statistics tap the
launcher logs to W&B (numerics unchanged).
"""

from .config import GEMMS, TENSORS, load_debug_config
from .features import (
    BUILTIN_FEATURES,
    DebugFeature,
    DisableFP8GEMM,
    DisableFP8Layer,
    FakeQuant,
    LogFp8TensorStats,
    LogTensorStats,
    PerTensorScaling,
)
from .fp8_stats import FP8_STAT_NAMES, Fp8StatsCollector
from .hooks import LinearDebugHooks
from .inspect_api import FEATURE_DIR, NAMESPACE, attach_debug_api, debug_api_initialized
from .naming import LinearName, name_linears
from .session import DebugSession
from .stats import StatsBuffer

__all__ = [
    "BUILTIN_FEATURES",
    "DebugFeature",
    "DebugSession",
    "DisableFP8GEMM",
    "DisableFP8Layer",
    "FEATURE_DIR",
    "FP8_STAT_NAMES",
    "FakeQuant",
    "Fp8StatsCollector",
    "GEMMS",
    "LinearDebugHooks",
    "LinearName",
    "LogFp8TensorStats",
    "LogTensorStats",
    "NAMESPACE",
    "PerTensorScaling",
    "StatsBuffer",
    "TENSORS",
    "attach_debug_api",
    "debug_api_initialized",
    "load_debug_config",
    "name_linears",
]
