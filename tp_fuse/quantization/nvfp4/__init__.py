"""NVFP4: quantization math (with "4over6"), casts and the ``NVFP4Quantizer``; its tensors
are ``block.tensor.BlockScaledTensor``.
"""
