"""Built-in debug features (Transformer Engine's names)."""

from .api import DebugFeature, enabled_at
from .disable_fp8_gemm import DisableFP8GEMM
from .fake_quant import FakeQuant
from .log_fp8_tensor_stats import LogFp8TensorStats
from .log_tensor_stats import LogTensorStats

#: Features a DebugSession knows unless given others.
BUILTIN_FEATURES: dict[str, type[DebugFeature]] = {
    "LogTensorStats": LogTensorStats,
    "LogFp8TensorStats": LogFp8TensorStats,
    "DisableFP8GEMM": DisableFP8GEMM,
    "FakeQuant": FakeQuant,
}

__all__ = [
    "BUILTIN_FEATURES",
    "DebugFeature",
    "DisableFP8GEMM",
    "FakeQuant",
    "LogFp8TensorStats",
    "LogTensorStats",
    "enabled_at",
]
