"""Transformer Engine's ``transformer_engine.pytorch.module`` path, for the names TE users
reach through it: ``tp_fuse.module.base.initialize_ub`` / ``destroy_ub`` /
``UserBufferQuantizationMode`` (implemented in ``tp_fuse.overlap.userbuffers_setup``).
tp_fuse's layers are ``tp_fuse.ops`` and ``tp_fuse.layers``; TE's module classes
(``te.Linear``, ``te.LayerNormMLP``...) are not here."""

from . import base

__all__ = ["base"]
