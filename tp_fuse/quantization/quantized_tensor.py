"""``QuantizedTensor``: the common base of low-precision tensors (Transformer Engine's name).

``isinstance(t, QuantizedTensor)`` is how user code asks "is this tensor quantized?"
without naming a format. :class:`~tp_fuse.quantization.Float8Tensor` and the block-scaled
:class:`~tp_fuse.quantization.BlockScaledTensor` (MXFP8, blockwise, NVFP4) derive from it;
the class itself holds no data and is never instantiated.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

__all__ = ["QuantizedTensor", "write_back_in_place"]


class QuantizedTensor(torch.Tensor):
    """Base class of tensors stored in a low-precision format with scales.

    Subclasses are ``torch.Tensor`` wrapper subclasses that report a nominal
    high-precision ``dtype`` and provide ``dequantize(dtype=None)``.
    """

    def dequantize(self, dtype: "torch.dtype | None" = None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize")


def write_back_in_place(
    func: Any,
    args: tuple,
    kwargs: dict,
    tensor_type: type,
    work_copy: Callable[[Any], torch.Tensor],
    requantize: Callable[[Any, torch.Tensor], None],
    unwrap: Callable[[Any], Any],
) -> Any:
    """Run an in-place / ``out=`` aten op whose written operands are quantized tensors.

    Each written ``tensor_type`` operand (an argument the op's schema marks as written) is
    replaced by ``work_copy(t)``, a high-precision tensor (its master copy, or a dequantized
    copy); the remaining quantized operands are read through ``unwrap``. After the op,
    ``requantize(t, work)`` writes each written tensor's new value back into its own format,
    and the results that alias a work copy are handed back as the quantized tensor itself
    (in-place ops return their first argument). Shared by Float8Tensor and
    BlockScaledTensor's ``__torch_dispatch__``; each says how to make and store a work copy.
    """
    written: dict[int, tuple[Any, torch.Tensor]] = {}

    def replace_written(x: Any) -> Any:
        if isinstance(x, tensor_type):
            if id(x) not in written:
                written[id(x)] = (x, work_copy(x))
            return written[id(x)][1]
        if isinstance(x, (list, tuple)):
            return type(x)(replace_written(e) for e in x)
        return x

    new_args, new_kwargs = list(args), dict(kwargs)
    for i, schema_arg in enumerate(func._schema.arguments):
        if not (schema_arg.alias_info is not None and schema_arg.alias_info.is_write):
            continue
        if schema_arg.kwarg_only or i >= len(args):
            if schema_arg.name in new_kwargs:
                new_kwargs[schema_arg.name] = replace_written(new_kwargs[schema_arg.name])
        else:
            new_args[i] = replace_written(new_args[i])
    # Remaining (read-only) quantized operands run in high precision.
    new_args, new_kwargs = tree_map(unwrap, (new_args, new_kwargs))
    out = func(*new_args, **new_kwargs)
    with torch.no_grad():
        for t, work in written.values():
            requantize(t, work)
    by_work = {id(work): t for t, work in written.values()}
    return tree_map(lambda x: by_work.get(id(x), x), out)
