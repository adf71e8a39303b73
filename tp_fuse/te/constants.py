"""Transformer Engine's ``transformer_engine.pytorch.constants`` names (the dtype maps).

``TE_DType[torch_dtype]`` is the :class:`~tp_fuse.DType` of a torch dtype and
``TE_DType_To_Torch[DType.kX]`` the reverse, with TE's entries exactly: TE maps only the
dtypes its C++ extension takes (bytes, FP8, int32, fp32/fp16/bf16), so ``int64`` and FP4
have no entry there and none here (a lookup raises ``KeyError``, as in TE). This module
sits at TE's path so that TE code importing ``...pytorch.constants`` finds them here.
"""

from __future__ import annotations

import torch

from tp_fuse.quantization.te_dtype import DType

__all__ = ["DType", "TE_API_VERSION", "TE_DType", "TE_DType_To_Torch"]

#: The Transformer Engine API level tp_fuse's TE entry points implement (TE 2.11's
#: ``transformer_engine.pytorch`` names and signatures, with the refusals each class documents).
#: ``transformer_engine.__version__`` reports it where ``transformer_engine`` is mapped to tp_fuse
#: (:mod:`tp_fuse.te.te_alias`, ``tools/run_te_tests.py``): Megatron-Core 0.16 requires
#: ``>=2.9,<2.12`` and branches on it. Not tp_fuse's package version (``tp_fuse.__version__``).
TE_API_VERSION = "2.11.0"

# TE's table, entry for entry (transformer_engine/pytorch/constants.py).
TE_DType: dict[torch.dtype, DType] = {
    torch.uint8: DType.kByte,
    torch.float8_e4m3fn: DType.kFloat8E4M3,
    torch.float8_e5m2: DType.kFloat8E5M2,
    torch.int32: DType.kInt32,
    torch.float32: DType.kFloat32,
    torch.half: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
}

TE_DType_To_Torch: dict[DType, torch.dtype] = {value: key for key, value in TE_DType.items()}
