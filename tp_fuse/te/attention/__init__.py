"""Transformer Engine's ``transformer_engine.pytorch.attention``: :class:`MultiheadAttention`
(``te.MultiheadAttention``) on tp_fuse's module classes. TE's ``DotProductAttention`` module
(its constructor and backends) is not here; the core attention tp_fuse computes with is
:class:`tp_fuse.layers.attention.DotProductAttention`."""

from .multi_head_attention import MultiheadAttention

__all__ = ["MultiheadAttention"]
