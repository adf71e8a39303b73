"""BlockScaledTensor: FP8 data with per-block scales, in one or both GEMM layouts.

A :class:`BlockScaledTensor` of nominal shape ``[*, C]`` (flattened to ``[R, C]``) holds

* ``_rowwise``: a :class:`BlockPayload` -- ``data [R, C]`` (FP8) and ``scale_inv``
  (one per block of ``spec``) -- the layout a GEMM reads when the tensor is its
  left operand or its ``[N, K]`` right operand (``y = x @ W.T``);
* ``_columnwise``: a :class:`BlockPayload` of the transpose, ``data [C, R]``, quantized
  from high precision in the same pass, for GEMMs that read the tensor transposed
  (dgrad reads ``W.T``, wgrad reads ``dy.T`` and ``x.T``).

NVFP4 payloads hold FP4 E2M1 data packed two values per byte (``[R, C/2]``), E4M3 block
scales and the per-tensor amax (see :class:`BlockPayload`); the rest of this class is the
same for them. Either may be None (a forward-only tensor has no column-wise copy). Block scales are
not transposition-invariant (a 1x128 block of ``x`` is not a 1x128 block of ``x.T``),
which is why the transpose is quantized from high precision rather than from the
row-wise bytes. :meth:`transpose_fp8` swaps the two copies (no arithmetic).

Like :class:`~tp_fuse.quantization.Float8Tensor` it is a ``torch.Tensor`` wrapper
subclass: detach, views that keep the last dimension (``view``/``reshape`` of the
leading dimensions), clone and FP8-parameter ``.to()`` are handled natively; every other
op dequantizes and runs in high precision. In-place ops on an FP8 *parameter*
(``quantized_model_init``) update its high-precision ``_master`` and re-quantize both
copies with its ``_quantizer`` -- the optimizer path of Float8Tensor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from ...recipe import FP4_DTYPE
from .scaling import BlockSpec, dequantize_blocks
from ..nvfp4.scaling import dequantize_nvfp4
from ..quantized_tensor import QuantizedTensor, write_back_in_place
from ..te_dtype import DType, te_dtype_of

__all__ = ["BlockPayload", "BlockScaledTensor", "Float8BlockwiseQTensor", "MXFP8Tensor", "NVFP4Tensor", "flat_2d"]

aten = torch.ops.aten


def flat_2d(shape: Any) -> tuple[int, int]:
    """``(R, C)`` = ``(prod(shape[:-1]), shape[-1])``, the 2-D view block payloads hold; a
    0-d tensor is ``(1, 1)`` (its one value), as in Transformer Engine."""
    shape = tuple(shape)
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


@dataclasses.dataclass
class BlockPayload:
    """One quantized layout: 2-D FP8 ``data``, its ``scale_inv`` per block of ``spec``.

    NVFP4 (``data`` of dtype ``torch.float4_e2m1fn_x2``, two values per byte): ``data`` is
    ``[R, C/2]``, ``scale_inv`` the E4M3 block scales and ``amax`` the fp32 per-tensor amax
    (0-d) that sets the second-level scale (``nvfp4_scaling``); ``e4m3_max`` the bound in
    that scale ``amax / (6 * e4m3_max)`` (448; 256 for 4over6 tensors, ``nvfp4_4over6``).
    :attr:`shape` is the logical ``[R, C]`` either way.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    spec: BlockSpec
    amax: Optional[torch.Tensor] = None
    e4m3_max: float = 448.0

    @property
    def is_fp4(self) -> bool:
        return self.data.dtype == FP4_DTYPE

    @property
    def shape(self) -> tuple[int, int]:
        r, c = self.data.shape
        return (r, c * 2) if self.is_fp4 else (r, c)

    def dequantize(self) -> torch.Tensor:
        if self.is_fp4:
            assert self.amax is not None
            return dequantize_nvfp4(self.data, self.scale_inv, self.spec, self.amax, self.e4m3_max)
        return dequantize_blocks(self.data, self.scale_inv, self.spec)

    def map(self, fn: Any) -> "BlockPayload":
        return BlockPayload(fn(self.data), fn(self.scale_inv), self.spec, None if self.amax is None else fn(self.amax),
                            self.e4m3_max)


class BlockScaledTensor(QuantizedTensor):
    """FP8 data with block scales, posing as a high-precision tensor.

    Args:
        shape: nominal shape ``[*, C]``; payloads are 2-D over ``[prod(*), C]``.
        dtype: nominal high-precision dtype.
        rowwise: :class:`BlockPayload` of ``[R, C]`` or None.
        columnwise: :class:`BlockPayload` of ``[C, R]`` or None (at least one is given).
        recipe_name: short name of the producing recipe (for messages and stats).
        master / quantizer: FP8 parameters only (see module docstring).
    """

    _rowwise: Optional[BlockPayload]
    _columnwise: Optional[BlockPayload]
    _master: Optional[torch.Tensor]
    _quantizer: Any
    recipe_name: str

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        shape: Any,
        dtype: torch.dtype,
        rowwise: Optional[BlockPayload],
        columnwise: Optional[BlockPayload],
        recipe_name: str,
        *,
        requires_grad: bool = False,
        master: Optional[torch.Tensor] = None,
        quantizer: Any = None,
    ) -> "BlockScaledTensor":
        shape = torch.Size(shape)
        if rowwise is None and columnwise is None:
            raise ValueError("BlockScaledTensor: expected a row-wise or a column-wise payload, got neither")
        rows, cols = flat_2d(shape)
        ref = rowwise if rowwise is not None else columnwise
        assert ref is not None
        if rowwise is not None and tuple(rowwise.shape) != (rows, cols):
            raise ValueError(
                f"BlockScaledTensor: row-wise data shape {tuple(rowwise.shape)} does not match "
                f"nominal shape {tuple(shape)} (expected {(rows, cols)})"
            )
        if columnwise is not None and tuple(columnwise.shape) != (cols, rows):
            raise ValueError(
                f"BlockScaledTensor: column-wise data shape {tuple(columnwise.shape)} does not match "
                f"nominal shape {tuple(shape)} (expected {(cols, rows)})"
            )
        if master is not None and (master.shape != shape or master.dtype != dtype):
            raise ValueError(
                f"BlockScaledTensor master: expected shape {tuple(shape)} dtype {dtype}, "
                f"got shape {tuple(master.shape)} dtype {master.dtype}"
            )
        if cls is BlockScaledTensor:
            # Every constructor call (quantizers, views, transposes, unflatten) gets
            # Transformer Engine's class for the recipe, so isinstance checks hold.
            cls = _TE_CLASS_BY_RECIPE.get(recipe_name, BlockScaledTensor)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=ref.data.device, requires_grad=requires_grad
        )
        self._rowwise = rowwise
        self._columnwise = columnwise
        self._master = master
        self._quantizer = quantizer
        self.recipe_name = recipe_name
        return self

    # ------------------------------------------------------------------ access
    @property
    def fp8_dtype(self) -> torch.dtype:
        ref = self._rowwise if self._rowwise is not None else self._columnwise
        assert ref is not None
        return ref.data.dtype

    @property
    def master(self) -> Optional[torch.Tensor]:
        return self._master

    @property
    def quantizer(self) -> Any:
        return self._quantizer

    def payload(self, which: str) -> BlockPayload:
        """The ``"rowwise"`` or ``"columnwise"`` payload; ValueError when it was not made."""
        p = self._rowwise if which == "rowwise" else self._columnwise
        if p is None:
            raise ValueError(
                f"BlockScaledTensor ({self.recipe_name}): the {which} copy was not quantized "
                "(of a transpose_fp8() view: the original's other copy; quantize with transpose=True "
                "when a backward GEMM reads the tensor transposed); "
                "re-quantizing from the other copy would quantize twice"
            )
        return p

    def _dequantize_plain(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """From the row-wise copy, else the transposed column-wise copy (``dequantize``)."""
        return _dequantize_impl(self, dtype)

    def transpose_fp8(self) -> "BlockScaledTensor":
        """The 2-D transpose ``[C, R]``: the column-wise copy becomes the row-wise one."""
        rows, cols = flat_2d(self.shape)
        return BlockScaledTensor((cols, rows), self.dtype, self._columnwise, self._rowwise, self.recipe_name)

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """TE's ``update_usage``: ``False`` drops that copy (in place, for this tensor
        object); ``True`` requires it. A missing copy is not made from the other (block
        scales are not transposition-invariant: it would quantize twice; TE raises too), and
        dropping both would leave no data: both raise ValueError."""
        keep_row = self._rowwise is not None if rowwise_usage is None else bool(rowwise_usage)
        keep_col = self._columnwise is not None if columnwise_usage is None else bool(columnwise_usage)
        for which, want in (("rowwise", keep_row), ("columnwise", keep_col)):
            if want and getattr(self, "_" + which) is None:
                raise ValueError(
                    f"{type(self).__name__}.update_usage: {which}_usage=True, but this tensor has no {which} copy "
                    "(quantize with that usage set; it is not derived from the other copy)"
                )
        if not (keep_row or keep_col):
            raise ValueError(f"{type(self).__name__}.update_usage: expected at least one usage kept, got neither")
        self._rowwise = self._rowwise if keep_row else None
        self._columnwise = self._columnwise if keep_col else None

    def rowwise_only(self) -> "BlockScaledTensor":
        """The same tensor without its column-wise copy (what an fprop GEMM needs)."""
        return BlockScaledTensor(self.shape, self.dtype, self.payload("rowwise"), None, self.recipe_name)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        names = []
        for which in ("_rowwise", "_columnwise"):
            p = getattr(self, which)
            if p is not None:
                names += [f"{which}_data", f"{which}_scale_inv"] + ([f"{which}_amax"] if p.amax is not None else [])
        if self._master is not None:
            names.append("_master")
        specs = tuple(getattr(self, w).spec if getattr(self, w) is not None else None for w in ("_rowwise", "_columnwise"))
        maxes = tuple(getattr(self, w).e4m3_max if getattr(self, w) is not None else None
                      for w in ("_rowwise", "_columnwise"))
        return names, (self.shape, self.dtype, specs, self.recipe_name, self._quantizer, maxes)

    def __getattr__(self, name: str) -> Any:
        # Flattened attribute names for __tensor_flatten__ (e.g. "_rowwise_data"), which are
        # also TE's attribute names: None for a copy the tensor does not hold, as in TE.
        for which in ("_rowwise", "_columnwise"):
            for part in ("data", "scale_inv", "amax"):
                if name == f"{which}_{part}":
                    payload = self.__dict__.get(which)
                    return None if payload is None else getattr(payload, part)
        raise AttributeError(name)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size: Any, outer_stride: Any) -> "BlockScaledTensor":
        shape, dtype, specs, name, quantizer, maxes = ctx
        payloads = []
        for which, spec, m in zip(("_rowwise", "_columnwise"), specs, maxes):
            payloads.append(None if spec is None else BlockPayload(
                inner[f"{which}_data"], inner[f"{which}_scale_inv"], spec, inner.get(f"{which}_amax"), m))
        return BlockScaledTensor(shape, dtype, *payloads, name, master=inner.get("_master"), quantizer=quantizer)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        parts = [f"{w}={getattr(self, '_' + w).spec.describe()}" for w in ("rowwise", "columnwise")
                 if getattr(self, "_" + w) is not None]
        return (f"{type(self).__name__}({self.recipe_name}, fp8_dtype={self.fp8_dtype}, {', '.join(parts)}, "
                f"dtype={self.dtype}, data={_dequantize_impl(self)!r})")

    # ---------------------------------------------------------------- dispatch
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_inference_mode_enabled() and _aliases_normal_block_tensor(func, args):
            # A view/detach of a normal tensor must share its version counter, which
            # autograd cannot set on an inference tensor (e.g. reading an FP8 weight
            # under torch.inference_mode): build the result as a normal tensor, as a
            # view of a normal tensor in inference mode is (same as Float8Tensor).
            with torch.inference_mode(False):
                return cls.__torch_dispatch__(func, types, args, kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            return _inplace(func, args, kwargs)
        args, kwargs = tree_map(_unwrap, (args, kwargs))
        return func(*args, **kwargs)

    def _requantize_from(self, value: torch.Tensor) -> None:
        """Overwrite both copies in place from high-precision ``value`` (needs a quantizer)."""
        if self._quantizer is None:
            raise ValueError(
                "BlockScaledTensor: in-place update of a tensor without a quantizer (only FP8 "
                "parameters made by quantized_model_init can be updated in place)"
            )
        copy_payloads(self, self._quantizer.quantize(value.detach(), transpose=self._columnwise is not None))


def copy_payloads(dst: BlockScaledTensor, src: BlockScaledTensor) -> None:
    """Copy ``src``'s bytes, scales and amaxes into ``dst``'s existing copies, in place
    (so aliases made by detach/view see them); ``src`` must hold each copy ``dst`` has."""
    for which in ("_rowwise", "_columnwise"):
        mine, new = getattr(dst, which), getattr(src, which)
        if mine is None:
            continue
        if new is None or new.spec != mine.spec or tuple(new.scale_inv.shape) != tuple(mine.scale_inv.shape):
            raise ValueError(
                f"{type(dst).__name__}: cannot store the {which[1:]} copy of a {type(src).__name__} "
                f"({'missing' if new is None else new.spec.describe()}) in one of blocks {mine.spec.describe()}"
            )
        mine.data.copy_(new.data)
        mine.scale_inv.copy_(new.scale_inv)
        if mine.amax is not None:
            mine.amax.copy_(new.amax)
        mine.e4m3_max = new.e4m3_max


class MXFP8Tensor(BlockScaledTensor):
    """Transformer Engine's name for an MXFP8 :class:`BlockScaledTensor` (1x32 blocks,
    E8M0 scales); what ``MXFP8Quantizer`` / the ``MXFP8BlockScaling`` recipe produce."""

    @property
    def _fp8_dtype(self) -> DType:
        """Transformer Engine's private name: the FP8 dtype of the data as a ``DType``."""
        return te_dtype_of(self.fp8_dtype)


class Float8BlockwiseQTensor(BlockScaledTensor):
    """Transformer Engine's name for a ``Float8BlockScaling`` :class:`BlockScaledTensor`
    (1x128 activation / gradient blocks, 128x128 weight blocks, fp32 scales)."""

    @property
    def _fp8_dtype(self) -> DType:
        """Transformer Engine's private name: the FP8 dtype of the data as a ``DType``."""
        return te_dtype_of(self.fp8_dtype)


class NVFP4Tensor(BlockScaledTensor):
    """Transformer Engine's name for an NVFP4 :class:`BlockScaledTensor` (E2M1 data, 1x16
    or 16x16 E4M3 block scales, a per-tensor fp32 amax per copy)."""

    @property
    def _fp4_dtype(self) -> DType:
        """Transformer Engine's private name: ``DType.kFloat4E2M1``."""
        return te_dtype_of(self.fp8_dtype)


# recipe_short_name -> class; the row-wise recipe has no Transformer Engine counterpart.
_TE_CLASS_BY_RECIPE: dict[str, type] = {
    "mxfp8": MXFP8Tensor,
    "blockwise": Float8BlockwiseQTensor,
    "nvfp4": NVFP4Tensor,
}


def _aliases_normal_block_tensor(func: Any, args: tuple) -> bool:
    """Whether ``func`` returns aliases (views, detach) of a non-inference BlockScaledTensor."""
    returns = func._schema.returns
    return (
        bool(args)
        and isinstance(args[0], BlockScaledTensor)
        and not args[0].is_inference()
        and len(returns) > 0
        and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    )


def _dequantize_impl(t: BlockScaledTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if t._rowwise is not None:
        flat = t._rowwise.dequantize()
    else:
        flat = t._columnwise.dequantize().t()
    return flat.reshape(t.shape).to(dtype or t.dtype)


def _unwrap(x: Any) -> Any:
    return _dequantize_impl(x) if isinstance(x, BlockScaledTensor) else x


def _inplace(func: Any, args: tuple, kwargs: dict) -> Any:
    """In-place op writing a BlockScaledTensor parameter: run on the master, re-quantize."""

    def master(x: BlockScaledTensor) -> torch.Tensor:
        if x._master is None:
            raise ValueError(
                f"BlockScaledTensor: in-place {func} on a tensor without a master copy "
                "(only FP8 parameters from quantized_model_init support in-place updates)"
            )
        return x._master

    return write_back_in_place(
        func, args, kwargs, BlockScaledTensor,
        work_copy=master, requantize=lambda t, hp: t._requantize_from(hp), unwrap=_unwrap,
    )


def _same(t: BlockScaledTensor, shape: Any = None, **kw: Any) -> BlockScaledTensor:
    return BlockScaledTensor(
        t.shape if shape is None else shape, t.dtype, t._rowwise, t._columnwise, t.recipe_name, **kw
    )


def _detach(t: BlockScaledTensor) -> BlockScaledTensor:
    # Keeps master and quantizer: nn.Parameter(t) is built by detach().
    return _same(t, master=t._master, quantizer=t._quantizer)


def _view(t: BlockScaledTensor, size: Any) -> Any:
    size = list(size)
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        size[size.index(-1)] = t.numel() // max(known, 1)
    if len(size) >= 1 and t.dim() >= 1 and size[-1] == t.shape[-1] and torch.Size(size).numel() == t.numel():
        # Leading dimensions only: the 2-D payloads are unchanged.
        return _same(t, size)
    # Any other view would cut across blocks: compute in high precision.
    return _dequantize_impl(t).view(size)


def _clone(t: BlockScaledTensor, *, memory_format: Any = None) -> BlockScaledTensor:
    clone = lambda p: None if p is None else p.map(torch.clone)  # noqa: E731
    return BlockScaledTensor(t.shape, t.dtype, clone(t._rowwise), clone(t._columnwise), t.recipe_name)


def _copy_(self: Any, src: Any, non_blocking: bool = False) -> Any:
    # load_state_dict: take the source's master, not its FP8 rounding (lossless round trip).
    if isinstance(src, BlockScaledTensor) and src._master is not None:
        src = src._master
    return _inplace(aten.copy_.default, (self, src), {"non_blocking": non_blocking})


def _to_copy(t: BlockScaledTensor, **kwargs: Any) -> torch.Tensor:
    # FP8 parameters stay quantized through module.to(); anything else converts to plain.
    if t._master is None or kwargs.get("layout") not in (None, torch.strided):
        return aten._to_copy.default(_dequantize_impl(t), **kwargs)
    dtype = kwargs.get("dtype") or t.dtype
    device = kwargs.get("device") or t.device
    move = lambda p: None if p is None else p.map(lambda x: x.to(device))  # noqa: E731
    return BlockScaledTensor(
        t.shape, dtype, move(t._rowwise), move(t._columnwise), t.recipe_name,
        master=t._master.to(device=device, dtype=dtype), quantizer=t._quantizer,
    )


_HANDLERS = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.detach.default: _detach,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.clone.default: _clone,
}
