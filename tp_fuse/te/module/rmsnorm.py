"""TE's module path ``transformer_engine.pytorch.module.rmsnorm``: :class:`RMSNorm`, defined
beside ``LayerNorm`` in :mod:`tp_fuse.te.module.layernorm` (one norm module class)."""

from .layernorm import RMSNorm

__all__ = ["RMSNorm"]
