"""Quantizers: builders that turn high-precision tensors into Float8Tensors.

Quantizers are owned by ops and keep their state across steps:

* :class:`DelayedScalingQuantizer` -- scale from an amax history; the history
  and scale are updated once per step by the autocast's amax reduction
  (:mod:`~tp_fuse.quantization.amax_reduction`), never by ``quantize``.
* :class:`CurrentScalingQuantizer` -- scale from the tensor's own amax
  (all-reduced MAX over its group, if any) at quantize time.
* :class:`OpQuantizers` -- the per-op set of quantizers by role, rebuilt only
  when the recipe changes.

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
import copy
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

from .. import kernels
from ..recipe import DelayedScaling, Float8CurrentScaling, Recipe, low_precision_max
from . import scaling
from .block.tensor import BlockScaledTensor
from .compile_ref import CompileRef
from .float8.tensor import Float8Tensor
from .quantized_tensor import QuantizedTensor
from .role import QuantizerRole, role_tensor_type

__all__ = [
    "Quantizer",
    "DelayedScalingQuantizer",
    "CurrentScalingQuantizer",
    "OpQuantizers",
    "is_backward_role",
    "make_quantizer",
    "register_recipe_quantizer",
    "update_delayed_quantizers",
    "fix_delayed_groups",
    "UsageMixin",
]

_FP32_MAX = float(torch.finfo(torch.float32).max)


def no_grad_if_enabled() -> contextlib.AbstractContextManager:
    """``torch.no_grad()``, or nothing when grad mode is off already: inside the fuser's
    autograd functions (every quantize of a training step) entering and leaving
    ``no_grad`` would cost about 1.4 us per call for nothing."""
    return torch.no_grad() if torch.is_grad_enabled() else _NULL_CONTEXT


_NULL_CONTEXT = contextlib.nullcontext()


def is_backward_role(role: str) -> bool:
    """Whether ``role`` names a gradient (backward FP8 dtype)."""
    return role.startswith("grad")


def _amax(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) as a 0-d fp32 tensor; 0 for an empty tensor; NaN propagates."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return (x.detach() if x.requires_grad else x).abs().amax().to(torch.float32)


def _cast(
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


def _with_transpose(t: Float8Tensor, data_t: Optional[torch.Tensor]) -> Float8Tensor:
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


class DelayedScalingQuantizer(Quantizer):
    """Delayed scaling: quantize with last step's scale, record this step's amax.

    State (all fp32 tensors, updated in place so references stay valid):
        ``scale`` (0-d, starts at 1.0), ``amax_history`` ([amax_history_len],
        zeros; slot 0 = current step), ``last_amax`` (amax used by the last
        :meth:`update`), ``nonfinite_amax_count`` (int64 0-d: updates whose amax
        was NaN/inf, so the previous scale was kept).

    ``quantize`` folds ``amax(|x|)`` into ``amax_history[0]`` (several calls in a
    step keep the max). ``update`` -- called once per step after the amax
    reduction -- computes the new scale and rolls the history.
    """

    def __init__(self, recipe: DelayedScaling, role: str, device: Optional[torch.device] = None) -> None:
        if not isinstance(recipe, DelayedScaling):
            raise ValueError(
                f"DelayedScalingQuantizer recipe: expected DelayedScaling, got {type(recipe).__name__}"
            )
        fmt = recipe.fp8_format
        super().__init__(fmt.bwd_dtype if is_backward_role(role) else fmt.fwd_dtype, role)
        self.recipe = recipe
        self.margin = recipe.margin
        kw = {"dtype": torch.float32, "device": device}
        # Normal tensors even when built under torch.inference_mode: the state is
        # updated in place by later training steps, which inference tensors forbid.
        with torch.inference_mode(False):
            self.scale = torch.ones((), **kw)
            self.amax_history = torch.zeros(recipe.amax_history_len, **kw)
            self.last_amax = torch.zeros((), **kw)
            self.nonfinite_amax_count = torch.zeros((), dtype=torch.int64, device=device)

    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        with no_grad_if_enabled():
            self._to_device(x.device)
            # One kernel on CUDA: the cast maxes its amax into this step's history slot
            # and writes the tensor's scale_inv. (no detach: nothing is recorded under no_grad)
            scale_inv = new_scale_inv(x.device)
            data, data_t, _ = _cast(x, self.scale, self.fp8_dtype, transpose=transpose,
                                    amax_out=self.current_amax, scale_inv_out=scale_inv)
        return _with_transpose(Float8Tensor.wrap_checked(data, scale_inv, x.dtype), data_t)

    def window_state(self) -> Optional[torch.Tensor]:
        """The scale the window's first cast uses (a copy: the step's updates change the
        quantizer's own), for :meth:`recast_in_window`; None before the state exists on a
        device (the first cast then happens outside any window's reuse)."""
        return self.scale.detach().clone()

    def recast_in_window(self, x: torch.Tensor, state: Any, *, transpose: bool = False) -> Float8Tensor:
        """Cast ``x`` with the window's first scale ``state`` and record no amax (a reuse
        records none: Transformer Engine's ``skip_fp8_weight_update``)."""
        with no_grad_if_enabled():
            scale = state if state.device == x.device else state.to(x.device)
            scale_inv = new_scale_inv(x.device)
            data, data_t, _ = _cast(x, scale, self.fp8_dtype, transpose=transpose, with_amax=False,
                                    scale_inv_out=scale_inv)
        return _with_transpose(Float8Tensor.wrap_checked(data, scale_inv, x.dtype), data_t)

    def producer_outputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale, amax_out, scale_inv_out)`` for a kernel that writes this quantizer's
        FP8 itself (a norm, an activation): it quantizes with ``scale``, maxes its amax into
        ``amax_out`` (this step's history slot) and writes ``scale_inv_out``, a new tensor
        for :meth:`wrap_produced` -- what :meth:`quantize` does, in the producer's launch."""
        self._to_device(device)
        return self.scale, self.current_amax, new_scale_inv(device)

    @staticmethod
    def wrap_produced(
        data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, data_t: Optional[torch.Tensor] = None
    ) -> Float8Tensor:
        """The Float8Tensor of bytes a producer wrote with :meth:`producer_outputs`."""
        return _with_transpose(Float8Tensor.wrap_checked(data, scale_inv, dtype), data_t)

    def _to_device(self, device: torch.device) -> None:
        # State follows the data on first use (modules may be moved after init), until
        # its first update fixes it in a group's buffers (_SharedDelayedState).
        if self.scale.device != device:
            if self.__dict__.get("_shared_state") is not None:
                raise ValueError(
                    f"{self!r}: its FP8 state lives on {self.scale.device} since its first scale update and is "
                    f"static from then on; got data on {device}. Move the model before its first FP8 step"
                )
            move_state_before_capture(self, ("scale", "amax_history", "last_amax", "nonfinite_amax_count"), device)

    @torch.no_grad()
    def rescale_to_fit(self, x: torch.Tensor) -> None:
        """Prepare to quantize ``x``, a new value for the whole tensor (an FP8 weight
        overwritten by ``copy_``/``fill_``, e.g. when a checkpoint is loaded).

        ``amax(|x|)`` is folded into this step's history slot, as ``quantize`` does.
        If the current scale would saturate ``x`` (``amax * scale > fp8_max``), the
        scale is derived again from the history now, instead of at the end of the
        step: otherwise the loaded values would be clipped (the scale was fitted to
        the old values). A scale that already fits is kept, so delayed scaling's
        step-to-step behaviour (Transformer Engine's) is unchanged. The history is
        not rolled.

        The re-derived scale is rounded down to a power of two (unless the recipe has
        its own ``scaling_factor_compute_algo``): values already on the FP8 grid at any
        power-of-two scale -- weights saved from an FP8 model, Transformer Engine's
        scale-1 FP8 weights -- then load without rounding, at the cost of less than
        one bit of range.
        """
        self._to_device(x.device)
        amax = _amax(x).to(self.amax_history.device)
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax)
        if bool(amax * self.scale > self.fp8_max):
            r = self.recipe
            hist_amax = scaling.amax_from_history(self.amax_history, r.amax_compute_algo)
            scale = scaling.delayed_scale(
                hist_amax, self.scale, self.fp8_max, self.margin, r.scaling_factor_compute_algo, r
            )
            if r.scaling_factor_compute_algo is None:
                scale = scaling.round_down_to_power_of_2(scale)
            self.scale.copy_(scale)

    @property
    def current_amax(self) -> torch.Tensor:
        """This step's amax slot (``amax_history[0]``), a view (made once per history
        tensor: indexing is an op on every quantize otherwise)."""
        hist = self.amax_history
        cached = self.__dict__.get("_slot")
        # data_ptr: a copied quantizer (deepcopy, unpickling) must not write to a slot that
        # no longer shares its history's storage.
        if cached is None or cached[0] is not hist or cached[1].data_ptr() != hist.data_ptr():
            cached = self._slot = (hist, hist[0])
        return cached[1]

    @torch.no_grad()
    def update(self) -> None:
        """End of step: new scale from the history, then roll the history.

        Call after the step's amax has been reduced into ``amax_history[0]``.
        :func:`update_delayed_quantizers` does the same for many quantizers at once.
        """
        r = self.recipe
        # A NaN/inf amax is counted but never enters the history: with "max" it would
        # freeze the scale for amax_history_len steps. 0 in the slot means "no data".
        current = self.amax_history[0]
        bad_current = scaling.is_nonfinite(current)
        self.amax_history[0] = torch.where(bad_current, torch.zeros_like(current), current)
        amax = scaling.amax_from_history(self.amax_history, r.amax_compute_algo)
        new_scale = scaling.delayed_scale(
            amax, self.scale, self.fp8_max, self.margin, r.scaling_factor_compute_algo, r
        )
        self.nonfinite_amax_count += (bad_current | scaling.is_nonfinite(amax)).to(torch.int64)
        self.last_amax.copy_(amax)
        self.scale.copy_(new_scale)
        self.amax_history.copy_(scaling.roll_amax_history(self.amax_history))

    def stats(self) -> dict[str, float]:
        return {
            "amax": float(self.last_amax),
            "scale": float(self.scale),
            "scale_inv": float(1.0 / self.scale),
            "amax_history_max": float(self.amax_history.amax()),
            "nonfinite_amax_count": float(self.nonfinite_amax_count),
        }


def _batchable(q: DelayedScalingQuantizer) -> bool:
    r = q.recipe
    return r.scaling_factor_compute_algo is None and r.amax_compute_algo in ("max", "most_recent")


class _SharedDelayedState:
    """The state of delayed-scaling quantizers updated together: one group, fixed once.

    ``hist [n, L]``, ``scale [n]``, ``last_amax [n]``, ``count [n]``: row ``i`` belongs to
    ``quantizers[i]``, whose own ``amax_history``/``scale``/``last_amax``/
    ``nonfinite_amax_count`` become views of that row (Transformer Engine keeps one
    amax-history matrix per module the same way). The per-step update then works on the
    buffers directly: no per-quantizer stacking before and copying back after.

    Static by construction (CUDA graphs and compiled steps hold these addresses):

    * the buffers are allocated once, on the device of the first update, and never
      rebound; writes go in place (a checkpoint load's ``copy_`` goes through the views);
    * membership is fixed when the group is made (the first update that sees a
      quantizer): a quantizer first updated in a later step joins a *new* group, it never
      rebinds an existing one;
    * a member missing from a step keeps its row untouched (its slot stays 0, "no data";
      its scale and history are kept, exactly as eager's per-quantizer update would leave
      an unused quantizer); the step updates only the rows it used (a cached row index);
    * a member whose tensor was rebound (assigned, or moved to another device) after it
      joined is refused with a clear error instead of silently rebuilding the group.
    """

    def __init__(self, qs: list[DelayedScalingQuantizer], device: torch.device) -> None:
        assert all(q.__dict__.get("_shared_state") is None for q in qs), "a quantizer joins one group, once"
        with torch.inference_mode(False):  # updated in place by later steps (see __init__)
            self.hist = torch.stack([q.amax_history for q in qs])
            self.scale = torch.stack([q.scale for q in qs])
            self.last_amax = torch.stack([q.last_amax for q in qs])
            self.count = torch.stack([q.nonfinite_amax_count for q in qs])
        for i, q in enumerate(qs):
            q.amax_history, q.scale = self.hist[i], self.scale[i]
            q.last_amax, q.nonfinite_amax_count = self.last_amax[i], self.count[i]
            # The row lives on the quantizer: a deep copy of a model copies both consistently.
            q._shared_state, q._shared_row = self, i
        self.quantizers = tuple(qs)
        self.device = device
        self.bound = tuple((q.amax_history, q.scale, q.last_amax, q.nonfinite_amax_count, q.recipe, q.margin)
                           for q in qs)
        # Per-row recipe constants, made once (on a GPU a tensor built from a Python list
        # is a host-to-device copy that waits for the stream).
        self._consts = self._constants(list(range(len(qs))), device)
        # Row subsets seen so far (a step that used only some members): index + constants.
        self._subsets: dict[tuple[int, ...], tuple[torch.Tensor, tuple]] = {}
        self.current = self.hist[:, 0]  # a view: this step's slots

    def _constants(self, rows: list[int], device: torch.device) -> tuple:
        qs = [self.quantizers[i] for i in rows]
        most_recent = [q.recipe.amax_compute_algo == "most_recent" for q in qs]
        return (
            torch.tensor([q.fp8_max for q in qs], dtype=torch.float64, device=device),
            torch.tensor([2.0 ** q.margin for q in qs], dtype=torch.float64, device=device),
            torch.tensor(most_recent, device=device),
            {"any_margin": any(q.margin != 0 for q in qs), "any_most_recent": any(most_recent),
             "all_most_recent": all(most_recent)},
        )

    def row_of(self, q: DelayedScalingQuantizer) -> int:
        """``q``'s row; a clear error if ``q``'s state no longer is that row."""
        i = q._shared_row
        assert self.quantizers[i] is q
        hist, scale, last, count, recipe, margin = self.bound[i]
        if (q.amax_history is not hist or q.scale is not scale or q.last_amax is not last
                or q.nonfinite_amax_count is not count):
            raise ValueError(
                f"{q!r}: its FP8 state (amax_history/scale/last_amax/nonfinite_amax_count) was rebound "
                "after its first scale update; the state is static once training started (CUDA graphs and "
                "compiled steps hold its addresses): write it in place (tensor.copy_(...)) instead"
            )
        assert q.recipe is recipe and q.margin == margin, "a quantizer's recipe is fixed at construction"
        return i

    def update(self, rows: list[int]) -> None:
        """The fused delayed-scaling update of ``rows`` (sorted, distinct), in place."""
        if len(rows) == len(self.quantizers):
            fp8_max, pow2_margin, most_recent, flags = self._consts
            kernels.delayed_scale_update(self.hist, self.scale, self.last_amax, self.count,
                                         fp8_max, pow2_margin, most_recent, **flags)
            return
        key = tuple(rows)
        cached = self._subsets.get(key)
        if cached is None:
            cached = self._subsets[key] = (torch.tensor(rows, device=self.device),
                                           self._constants(rows, self.device))
        idx, (fp8_max, pow2_margin, most_recent, flags) = cached
        # Rows are updated independently: the used rows' bits equal the full update's.
        hist, scale = self.hist.index_select(0, idx), self.scale.index_select(0, idx)
        last, count = self.last_amax.index_select(0, idx), self.count.index_select(0, idx)
        kernels.delayed_scale_update(hist, scale, last, count, fp8_max, pow2_margin, most_recent, **flags)
        for buf, rows_new in ((self.hist, hist), (self.scale, scale), (self.last_amax, last), (self.count, count)):
            buf.index_copy_(0, idx, rows_new)


def update_delayed_quantizers(quantizers: list[DelayedScalingQuantizer]) -> None:
    """``q.update()`` for every quantizer, as a few batched tensor ops instead of ~20 per quantizer.

    Quantizers with the built-in amax algorithms ("max", "most_recent") and no custom
    scale function are grouped per (device, history length); each group's state lives in
    shared buffers (:class:`_SharedDelayedState`, made by the first update that sees its
    members, fixed from then on) and is updated with the same float operations as
    :meth:`DelayedScalingQuantizer.update` in the same order (bit-identical results:
    tested); the others run their own ``update``. This is the once-per-step scale update
    of every FP8 GEMM's quantizers (Transformer Engine does it in one fused kernel over
    all of them), so its cost is per-step host time.
    """
    with no_grad_if_enabled():
        _update_delayed_quantizers(quantizers)


def fix_delayed_groups(quantizers: Iterable[Quantizer]) -> None:
    """Put the batchable delayed-scaling quantizers of ``quantizers`` that are in no
    group yet into new groups (per device and history length), updating nothing.

    The first update does this by itself; call it before capturing a CUDA graph (or
    tracing a replayable step) so that the captured state addresses are the groups' rows.
    """
    joining: dict[tuple, dict[int, DelayedScalingQuantizer]] = {}
    for q in quantizers:
        if isinstance(q, DelayedScalingQuantizer) and _batchable(q) and q.__dict__.get("_shared_state") is None:
            joining.setdefault((q.amax_history.device, q.amax_history.numel()), {})[id(q)] = q
    with torch.no_grad():
        for (device, _), members in joining.items():
            _SharedDelayedState(list(members.values()), device)


def _update_delayed_quantizers(quantizers: list[DelayedScalingQuantizer]) -> None:
    fix_delayed_groups(quantizers)
    used: dict[int, tuple[_SharedDelayedState, set[int]]] = {}
    for q in quantizers:
        if not _batchable(q):
            q.update()
            continue
        st = q.__dict__["_shared_state"]
        used.setdefault(id(st), (st, set()))[1].add(st.row_of(q))
    # One kernel on CUDA per group (Transformer Engine's fused update); groups hold
    # independent rows, so their order changes no bits.
    for st, rows in used.values():
        st.update(sorted(rows))


class CurrentScalingQuantizer(Quantizer):
    """Current scaling: ``scale = fp8_max / amax(|x|)`` computed at quantize time.

    With an ``amax_reduction_group`` the amax is all-reduced (MAX) over it first,
    so all ranks of the group quantize with one scale (required to all-gather
    FP8 bytes). A zero or non-finite amax gives scale 1.0; such amaxes are
    counted in ``zero_amax_count`` / ``nonfinite_amax_count`` for logging.
    ``power_2_scale`` rounds the scale down to a power of two.

    State (``scale``, ``last_amax``: fp32 0-d; the two counts: int64 0-d) lives on the
    device of the data, moved there at the first quantize, and is then only written in
    place by the cast (never rebound): a CUDA graph or compiled step that holds these
    buffers sees every update. On CUDA a quantize is two launches: the amax reduction
    (or the producer's amax) and the cast, which derives the scale from the amax and
    writes scale, ``scale_inv``, last amax and counts itself.
    """

    def __init__(
        self,
        recipe: Float8CurrentScaling,
        role: str,
        amax_reduction_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if not isinstance(recipe, Float8CurrentScaling):
            raise ValueError(
                "CurrentScalingQuantizer recipe: expected Float8CurrentScaling, got "
                f"{type(recipe).__name__}"
            )
        fmt = recipe.fp8_format
        super().__init__(fmt.bwd_dtype if is_backward_role(role) else fmt.fwd_dtype, role)
        self.recipe = recipe
        self.power_2_scale = recipe.power_2_scale
        self.amax_reduction_group = amax_reduction_group
        with torch.inference_mode(False):  # written in place by later steps
            self.scale = torch.ones((), dtype=torch.float32)
            self.last_amax = torch.zeros((), dtype=torch.float32)
            self.nonfinite_amax_count = torch.zeros((), dtype=torch.int64)
            self.zero_amax_count = torch.zeros((), dtype=torch.int64)

    def _empty_scale_inv(self, device: torch.device) -> torch.Tensor:
        # ``self.scale`` is the last tensor's scale, unrelated to a new tensor's values:
        # an empty tensor gets 1, its real scale comes with the first quantization.
        return torch.ones((), dtype=torch.float32, device=device)

    def _to_device(self, device: torch.device) -> None:
        # State follows the data on first use (modules may be moved after init); after
        # that it is only written in place.
        if self.scale.device != device:
            move_state_before_capture(self, ("scale", "last_amax", "nonfinite_amax_count", "zero_amax_count"), device)

    def reduces_at_cast(self) -> bool:
        group = self.amax_reduction_group
        return group is not None and dist.get_world_size(group) > 1

    def _reduce(self, amax: torch.Tensor) -> torch.Tensor:
        group = self.amax_reduction_group
        if group is None or dist.get_world_size(group) == 1:
            return amax
        # fp32 on the wire (gloo has no bf16 MAX; exact for any amax of bf16/fp16 values).
        amax = scaling.nan_to_inf(amax.float()).reshape(1)
        check_collective("all_reduce", [amax], world_size=dist.get_world_size(group), op=dist.ReduceOp.MAX)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax.reshape(())

    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        # One reduction kernel: the amax in x's dtype (exact).
        return self._quantize_with_own_amax(x, kernels.amax_of(x if not x.requires_grad else x.detach()), transpose)

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, *, transpose: bool = False) -> Float8Tensor:
        """Quantize with the scale from ``amax`` = this rank's max |x| (all-reduced
        over the amax group first), e.g. the amax a norm kernel computed in passing."""
        return self._quantize_with_own_amax(x, amax.detach(), transpose)

    def _quantize_with_own_amax(self, x: torch.Tensor, amax: torch.Tensor, transpose: bool) -> Float8Tensor:
        """:meth:`quantize_with_amax`: the cast derives the scale and writes the state."""
        with no_grad_if_enabled():
            self._to_device(x.device)
            amax = self._reduce(amax)
            scale_inv = new_scale_inv(x.device)
            # The cast kernels take >= 1 dims: a 0-d tensor is cast as shape [1] (as _cast does).
            data, data_t = kernels.quantize_current_scaling(
                x.reshape(1) if x.dim() == 0 else x, amax, self.fp8_dtype, scale_out=self.scale,
                scale_inv_out=scale_inv, last_amax_out=self.last_amax, nonfinite_count=self.nonfinite_amax_count,
                zero_count=self.zero_amax_count, power_2_scale=self.power_2_scale, transpose=transpose and x.dim() > 0,
            )
            if x.dim() == 0:
                data, data_t = data.reshape(()), data.reshape(1, 1) if transpose else None
        return _with_transpose(Float8Tensor.wrap_checked(data, scale_inv, x.dtype), data_t)

    def stats(self) -> dict[str, float]:
        return {
            "amax": float(self.last_amax),
            "scale": float(self.scale),
            "scale_inv": float(1.0 / self.scale),
            "nonfinite_amax_count": float(self.nonfinite_amax_count),
            "zero_amax_count": float(self.zero_amax_count),
        }


# Quantizer factories of recipes defined outside this module (block-scaled recipes:
# block/quantizer.py registers itself on import). A static table, like the fusion registry.
_RECIPE_QUANTIZERS: dict[type, Callable[[Recipe, str], Quantizer]] = {}


def register_recipe_quantizer(recipe_type: type, factory: Callable[[Recipe, str], Quantizer]) -> None:
    """Make :func:`make_quantizer` build ``factory(recipe, role)`` for ``recipe_type``."""
    _RECIPE_QUANTIZERS[recipe_type] = factory


def make_quantizer(
    recipe: Recipe, role: Union[str, QuantizerRole], amax_reduction_group: Optional[dist.ProcessGroup] = None
) -> Quantizer:
    """A fresh quantizer for ``role`` (a role name, or a :class:`QuantizerRole`, whose
    ``tensor_type`` names it) under ``recipe``."""
    role = role_tensor_type(role)
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingQuantizer(recipe, role)
    if isinstance(recipe, Float8CurrentScaling):
        return CurrentScalingQuantizer(recipe, role, amax_reduction_group)
    factory = _RECIPE_QUANTIZERS.get(type(recipe))
    if factory is not None:
        return factory(recipe, role)
    known = ["DelayedScaling", "Float8CurrentScaling"] + [t.__name__ for t in _RECIPE_QUANTIZERS]
    raise ValueError(f"recipe: expected one of {known}, got {type(recipe).__name__}")


class OpQuantizers:
    """The quantizers of one op, by role, persisting across steps.

    ``get(recipe, group)`` returns the same quantizer objects on every call
    while the recipe is unchanged -- the same object, or an equal one (a new
    ``DelayedScaling()`` per step keeps the amax history). A recipe that
    differs (or was mutated in place since) rebuilds all quantizers. A new
    ``amax_reduction_group`` does not rebuild: it is handed to the current-
    scaling quantizers (delayed scaling reduces per autocast, not per quantizer).
    """

    def __init__(self, roles: Sequence[str]) -> None:
        roles = tuple(roles)
        if not roles or not all(isinstance(r, str) and r for r in roles):
            raise ValueError(f"OpQuantizers roles: expected non-empty role names, got {roles!r}")
        if len(set(roles)) != len(roles):
            raise ValueError(f"OpQuantizers roles: expected distinct names, got {roles!r}")
        self.roles = roles
        self._recipe_snapshot: Optional[Recipe] = None
        self._quantizers: dict[str, Quantizer] = {}
        # How torch.compile'd graphs name this object in custom-op calls (compile_state).
        self.compile_ref = CompileRef(self)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "compile_ref"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (copy/deepcopy/unpickle) is another object: it gets its own ref, or a
        # compiled graph of the copy would quantize with the original's state.
        self.__dict__.update(state)
        self.compile_ref = CompileRef(self)

    def get(
        self, recipe: Recipe, amax_reduction_group: Optional[dist.ProcessGroup] = None
    ) -> dict[str, Quantizer]:
        """Quantizers by role for ``recipe`` (built on first use or recipe change)."""
        if not isinstance(recipe, Recipe):
            raise ValueError(f"recipe: expected a tp_fuse.recipe.Recipe, got {type(recipe).__name__}")
        snap = self._recipe_snapshot
        # Compare against a snapshot, not the caller's object: equality then also
        # catches a recipe edited in place after the quantizers were built.
        if snap is None or type(snap) is not type(recipe) or snap != recipe:
            self._recipe_snapshot = copy.copy(recipe)
            # Quantizers get the snapshot too, so later edits to the caller's
            # object cannot change their behaviour behind this check.
            self._quantizers = {
                role: make_quantizer(self._recipe_snapshot, role, amax_reduction_group)
                for role in self.roles
            }
        for q in self._quantizers.values():
            if isinstance(q, CurrentScalingQuantizer):
                q.amax_reduction_group = amax_reduction_group
        return dict(self._quantizers)

    @property
    def quantizers(self) -> dict[str, Quantizer]:
        """The quantizers built by the last :meth:`get` (empty before)."""
        return dict(self._quantizers)
