"""The quantizer contract: :class:`Quantizer`, the base of every builder that turns
high-precision tensors into quantized ones, and the helpers its subclasses share.

Quantizers are owned by ops and keep their state across steps. The per-tensor ones live
in ``float8/``: :class:`~tp_fuse.quantization.float8.delayed_scaling.DelayedScalingQuantizer`
(scale from an amax history, updated once per step by the autocast's amax reduction) and
:class:`~tp_fuse.quantization.float8.current_scaling.CurrentScalingQuantizer` (scale from
the tensor's own amax at quantize time); the block-scaled ones in ``block/`` and
``nvfp4/``. :mod:`~tp_fuse.quantization.op_quantizers` builds them per recipe
(``make_quantizer``) and keeps an op's set (``OpQuantizers``); recipes defined outside it
register their factory here (:func:`register_recipe_quantizer`).

Roles: names starting with ``"grad"`` (``"grad_output"``, ``"grad_input"``) are
backward tensors and use the recipe's backward FP8 dtype; every other role
(``"input"``, ``"weight"``, ...) uses the forward dtype.

Every cast goes through ``tp_fuse.kernels.quantize`` (cast and amax in one pass, and
optionally the transposed bytes a wgrad GEMM reads; Triton on CUDA, torch elsewhere).
Kernels that produce a quantizer's input can also write its FP8 directly (a norm
before a GEMM): :meth:`Quantizer.producer_outputs`, :meth:`DelayedScalingQuantizer.wrap_produced`
and :meth:`Quantizer.quantize_with_amax` are the hooks for that.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch

from .. import kernels
from ..recipe import Recipe, low_precision_max
from .block.tensor import BlockScaledTensor
from .float8.tensor import Float8Tensor
from .quantized_tensor import QuantizedTensor

__all__ = [
    "Quantizer",
    "UsageMixin",
    "check_empty_args",
    "is_backward_role",
    "move_state_before_capture",
    "new_scale_inv",
    "no_grad_if_enabled",
    "parse_shape",
    "register_recipe_quantizer",
]


def no_grad_if_enabled() -> contextlib.AbstractContextManager:
    """``torch.no_grad()``, or nothing when grad mode is off already: inside the fuser's
    autograd functions (every quantize of a training step) entering and leaving
    ``no_grad`` would cost about 1.4 us per call for nothing."""
    return torch.no_grad() if torch.is_grad_enabled() else _NULL_CONTEXT


_NULL_CONTEXT = contextlib.nullcontext()


def is_backward_role(role: str) -> bool:
    """Whether ``role`` names a gradient (backward FP8 dtype)."""
    return role.startswith("grad")


def amax_abs(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) as a 0-d fp32 tensor; 0 for an empty tensor; NaN propagates."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return (x.detach() if x.requires_grad else x).abs().amax().to(torch.float32)


def cast_per_tensor(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool = False,
    with_amax: bool = True,
    amax_out: Optional[torch.Tensor] = None,
    scale_inv_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``kernels.quantize`` for any rank, 0-d included: the cast kernels take >= 1 dims,
    and a 0-d tensor's value is its one element (cast as shape ``[1]``, bytes reshaped back)."""
    if x.dim() == 0:
        data, _, amax = kernels.quantize(x.reshape(1), scale, fp8_dtype, with_amax=with_amax,
                                         amax_out=amax_out, scale_inv_out=scale_inv_out)
        # The "transpose" of one element is that element ([cols, rows] = [1, 1]).
        return data.reshape(()), data.reshape(1, 1) if transpose else None, amax
    return kernels.quantize(x, scale, fp8_dtype, transpose=transpose, with_amax=with_amax,
                            amax_out=amax_out, scale_inv_out=scale_inv_out)


def new_scale_inv(device: torch.device) -> torch.Tensor:
    """An uninitialized 0-d fp32 ``scale_inv`` for one quantized tensor, filled by the cast
    kernel that writes the tensor (an allocation, no kernel: the scale it inverts
    changes with later updates, this tensor's must not)."""
    return torch.empty((), dtype=torch.float32, device=device)


def move_state_before_capture(owner: object, names: Sequence[str], device: torch.device) -> None:
    """Rebind ``owner``'s state tensors ``names`` to copies on ``device`` (the lazy first
    move of quantizer state born on the CPU).

    That copy is a pageable host-to-device copy, illegal inside a CUDA graph capture: run
    one eager step (or ``tp_fuse.make_graphed_callables``' warm-up) before capturing. It
    is refused with a clear error if it would happen during capture.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{owner!r}: its FP8 state is still on the CPU and would be copied to {device} during CUDA graph "
            "capture (illegal); run one eager FP8 step, or warm up (make_graphed_callables does), before capturing"
        )
    with torch.inference_mode(False):  # written in place by later steps
        for name in names:
            setattr(owner, name, getattr(owner, name).to(device))


def parse_shape(shape: Any, who: str) -> tuple[int, ...]:
    """``shape`` (an iterable of sizes, or one int: TE's tests pass both) as a tuple of
    sizes >= 0; ``()`` is a 0-d tensor."""
    try:
        dims = (int(shape),) if isinstance(shape, int) else tuple(int(n) for n in shape)
    except TypeError:
        raise ValueError(f"{who}: shape must be an int or an iterable of ints, got {shape!r}") from None
    if any(n < 0 for n in dims):
        raise ValueError(f"{who}: shape must not have negative sizes, got {dims}")
    return dims


def check_empty_args(
    who: str, shape: Any, dtype: Any, device: Optional[Union[torch.device, str]]
) -> tuple[tuple[int, ...], torch.device]:
    """Validate Transformer Engine's ``make_empty`` arguments; ``(dims, device)``.

    ``shape``: an iterable of sizes >= 0 (``()`` is a 0-d tensor) or one int; ``dtype``: the
    nominal high-precision float dtype; ``device`` None: CUDA when available (TE's default),
    else the CPU.
    """
    dims = parse_shape(shape, f"{who}.make_empty")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ValueError(f"{who}.make_empty: dtype must be a high-precision float dtype, got {dtype!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return dims, torch.device(device)


def with_transpose(t: Float8Tensor, data_t: Optional[torch.Tensor]) -> Float8Tensor:
    """Seed ``t``'s transpose cache with the kernel's transposed bytes.

    The cast kernel wrote them in the same pass; ``Float8Tensor.transpose_data`` would
    otherwise re-read the FP8 data in the wgrad GEMM. The key is the one
    ``transpose_data`` checks, so any later in-place write still invalidates it.
    """
    # Tensors of fewer than 2 dims keep it too: TE exposes their ``_transpose``.
    key = t.transpose_cache_key() if data_t is not None else None
    if key is not None:
        t._transpose_cache = (key, data_t)
    return t


class _Quantize(torch.autograd.Function):
    """High-precision tensor -> Float8Tensor, differentiable (straight-through).

    ======== ======================== =======================
             forward                  backward
    ======== ======================== =======================
    in       x: [*] (dtype)           grad_out: [*] (dtype)
    out      q = Float8Tensor(x)      grad_x = grad_out
    ======== ======================== =======================

    The backward is the identity: quantization error is not differentiated,
    as in every FP8 training recipe.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantizer: "Quantizer", transpose: bool) -> Float8Tensor:
        return quantizer._quantize_impl(x, transpose)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if isinstance(grad_out, Float8Tensor):
            grad_out = grad_out.dequantize()
        return grad_out, None, None


class UsageMixin:
    """Transformer Engine's ``set_usage``: which copies of a tensor (row-wise, column-wise)
    the TE-named quantizers' ``__call__`` makes. One implementation for the per-tensor,
    block-scaled and NVFP4 TE quantizers; each ``__call__`` says what a usage means for
    its tensor type."""

    rowwise_usage: bool = True
    columnwise_usage: bool = True

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)


class Quantizer(abc.ABC):
    """Turns high-precision tensors into :class:`Float8Tensor`.

    Attributes:
        fp8_dtype: target FP8 dtype.
        fp8_max: largest finite value of ``fp8_dtype``.
        role: what the quantized tensor is (``"input"``, ``"grad_output"``...).
        rowwise_usage, columnwise_usage: the copies :meth:`make_empty` makes (TE's usage
            flags; the TE-named quantizers set them with ``set_usage``, :class:`UsageMixin`).
    """

    # Recipe quantizers make both copies; TE-named ones override these per instance.
    rowwise_usage: bool = True
    columnwise_usage: bool = True
    #: Whether the column-wise operand of a GEMM is the row-wise bytes transposed (one
    #: scale for the whole tensor), so that a GEMM reading any layout
    #: (``kernels.fp8_gemm_reads_views``) can take a transposed view instead of
    #: transposed bytes. Block scaling scales the columns with their own scales: False.
    transposes_by_view: bool = True

    def __init__(self, fp8_dtype: torch.dtype, role: str) -> None:
        self.fp8_dtype = fp8_dtype
        self.fp8_max = low_precision_max(fp8_dtype)
        self.role = role

    def quantize(self, x: torch.Tensor, *, transpose: bool = False) -> Float8Tensor:
        """Quantize ``x`` (any float dtype) to a Float8Tensor of nominal dtype
        ``x.dtype``; differentiable (straight-through) if ``x`` requires grad.

        ``transpose=True`` when a wgrad GEMM will read the tensor transposed: the cast
        kernel writes the transposed bytes in the same pass and they fill the
        Float8Tensor's transpose cache.
        """
        if isinstance(x, (Float8Tensor, BlockScaledTensor)):
            raise ValueError(f"{type(self).__name__}.quantize: input is already a {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise ValueError(
                f"{type(self).__name__}.quantize: expected a floating-point tensor, got {x.dtype}"
            )
        if torch.is_grad_enabled() and x.requires_grad:
            return _Quantize.apply(x, self, transpose)
        return self._quantize_impl(x, transpose)

    def quantize_or_pass(self, x: torch.Tensor, *, transpose: bool = False) -> tuple[Float8Tensor, bool]:
        """``(x_q, quantized_here)``: ``x`` itself when it already is a quantized
        tensor this quantizer's GEMMs can read (e.g. a gradient quantized by a
        ``Quantize(backward=True)`` op after this one, or handed in quantized by the
        caller; see :meth:`can_use_quantized`), as Transformer Engine's ops do; another
        quantized tensor (other format, or lacking the copy the GEMM reads) is
        dequantized and quantized again here. Callers register this quantizer's amax
        only when ``quantized_here``."""
        if isinstance(x, (Float8Tensor, BlockScaledTensor)):
            if self.can_use_quantized(x, transpose=transpose):
                return x, False
            x = x.dequantize()
        return self.quantize(x, transpose=transpose), True

    def can_use_quantized(self, x: torch.Tensor, *, transpose: bool = False) -> bool:
        """Whether the GEMMs fed by this quantizer can read the already-quantized ``x``
        as is. Per-tensor FP8: any :class:`Float8Tensor` (its transpose is made from
        the row-wise bytes on demand, exactly: one scale for the whole tensor)."""
        return isinstance(x, Float8Tensor)

    @abc.abstractmethod
    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        """Quantize without autograd."""

    def window_state(self) -> Any:
        """What a later cast in an ``FP8WeightCache`` window must repeat of this cast (see
        :meth:`recast_in_window`), taken just before the window's first cast; None when a
        cast depends on nothing but the tensor (current and block scaling)."""
        return None

    def recast_in_window(self, x: torch.Tensor, state: Any, *, transpose: bool = False) -> QuantizedTensor:
        """Cast ``x`` as the window's first cast did (``state`` from :meth:`window_state`),
        recording nothing a reuse of that cast would not: the bytes a reuse would give for
        unchanged values. Scales from the tensor itself (current, block scaling): a plain
        cast."""
        return self.quantize(x, transpose=transpose)

    def reduces_at_cast(self) -> bool:
        """Whether a cast runs a collective (current scaling's amax all-reduce over a group
        of several ranks): every rank of the group must then cast, or the others wait for
        it forever -- a cast may not be skipped on one rank only (``FP8WeightCache``)."""
        return False

    def producer_outputs(self, device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(scale, amax_out, scale_inv_out)`` for a kernel that produces this quantizer's
        input and can write its FP8 itself (a norm before a GEMM), or None when the scale
        depends on the produced tensor itself (current scaling: produce high precision
        plus its amax, then :meth:`quantize_with_amax`). See
        :meth:`DelayedScalingQuantizer.producer_outputs`."""
        return None

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, *, transpose: bool = False) -> Float8Tensor:
        """Quantize ``x`` whose ``max(|x|)`` a producing kernel already computed.

        Without autograd (fused ops run inside the fuser's autograd function). The
        base class ignores ``amax``; quantizers that need it (current scaling) use it
        instead of re-reading ``x``.
        """
        with torch.no_grad():
            return self._quantize_impl(x, transpose)

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Scalar statistics for logging (synchronizes with the device)."""

    # ------------------------------------------------- Transformer Engine's API
    def make_empty(
        self,
        shape: Iterable[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: Optional[Union[torch.device, str]] = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ) -> QuantizedTensor:
        """A quantized tensor of ``shape`` with uninitialized data (TE's ``make_empty``).

        ``dtype``: its nominal high-precision dtype; ``device`` None: CUDA when available
        (TE's default), else the CPU. It keeps this quantizer, so ``t.quantize_(x)`` (or
        ``quantizer.update_quantized(x, t)``) fills it. Per-tensor FP8 (this class): a
        :class:`Float8Tensor` whose scale is this quantizer's current one
        (:meth:`_empty_scale_inv`); the block quantizers make the copies ``set_usage``
        asks for.
        """
        dims, dev = check_empty_args(type(self).__name__, shape, dtype, device)
        return self._make_empty(dims, dtype, dev, requires_grad=bool(requires_grad), pin_memory=bool(pin_memory))

    def _make_empty(
        self, dims: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, requires_grad: bool, pin_memory: bool
    ) -> QuantizedTensor:
        data = torch.empty(dims, dtype=self.fp8_dtype, device=device, pin_memory=pin_memory)
        return Float8Tensor(data, self._empty_scale_inv(device), dtype, requires_grad=requires_grad, quantizer=self)

    def _empty_scale_inv(self, device: torch.device) -> torch.Tensor:
        """``scale_inv`` of an empty per-tensor tensor: ``1 / scale`` of a quantizer with a
        scale state, else 1 (current scaling: the scale comes with the first quantization)."""
        scale = getattr(self, "scale", None)
        if isinstance(scale, torch.Tensor):
            return torch.reciprocal(scale.detach().reshape(()).to(device=device, dtype=torch.float32))
        return torch.ones((), dtype=torch.float32, device=device)

    def update_quantized(
        self, src: torch.Tensor, dst: QuantizedTensor, *, noop_flag: Optional[torch.Tensor] = None
    ) -> QuantizedTensor:
        """Quantize ``src`` with this quantizer into ``dst``'s buffers, in place; returns
        ``dst`` (TE's ``update_quantized``). ``noop_flag`` (one-element tensor): nonzero
        skips the update. ``dst`` must be of this quantizer's format and ``src``'s shape."""
        if not isinstance(dst, QuantizedTensor) or not self._can_store(dst):
            raise ValueError(
                f"{type(self).__name__}.update_quantized: dst must be a quantized tensor of this quantizer's format "
                f"(e.g. from make_empty), got {type(dst).__name__}"
            )
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"{type(self).__name__}.update_quantized: expected src of dst's shape {tuple(dst.shape)}, "
                f"got {tuple(src.shape)}"
            )
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
            return dst
        with torch.no_grad():
            self._store(src.detach().to(dst.device), dst)
        return dst

    def _can_store(self, dst: QuantizedTensor) -> bool:
        return isinstance(dst, Float8Tensor)

    def _store(self, src: torch.Tensor, dst: QuantizedTensor) -> None:
        """Write ``quantize(src)`` into ``dst``'s buffers (same shape, checked)."""
        assert isinstance(dst, Float8Tensor)
        q = self._quantize_impl(src)
        dst._alias.generation += 1  # invalidates dst's (and its aliases') transpose cache
        dst._fp8.copy_(q._fp8)
        dst._sinv.copy_(q._sinv)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, fp8_dtype={self.fp8_dtype})"


# Quantizer factories of recipes defined outside this module (block-scaled recipes:
# block/quantizer.py registers itself on import). A static table, like the fusion registry.
RECIPE_QUANTIZERS: dict[type, Callable[[Recipe, str], Quantizer]] = {}


def register_recipe_quantizer(recipe_type: type, factory: Callable[[Recipe, str], Quantizer]) -> None:
    """Make :func:`make_quantizer` build ``factory(recipe, role)`` for ``recipe_type``."""
    RECIPE_QUANTIZERS[recipe_type] = factory
