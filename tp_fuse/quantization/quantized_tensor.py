"""``QuantizedTensor``: the common base of low-precision tensors (Transformer Engine's name).

``isinstance(t, QuantizedTensor)`` is how user code asks "is this tensor quantized?"
without naming a format. :class:`~tp_fuse.quantization.Float8Tensor` and the block-scaled
:class:`~tp_fuse.quantization.BlockScaledTensor` (MXFP8, blockwise, NVFP4) derive from it;
the class itself holds no data and is never instantiated.
"""

from __future__ import annotations

import torch

__all__ = ["QuantizedTensor"]


class QuantizedTensor(torch.Tensor):
    """Base class of tensors stored in a low-precision format with scales.

    Subclasses are ``torch.Tensor`` wrapper subclasses that report a nominal
    high-precision ``dtype`` and provide ``dequantize(dtype=None)``.
    """

    def dequantize(self, dtype: "torch.dtype | None" = None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize")
