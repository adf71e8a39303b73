"""Built-in debug features (Transformer Engine's names).

This directory is also what nvdlfw-inspect's ``feature_dirs`` names
(``tp_fuse.debug.FEATURE_DIR``): the framework executes each file here on its own, so
imports are absolute, and ``_register_with_nvdlfw_inspect.py`` registers the features and
the ``transformer_engine`` namespace API then.
"""

from tp_fuse.debug.features.api import DebugFeature, enabled_at
from tp_fuse.debug.features.disable_fp8_gemm import DisableFP8GEMM, DisableFP8Layer
from tp_fuse.debug.features.fake_quant import FakeQuant
from tp_fuse.debug.features.log_fp8_tensor_stats import LogFp8TensorStats
from tp_fuse.debug.features.log_tensor_stats import LogTensorStats
from tp_fuse.debug.features.per_tensor_scaling import PerTensorScaling

#: Features a DebugSession knows unless given others.
BUILTIN_FEATURES: dict[str, type[DebugFeature]] = {
    "LogTensorStats": LogTensorStats,
    "LogFp8TensorStats": LogFp8TensorStats,
    "DisableFP8GEMM": DisableFP8GEMM,
    "DisableFP8Layer": DisableFP8Layer,
    "FakeQuant": FakeQuant,
    "PerTensorScaling": PerTensorScaling,
}

__all__ = [
    "BUILTIN_FEATURES",
    "DebugFeature",
    "DisableFP8GEMM",
    "DisableFP8Layer",
    "FakeQuant",
    "LogFp8TensorStats",
    "LogTensorStats",
    "PerTensorScaling",
    "enabled_at",
]
