"""How aten ops run on a :class:`~tp_fuse.quantization.float8.tensor.Float8Tensor`.

:func:`torch_dispatch` is ``Float8Tensor.__torch_dispatch__``. It handles natively
detach, clone, dtype/device conversion of FP8 parameters and every view op (the result
is a Float8Tensor over the same FP8 bytes and scale, so writes through it are not lost);
in-place ops run in high precision and re-quantize into the same FP8 buffers; every other
op dequantizes its Float8Tensor arguments and returns plain tensors.

This module sits below ``tensor.py`` (which imports :func:`torch_dispatch` into the class),
so it never names the class: each handler receives it as ``cls``, the class whose
``__torch_dispatch__`` runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from ...kernels.fp8_emulation import fp8_to_float
from ..quantized_tensor import write_back_in_place

__all__ = ["FP8_DTYPES", "dequantize", "torch_dispatch"]

aten = torch.ops.aten

#: The FP8 storage dtypes a Float8Tensor's bytes may have.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize(t: Any, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A Float8Tensor's ``_fp8 * _sinv`` as a plain tensor in ``dtype`` (default: its
    nominal dtype), outside autograd."""
    out = fp8_to_float(t._fp8) * t._sinv
    return out.to(dtype or t.dtype)


def torch_dispatch(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """``Float8Tensor.__torch_dispatch__`` (bound as a classmethod: ``cls`` is the class)."""
    kwargs = kwargs or {}
    if torch.is_inference_mode_enabled() and any(
        isinstance(a, cls) and not a.is_inference() for a in args
    ) and (func in _ALIASING or _is_view_of_first_arg(cls, func, args)):
        # A view/detach of a normal tensor must share its version counter, which
        # autograd cannot set on an inference tensor: build the result as a normal
        # tensor, as a view of a normal tensor in inference mode is.
        with torch.inference_mode(False):
            return cls.__torch_dispatch__(func, types, args, kwargs)
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(cls, *args, **kwargs)
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return _inplace(cls, func, args, kwargs)
    if _is_view_of_first_arg(cls, func, args):
        return _fp8_view(cls, func, args, kwargs)
    # Fallback: run in high precision.
    args, kwargs = tree_map(lambda x: dequantize(x) if isinstance(x, cls) else x, (args, kwargs))
    return func(*args, **kwargs)


def _inplace(cls: type, func: Any, args: tuple, kwargs: dict, overwrite: bool = False) -> Any:
    """In-place/out= op with Float8Tensor operands being written.

    Written Float8Tensors are replaced by a high-precision working tensor (the
    master when there is one, else a dequantized copy), the op runs, then the
    FP8 buffers are re-quantized from the working tensor.
    """
    return write_back_in_place(
        func, args, kwargs, cls,
        work_copy=lambda t: t._master if t._master is not None else dequantize(t),
        requantize=lambda t, hp: t._requantize_from(hp, overwrite),
        unwrap=lambda x: dequantize(x) if isinstance(x, cls) else x,
    )


def _detach(cls: type, self: Any) -> Any:
    # Keeps master and quantizer: nn.Parameter(float8_tensor) is built by detach().
    return cls(
        self._fp8.detach(),
        self._sinv,
        self.dtype,
        master=self._master,
        quantizer=self._quantizer,
        _alias=self._alias,
    )


def _is_view_of_first_arg(cls: type, func: Any, args: tuple) -> bool:
    """Whether ``func`` returns views of its Float8Tensor first argument only."""
    returns = func._schema.returns
    return (
        bool(args)
        and isinstance(args[0], cls)
        and len(returns) > 0
        and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        and not any(isinstance(a, cls) for a in args[1:])
    )


def _fp8_view(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """Apply a view op to the FP8 bytes; the results share bytes, scale, alias state.

    Views are metadata-only, so they are exact on FP8 data, and aliasing is
    preserved: ``f[0].zero_()`` writes into ``f``'s bytes, as on a plain tensor.
    """
    self = args[0]
    out = func(self._fp8, *args[1:], **kwargs)

    def wrap(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return cls(t, self._sinv, self.dtype, _alias=self._alias)
        return t

    return tree_map(wrap, out)


def _view(cls: type, self: Any, size: Any) -> Any:
    # _unsafe_view is not declared as aliasing but is a view of contiguous data.
    return cls(self._fp8.view(size), self._sinv, self.dtype, _alias=self._alias)


def _clone(cls: type, self: Any, *, memory_format: Any = None) -> Any:
    data = self._fp8.clone() if memory_format is None else self._fp8.clone(memory_format=memory_format)
    return cls(data, self._sinv.clone(), self.dtype)


def _copy_(cls: type, self: Any, src: Any, non_blocking: bool = False) -> Any:
    # load_state_dict copies FP8 parameter into FP8 parameter: take the source's
    # master, not its FP8 rounding, so a save/load round trip is lossless.
    if isinstance(src, cls) and src._master is not None:
        src = src._master
    return _inplace(cls, aten.copy_.default, (self, src), {"non_blocking": non_blocking}, overwrite=True)


def _overwrite(func: Any) -> Any:
    """Handler for ops that replace the whole value (``fill_``, ``zero_``): the
    written FP8 parameter's scale is derived again from its new value."""

    def handler(cls: type, *args: Any, **kwargs: Any) -> Any:
        return _inplace(cls, func, args, kwargs, overwrite=True)

    return handler


def _to_copy(cls: type, self: Any, **kwargs: Any) -> torch.Tensor:
    # An FP8 parameter stays FP8 through dtype/device conversion (module.to(),
    # .double()): the nominal dtype and the master follow, the bytes only move.
    # Any other Float8Tensor converts like an unsupported op: to a plain tensor.
    if self._master is None or kwargs.get("layout") not in (None, torch.strided):
        return aten._to_copy.default(dequantize(self), **kwargs)
    dtype = kwargs.get("dtype") or self.dtype
    device = kwargs.get("device") or self.device
    if not dtype.is_floating_point or dtype in FP8_DTYPES:
        raise ValueError(
            f"FP8 parameter conversion: expected a high-precision float dtype, got {dtype}"
        )
    return cls(
        self._fp8.to(device),
        self._sinv.to(device),
        dtype,
        master=self._master.to(device=device, dtype=dtype),
        quantizer=self._quantizer,
    )


_ALIASING = (aten.detach.default, aten._unsafe_view.default)

_HANDLERS = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.detach.default: _detach,
    aten._unsafe_view.default: _view,
    aten.clone.default: _clone,
    aten.fill_.Scalar: _overwrite(aten.fill_.Scalar),
    aten.fill_.Tensor: _overwrite(aten.fill_.Tensor),
    aten.zero_.default: _overwrite(aten.zero_.default),
}
