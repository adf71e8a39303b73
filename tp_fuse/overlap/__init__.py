"""Communication/GEMM overlap: the overlap object and its configuration (``config``:
``TPOverlap``, ``OverlapConfig``), the typed method (``method``: ``Method``,
``OverlapMethod``), the one table from a method to its algorithm per window
(``algorithms``), the measured per-shape choice of the method (``auto``), what a fused op
decided for one GEMM stage (``plan``), PyTorch's symmetric-memory fused ops (``symm_mem``;
their schemas and constraints: ``symm_mem_rules``) and Transformer Engine's ``initialize_ub``
(``userbuffers_setup``).

The comm algorithms themselves are in ``tp_fuse.comm.overlap``; docs/overlap.md shows how
the pieces meet.
"""
