"""Transformer Engine's ``transformer_engine.pytorch.attention``: :class:`MultiheadAttention`
(``te.MultiheadAttention``) on tp_fuse's module classes, and :class:`DotProductAttention`
(``te.DotProductAttention``), TE's core-attention module over tp_fuse's one attention
implementation (:class:`tp_fuse.layers.attention.DotProductAttention`, SDPA)."""

from . import dot_product_attention
from .dot_product_attention import DotProductAttention
from .multi_head_attention import MultiheadAttention

__all__ = ["DotProductAttention", "MultiheadAttention", "dot_product_attention"]
