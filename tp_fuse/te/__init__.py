"""Transformer Engine compatibility: TE's module classes, paths and helpers, in one room.

The top floor of ``tp_fuse``: it depends on ``tp_fuse.layers`` and ``tp_fuse.ops``, and
nothing below it imports it. ``import tp_fuse as te`` reaches these names lazily
(``te.Linear``, ``te.LayerNormLinear``, ``te.LayerNormMLP``, ``te.MultiheadAttention``,
``te.TransformerLayer``), and TE's module paths resolve here through
:mod:`tp_fuse._te_paths`:

=============================  =======================================
TE path (``tp_fuse.X``)        here
=============================  =======================================
``tp_fuse.module`` (+ ``.base``) ``tp_fuse.te.module``: Linear, LayerNormLinear, LayerNormMLP, userbuffers setup
``tp_fuse.attention``          ``tp_fuse.te.attention``: MultiheadAttention
``tp_fuse.transformer``        ``tp_fuse.te.transformer``: TransformerLayer
``tp_fuse.cpp_extensions``     ``tp_fuse.te.cpp_extensions``: general_gemm
``tp_fuse.constants``          ``tp_fuse.te.constants``: TE_DType maps, ``TE_API_VERSION``
``tp_fuse.fp8``                ``tp_fuse.te.fp8``: fp8_autocast, fp8_model_init, FP8GlobalStateManager
``tp_fuse.tensor``             ``tp_fuse.te.tensor``: QuantizedTensor and the other quantized tensors
``tp_fuse.router``             ``tp_fuse.te.router``: fused MoE-router names (refused when called)
``tp_fuse.distributed``        tp_fuse's own module (``checkpoint``); TE's ``CudaRNGStatesTracker``,
                               ``activation_recompute_forward`` served from ``tp_fuse.te.distributed``
=============================  =======================================

``TE_API_VERSION`` is the Transformer Engine API level these entry points implement (what
``transformer_engine.__version__`` reports where ``transformer_engine`` is mapped to tp_fuse:
:mod:`tp_fuse.te.te_alias`, ``tools/run_te_tests.py``); tp_fuse's own ``tp_fuse.__version__``
is the package version and unrelated.
"""

from . import attention, constants, cpp_extensions, fp8, module, router, tensor, transformer
from .attention import DotProductAttention, MultiheadAttention
from .constants import TE_API_VERSION
from .fp8 import fp8_autocast, fp8_model_init
from .module import Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .transformer import TransformerLayer

__all__ = [
    "DotProductAttention",
    "Fp8Padding",
    "Fp8Unpadding",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "TE_API_VERSION",
    "TransformerLayer",
    "attention",
    "constants",
    "cpp_extensions",
    "fp8",
    "fp8_autocast",
    "fp8_model_init",
    "module",
    "router",
    "tensor",
    "transformer",
]
