"""Debug / inspect API: per-layer tensor statistics and FP8 experiments.

Follows Transformer Engine's debug feature API (Nvidia-DL-Framework-Inspect): a YAML
config selects layers by name and enables features (``LogTensorStats``,
``LogFp8TensorStats``, ``DisableFP8GEMM``, ``FakeQuant``, or your own
:class:`DebugFeature` subclasses); each ``BasicLinear`` GEMM makes the routing and
GEMM calls of that API. State lives in a :class:`DebugSession` object, not in a
global. A layer with a feature runs unfused; a layer without runs fully fused.

:class:`Fp8StatsCollector` is the always-cheap FP8 scaling-statistics tap the
launcher logs to W&B (numerics unchanged).
"""

from .config import GEMMS, TENSORS, load_debug_config
from .features import (
    BUILTIN_FEATURES,
    DebugFeature,
    DisableFP8GEMM,
    FakeQuant,
    LogFp8TensorStats,
    LogTensorStats,
)
from .fp8_stats import FP8_STAT_NAMES, Fp8StatsCollector
from .hooks import LinearDebugHooks
from .naming import LinearName, name_linears
from .session import DebugSession
from .stats import StatsBuffer

__all__ = [
    "BUILTIN_FEATURES",
    "DebugFeature",
    "DebugSession",
    "DisableFP8GEMM",
    "FP8_STAT_NAMES",
    "FakeQuant",
    "Fp8StatsCollector",
    "GEMMS",
    "LinearDebugHooks",
    "LinearName",
    "LogFp8TensorStats",
    "LogTensorStats",
    "StatsBuffer",
    "TENSORS",
    "load_debug_config",
    "name_linears",
]
