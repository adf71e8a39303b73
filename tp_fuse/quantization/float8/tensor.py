"""Float8Tensor: FP8 data plus a scale, posing as a high-precision tensor.

A :class:`Float8Tensor` holds

* ``_fp8``: a ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensor (the bytes),
* ``_sinv``: fp32 0-d tensor; the value represented is ``_fp8 * _sinv``,
* a nominal shape and a nominal high-precision ``dtype`` (e.g. float32), which is
  what ``.dtype`` reports and what unsupported ops compute in.

It is a ``torch.Tensor`` wrapper subclass, so it flows through autograd,
``nn.Sequential`` and ``nn.Parameter``. ``__torch_dispatch__`` handles natively
detach, clone, dtype/device conversion of FP8 parameters, and every view op
(view, transpose, select, slice, ...: the result is a Float8Tensor over the
same FP8 bytes and scale, so writes through it are not lost); every other op
dequantizes its Float8Tensor arguments and runs in high precision, returning
plain tensors (so printing, ``.sum()``, arithmetic and ``torch.zeros_like``
work).

In-place ops (``add_``, ``copy_``, ``torch._foreach_mul_``, ...) on a
Float8Tensor run in high precision and re-quantize into the same FP8 buffers:

* an FP8 *parameter* (made by :func:`~tp_fuse.quantization.make_fp8_parameter`)
  has a high-precision ``_master`` and a ``_quantizer``: the op updates the
  master, then the quantizer re-quantizes it (new scale). This is how
  ``torch.optim`` optimizers train FP8 weights: their in-place updates land on
  the master; the FP8 copy follows within FP8 error.
* any other Float8Tensor is re-quantized with its own current scale
  (saturating at the format's max), like TE's Float8Tensor.

The ``__torch_dispatch__`` handlers are in :mod:`.dispatch`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...kernels.fp8_emulation import decode_operand
from ..quantized_tensor import QuantizedTensor
from ..te_dtype import DType, as_torch_dtype, te_dtype_of
from .dispatch import FP8_DTYPES, dequantize, torch_dispatch

__all__ = ["Float8Tensor"]


class Float8Tensor(QuantizedTensor):
    """FP8 data with a per-tensor scale, behaving like a high-precision tensor.

    Args:
        data: FP8 tensor (``float8_e4m3fn`` or ``float8_e5m2``).
        scale_inv: fp32 one-element tensor; value = ``data * scale_inv``.
        dtype: nominal high-precision dtype reported by ``.dtype``.
        requires_grad: autograd flag of the wrapper.
        master: high-precision master copy (FP8 parameters only).
        quantizer: the quantizer ``quantize_`` (and, for FP8 parameters, in-place
            updates of ``master``) re-quantize with.

    Transformer Engine's keyword form is accepted too:
    ``Float8Tensor(shape=, dtype=, data=uint8 bytes, fp8_dtype=DType..., fp8_scale_inv=,
    data_transpose=, quantizer=, requires_grad=)``. The uint8 bytes are *viewed* as
    ``fp8_dtype`` (no copy).

    Transformer Engine's private attributes, which TE's tests and libraries built on TE
    read, have TE's types: ``_data`` the bytes as **uint8** ``[*shape]``, ``_scale_inv``
    a **one-element** ``[1]`` fp32 tensor, ``_transpose`` the transposed bytes as uint8 (or
    None when no transpose is cached). Each is a *view* of what this class computes with
    (``_fp8`` in the FP8 dtype, ``_sinv`` 0-d), so in-place writes through them (e.g.
    ``t._scale_inv.zero_()``) reach the tensor; assigning ``_data`` / ``_scale_inv``
    replaces the storage (uint8 bytes are viewed as :attr:`fp8_dtype`).
    """

    _fp8: torch.Tensor
    _sinv: torch.Tensor
    _master: Optional[torch.Tensor]
    _quantizer: Any
    _alias: "_AliasState"
    _transpose_cache: Optional[tuple[tuple[int, int], torch.Tensor]]
    # (the _fp8 it decodes, transpose_cache_key() then, dtype, values): see decoded().
    _decoded_cache: Optional[tuple[torch.Tensor, tuple[int, int], torch.dtype, torch.Tensor]] = None
    _keep_decoded: bool = False

    # Wrapper subclasses must not let the default __torch_function__ re-wrap
    # plain results as Float8Tensor (they would have no FP8 data).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        data: Optional[torch.Tensor] = None,
        scale_inv: Optional[torch.Tensor] = None,
        dtype: Optional[torch.dtype] = None,
        *,
        requires_grad: bool = False,
        master: Optional[torch.Tensor] = None,
        quantizer: Any = None,
        _alias: Optional["_AliasState"] = None,
        shape: Any = None,
        fp8_dtype: Any = None,
        fp8_scale_inv: Optional[torch.Tensor] = None,
        data_transpose: Optional[torch.Tensor] = None,
        device: Any = None,
    ) -> "Float8Tensor":
        if data is None:
            raise ValueError(
                "Float8Tensor data: expected the row-wise FP8 bytes (a tensor holding only data_transpose, "
                "as TE allows, is not supported)"
            )
        if fp8_scale_inv is not None:
            if scale_inv is not None:
                raise ValueError("Float8Tensor: expected scale_inv or fp8_scale_inv (TE's name), got both")
            scale_inv = fp8_scale_inv
        if scale_inv is None:
            raise ValueError("Float8Tensor scale_inv: expected a one-element fp32 tensor, got None")
        dtype = torch.float32 if dtype is None else dtype  # TE's default nominal dtype
        data = _as_fp8(data, fp8_dtype, "data")
        if shape is not None and tuple(torch.Size([shape] if isinstance(shape, int) else shape)) != tuple(data.shape):
            raise ValueError(f"Float8Tensor shape: expected the data's shape {tuple(data.shape)}, got {shape!r}")
        if device is not None and torch.device(device).type != data.device.type:
            raise ValueError(f"Float8Tensor device: expected the data's device {data.device}, got {device!r}")
        if scale_inv.device != data.device:
            # TE's tests pass a CPU scale with CUDA data; every op here reads both on one device.
            scale_inv = scale_inv.to(data.device)
        if data.dtype not in FP8_DTYPES:
            raise ValueError(f"Float8Tensor data: expected one of {FP8_DTYPES} (or uint8 with fp8_dtype=), got {data.dtype}")
        if scale_inv.numel() != 1 or scale_inv.dtype != torch.float32:
            raise ValueError(
                "Float8Tensor scale_inv: expected a one-element fp32 tensor, got "
                f"shape {tuple(scale_inv.shape)} dtype {scale_inv.dtype}"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in FP8_DTYPES:
            raise ValueError(f"Float8Tensor dtype: expected a high-precision float dtype, got {dtype}")
        if master is not None and (master.shape != data.shape or master.dtype != dtype):
            raise ValueError(
                f"Float8Tensor master: expected shape {tuple(data.shape)} dtype {dtype}, "
                f"got shape {tuple(master.shape)} dtype {master.dtype}"
            )
        self = cls.wrap_checked(data, scale_inv if scale_inv.dim() == 0 else scale_inv.reshape(()), dtype,
                                requires_grad=requires_grad)
        self._master = master
        self._quantizer = quantizer
        if _alias is not None:
            self._alias = _alias
        if data_transpose is not None:
            self._seed_transpose(_as_fp8(data_transpose, fp8_dtype, "data_transpose"))
        return self

    @classmethod
    def wrap_checked(
        cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, *, requires_grad: bool = False
    ) -> "Float8Tensor":
        """The constructor without its argument checks, for callers whose arguments are
        valid by construction (the quantizers' casts, transposed views of an existing
        Float8Tensor): ``data`` FP8 bytes, ``scale_inv`` a 0-d fp32 tensor on ``data``'s
        device, ``dtype`` a high-precision float dtype. Each FP8 GEMM operand is wrapped
        on the hot path; the checks cost about as much as the wrapping."""
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
            requires_grad=requires_grad,
        )
        self._fp8 = data
        self._sinv = scale_inv
        self._master = None
        self._quantizer = None
        self._alias = _AliasState()
        self._transpose_cache = None
        return self

    def _seed_transpose(self, data_t: torch.Tensor) -> None:
        """Use ``data_t`` (TE's ``data_transpose``: ``[shape[-1], prod(shape[:-1])]``) as the
        transpose cache; checked against the shape :meth:`transpose_data` would make."""
        rows = self._fp8.shape[:-1].numel() if self.dim() >= 1 else 1
        expected = (self._fp8.shape[-1], rows) if self.dim() >= 2 else None
        if expected is None or tuple(data_t.shape) != expected or data_t.dtype != self._fp8.dtype:
            raise ValueError(
                f"Float8Tensor data_transpose: expected {self._fp8.dtype} of shape {expected} (a tensor with "
                f">= 2 dims), got {data_t.dtype} of shape {tuple(data_t.shape)}"
            )
        key = self.transpose_cache_key()
        if key is not None:
            self._transpose_cache = (key, data_t.contiguous())

    @classmethod
    def from_parts(
        cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
    ) -> "Float8Tensor":
        """Re-wrap FP8 bytes and their scale, e.g. after moving ``_fp8`` through a
        collective (no master, no quantizer)."""
        return cls(data, scale_inv, dtype)

    # ------------------------------------------------------------------ access
    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 dtype of the stored data."""
        return self._fp8.dtype

    @property
    def _fp8_dtype(self) -> DType:
        """Transformer Engine's private name: :attr:`fp8_dtype` as a ``DType``."""
        return te_dtype_of(self._fp8.dtype)

    @property
    def _data(self) -> torch.Tensor:
        """TE's ``_data``: the FP8 bytes as uint8 (a view of ``_fp8``)."""
        return self._fp8.view(torch.uint8)

    @_data.setter
    def _data(self, value: torch.Tensor) -> None:
        value = _as_fp8(value, self._fp8.dtype, "_data")
        if value.shape != self._fp8.shape or value.dtype not in FP8_DTYPES:
            raise ValueError(f"Float8Tensor._data: expected uint8 or FP8 bytes of shape {tuple(self._fp8.shape)}, "
                             f"got {value.dtype} of shape {tuple(value.shape)}")
        self._fp8 = value
        self._transpose_cache = None

    @property
    def _scale_inv(self) -> torch.Tensor:
        """TE's ``_scale_inv``: the dequantization scale as a ``[1]`` fp32 view of ``_sinv``."""
        return self._sinv.view(1)

    @_scale_inv.setter
    def _scale_inv(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.dtype != torch.float32:
            raise ValueError(f"Float8Tensor._scale_inv: expected a one-element fp32 tensor, got {value!r}")
        self._sinv = value.to(self._fp8.device).reshape(())

    @property
    def _transpose(self) -> Optional[torch.Tensor]:
        """TE's ``_transpose``: the cached transposed bytes as uint8 in TE's shape
        ``[shape[-1], *shape[:-1]]`` (our cache holds the same bytes as ``[shape[-1], rows]``),
        or None (none cached, or stale after a write)."""
        cache, key = self._transpose_cache, self.transpose_cache_key()
        if cache is None or key is None or cache[0] != key:
            return None
        te_shape = (self.shape[-1], *self.shape[:-1]) if self.dim() else ()
        return cache[1].view(torch.uint8).view(te_shape)

    @property
    def master(self) -> Optional[torch.Tensor]:
        """High-precision master copy (FP8 parameters), else None."""
        return self._master

    @property
    def quantizer(self) -> Any:
        """Quantizer that re-quantizes the master (FP8 parameters), else None."""
        return self._quantizer

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """TE's ``update_usage``: ``columnwise_usage=True`` makes the transposed bytes now
        (cached, :meth:`transpose_data`), ``False`` drops them. The row-wise bytes are this
        tensor's storage and stay (TE frees them on ``rowwise_usage=False``; the values are
        the same either way)."""
        if columnwise_usage and self.dim() >= 2:
            self.transpose_data()
        elif columnwise_usage is False:
            self._transpose_cache = None

    def _dequantize_plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``data * scale_inv`` (``dequantize``)."""
        return dequantize(self, dtype)

    def transpose_data(self) -> torch.Tensor:
        """Contiguous FP8 transpose of the 2-D view ``[prod(shape[:-1]), shape[-1]]``.

        Cached: wgrad GEMMs need the column-wise layout of inputs and grads, and
        the same tensor is often transposed once per backward. In-place updates
        through this tensor or any alias (detach/view) invalidate the cache; so
        does writing ``_fp8`` directly.
        """
        if self.dim() < 2:
            raise ValueError(f"transpose_data: expected a tensor with >= 2 dims, got {self.dim()}")
        key = self.transpose_cache_key()
        if key is None or self._transpose_cache is None or self._transpose_cache[0] != key:
            flat = self._fp8.reshape(-1, self._fp8.shape[-1])
            transposed = flat.t().contiguous()
            if key is None:
                return transposed
            self._transpose_cache = (key, transposed)
        return self._transpose_cache[1]

    def transpose_cache_key(self) -> Optional[tuple[int, int]]:
        """What a cached transpose is valid for, or None when it cannot be cached.

        Writes made inside __torch_dispatch__ run below the ADInplaceOrView key and do
        not bump _fp8's version counter, hence the alias generation as well. Inference
        tensors (made under ``torch.inference_mode``) have no version counter: their
        transpose is recomputed on every call rather than cached unchecked.
        """
        if self._fp8.is_inference():
            return None
        return (self._alias.generation, self._fp8._version)

    def transpose_fp8(self) -> "Float8Tensor":
        """:meth:`transpose_data` as a Float8Tensor (same scale), e.g. for
        ``fp8_gemm`` in wgrad: ``dW = fp8_gemm(dy.transpose_fp8(), x.transpose_fp8())``."""
        return Float8Tensor.wrap_checked(self.transpose_data(), self._sinv, self.dtype)

    def transposed_view(self) -> "Float8Tensor":
        """The transpose of the 2-D view ``[prod(shape[:-1]), shape[-1]]`` as a column-major
        *view* of this tensor's bytes (same scale), for GEMMs that read any layout
        (``kernels.fp8_gemm_reads_views``): no copy, where :meth:`transpose_fp8` makes
        the K-major bytes a GPU GEMM needs. An alias: writes through either invalidate
        both's caches; a kept :meth:`decoded` result is shared (transposed)."""
        if self.dim() < 2:
            raise ValueError(f"transposed_view: expected a tensor with >= 2 dims, got {self.dim()}")
        data = self._fp8 if self._fp8.dim() == 2 else self._fp8.reshape(-1, self._fp8.shape[-1])
        view = Float8Tensor.wrap_checked(data.t(), self._sinv, self.dtype)
        view._alias = self._alias
        kept = self._valid_decoded()
        if kept is not None:
            kept2d = kept if kept.dim() == 2 else kept.reshape(-1, kept.shape[-1])
            view._keep_decoded = True
            view._decoded_cache = (view._fp8, view.transpose_cache_key(), kept.dtype, kept2d.t())
        return view

    def decoded(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The bytes' values, unscaled, in ``dtype`` (fp32, or float64 for float64 GEMM
        outputs): the CPU emulated GEMM's operand (``fp8_emulation.decode_operand``, exact,
        in ``_fp8``'s layout). After :meth:`keep_decoded` the result is kept for later
        calls until a write changes the bytes."""
        kept = self._valid_decoded()
        if kept is not None and kept.dtype == dtype:
            return kept
        out = decode_operand(self._fp8, dtype)
        if self._keep_decoded:
            key = self.transpose_cache_key()
            if key is not None:
                self._decoded_cache = (self._fp8, key, dtype, out)
        return out

    def keep_decoded(self) -> None:
        """Keep :meth:`decoded`'s result for later GEMMs: a weight is read by its fprop and
        dgrad GEMMs, and decoding FP8 costs more than the GEMM at small sizes. Holds 4
        (fp32) bytes per element while this tensor lives."""
        self._keep_decoded = True

    def _valid_decoded(self) -> Optional[torch.Tensor]:
        cache = self._decoded_cache
        if cache is None or cache[0] is not self._fp8:  # ``_data`` assigned: other bytes
            return None
        key = self.transpose_cache_key()
        return cache[3] if key is not None and cache[1] == key else None

    # Makes this a "traceable" wrapper subclass: nn.Module._apply (module.to(),
    # .double(), .cuda()) then swaps FP8 parameters as a whole instead of
    # overwriting the wrapper's metadata through ``param.data = ...``.
    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, Any]]:
        names = ["_fp8", "_sinv"] + (["_master"] if self._master is not None else [])
        return names, (self.dtype, self._quantizer)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: tuple[torch.dtype, Any], outer_size: Any, outer_stride: Any
    ) -> "Float8Tensor":
        dtype, quantizer = ctx
        return Float8Tensor(
            inner["_fp8"], inner["_sinv"], dtype, master=inner.get("_master"), quantizer=quantizer
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return (
            f"Float8Tensor(fp8_dtype={self.fp8_dtype}, scale_inv={self._sinv.item():.6g}, "
            f"dtype={self.dtype}, data={dequantize(self)!r})"
        )

    # ---------------------------------------------------------------- dispatch
    # The aten op handlers live in dispatch.py (this class's views, in-place ops, conversions).
    __torch_dispatch__ = classmethod(torch_dispatch)

    # -------------------------------------------------------- re-quantization
    def _requantize_from(self, value: torch.Tensor, overwrite: bool = False) -> None:
        """Overwrite the FP8 buffers in place from high-precision ``value``.

        In place (``copy_``) so that every alias made by detach/view -- e.g. the
        tensor ``nn.Parameter`` returned and the one a module registered -- sees
        the new bytes and scale.

        ``overwrite``: the op replaced the whole value (``copy_``, ``fill_``,
        ``zero_``: loading a checkpoint). A delayed-scaling quantizer's scale was
        derived from the old values and may clip the new ones: the quantizer first
        re-derives it if it would (``rescale_to_fit``).
        """
        self._alias.generation += 1
        if self._quantizer is not None:
            rescale = getattr(self._quantizer, "rescale_to_fit", None)
            if overwrite and rescale is not None:
                rescale(value.detach())
            q = self._quantizer.quantize(value.detach())
            self._fp8.copy_(q._fp8)
            self._sinv.copy_(q._sinv)
            return
        fp8_max = float(torch.finfo(self.fp8_dtype).max)
        scaled = value.detach().to(torch.float32) / self._sinv
        self._fp8.copy_(scaled.clamp(-fp8_max, fp8_max).to(self.fp8_dtype))


def _as_fp8(data: torch.Tensor, fp8_dtype: Any, what: str) -> torch.Tensor:
    """``data`` as an FP8 tensor: TE's uint8 bytes are viewed (no copy, bit-exact) as
    ``fp8_dtype`` (a ``DType`` or torch FP8 dtype), which they then require."""
    want = None if fp8_dtype is None else as_torch_dtype(fp8_dtype, "Float8Tensor fp8_dtype")
    if want is not None and want not in FP8_DTYPES:
        raise ValueError(f"Float8Tensor fp8_dtype: expected one of {FP8_DTYPES}, got {fp8_dtype!r}")
    if data.dtype == torch.uint8:
        if want is None:
            raise ValueError(f"Float8Tensor {what}: uint8 bytes (TE's storage) need fp8_dtype= to say their format")
        return data.view(want)
    if want is not None and data.dtype != want:
        raise ValueError(f"Float8Tensor {what}: dtype {data.dtype} does not match fp8_dtype {want}")
    return data


class _AliasState:
    """Shared by Float8Tensors over the same FP8 bytes (detach/view/transpose):
    a generation bumped on every in-place re-quantization, for caches."""

    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0
