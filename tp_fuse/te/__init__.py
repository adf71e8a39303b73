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
``tp_fuse.constants``          ``tp_fuse.te.constants``: TE_DType maps
=============================  =======================================
"""

from . import attention, constants, cpp_extensions, module, transformer
from .attention import MultiheadAttention
from .module import LayerNormLinear, LayerNormMLP, Linear
from .transformer import TransformerLayer

__all__ = [
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "TransformerLayer",
    "attention",
    "constants",
    "cpp_extensions",
    "module",
    "transformer",
]
