"""Transformer Engine's ``transformer_engine.pytorch.tensor``: the quantized tensor classes and
quantizers at TE's path (``te.tensor.QuantizedTensor``...). The classes live in
``tp_fuse.quantization``; these are the same objects (``isinstance`` checks agree)."""

from tp_fuse.quantization import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    MXFP8Quantizer,
    MXFP8Tensor,
    NVFP4Quantizer,
    NVFP4Tensor,
    QuantizedTensor,
    Quantizer,
)

__all__ = [
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensor",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "QuantizedTensor",
    "Quantizer",
]
