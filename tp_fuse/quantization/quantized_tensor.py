"""``QuantizedTensor``: the common base of low-precision tensors (Transformer Engine's name).

``isinstance(t, QuantizedTensor)`` is how user code asks "is this tensor quantized?"
without naming a format. :class:`~tp_fuse.quantization.Float8Tensor` and the block-scaled
:class:`~tp_fuse.quantization.BlockScaledTensor` (MXFP8, blockwise, NVFP4) derive from it;
the class itself holds no data and is never instantiated.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_map

__all__ = ["QuantizedTensor", "write_back_in_place"]


class QuantizedTensor(torch.Tensor):
    """Base class of tensors stored in a low-precision format with scales.

    Subclasses are ``torch.Tensor`` wrapper subclasses that report a nominal
    high-precision ``dtype`` and provide ``dequantize(dtype=None)``, ``update_usage`` and
    the ``_quantizer`` (None, or the quantizer that made the tensor) and ``_master``
    (FP8 parameters' high-precision copy, else None) attributes :meth:`quantize_` uses.
    """

    _quantizer: Any
    _master: Optional[torch.Tensor]

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Plain high-precision tensor in ``dtype`` (default: the nominal dtype).

        Differentiable (identity backward, :class:`_Dequantize`) when this tensor requires grad.
        """
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self, dtype)
        return self._dequantize_plain(dtype)

    def _dequantize_plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:  # pragma: no cover - abstract
        """The value as a plain tensor, outside autograd (each format's arithmetic)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _dequantize_plain")

    def update_usage(
        self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None
    ) -> None:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement update_usage")

    def quantize_(self, tensor: torch.Tensor, *, noop_flag: Optional[torch.Tensor] = None) -> "QuantizedTensor":
        """Quantize ``tensor`` into this tensor's buffers with its quantizer (TE's
        ``QuantizedTensor.quantize_``); returns ``self``.

        A quantized ``tensor`` is dequantized first. ``noop_flag`` (one-element tensor):
        nonzero skips the update, as in TE. FP8 parameters take the ``copy_`` path (their
        master copy is updated, then re-quantized); other tensors
        ``self._quantizer.update_quantized(tensor, self)``. Raises ValueError when this
        tensor has no quantizer (TE builds a default one from the tensor's own scales; here
        a tensor not made by a quantizer has none).
        """
        who = f"{type(self).__name__}.quantize_"
        if self._quantizer is None:
            raise ValueError(
                f"{who}: this tensor has no quantizer (make it with a quantizer, e.g. quantizer(x) or "
                "quantizer.make_empty(shape))"
            )
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
            return self
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        if tuple(tensor.shape) != tuple(self.shape):
            raise ValueError(f"{who}: expected a tensor of shape {tuple(self.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            if self._master is not None:
                self.copy_(tensor)
            else:
                self._quantizer.update_quantized(tensor, self)
        return self


class _Dequantize(torch.autograd.Function):
    """QuantizedTensor -> plain high-precision tensor, differentiable.

    ======== ============================== ======================
             forward                        backward
    ======== ============================== ======================
    in       x: QuantizedTensor [*]         grad_out: [*] (dtype)
    out      y = data * scale_inv (per      grad_x = grad_out
             tensor or per block)
    ======== ============================== ======================

    The backward is the identity (straight-through): dequantization is the
    representation of x, not a function of it. One function for every format: the
    format's arithmetic is its ``_dequantize_plain``.
    """

    @staticmethod
    def forward(ctx: Any, x: QuantizedTensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        ctx.nominal_dtype = x.dtype
        return x._dequantize_plain(dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_out.to(ctx.nominal_dtype), None


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
