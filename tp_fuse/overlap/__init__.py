"""Communication/GEMM overlap: configuration (``config``), measured per-shape choice of the
method (``auto``) and what a fused op decided for one GEMM stage (``plan``).

The overlap algorithms themselves are in ``tp_fuse.comm.overlap``.
"""
