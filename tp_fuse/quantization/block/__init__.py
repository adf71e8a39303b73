"""Block-scaled FP8 (Float8 block, MXFP8, row-wise; NVFP4's tensors too): the tensor,
the quantization math and casts, quantizers, GEMM and wire format.
"""
