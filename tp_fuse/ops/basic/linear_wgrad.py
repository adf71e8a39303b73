"""The weight gradient of the linear ops (``BasicLinear``, ``GroupedLinear``): its GEMM, where
the result goes, and Transformer Engine's ``delay_wgrad_compute`` (the GEMM deferred from the
backward pass to ``backward_dw()``).

One path for both timings: the backward pass either runs :func:`wgrad_gemm` now and hands the
result to :meth:`WgradSink.finish` (what autograd gets), or queues the same call with the
operands it would have read (:class:`DeferredWgrads`), hands autograd
:meth:`WgradSink.placeholder`, and ``backward_dw()`` later runs it and hands the result to
:meth:`WgradSink.deliver`, which puts it where autograd would have: added into ``weight.grad``
(set when None) or, with ``accumulate_into_main_grad``, into ``weight.main_grad``. The
delayed and immediate gradients are therefore the same bits.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Optional

import torch

from ...quantization import fp8_gemm

__all__ = ["DeferredWgrads", "WgradSink", "add_into_main_grad", "wgrad_gemm"]


def wgrad_gemm(dy2d: torch.Tensor, x2d: torch.Tensor, out_dtype: torch.dtype, *, fp8: bool,
               alpha: float = 1.0) -> torch.Tensor:
    """``dW [out, in] = alpha dy^T [out, M] @ x [M, in]``: from the quantized operands the
    forward and backward casts made (``fp8``; the transposed bytes or views they hold), else
    in high precision."""
    if fp8:
        dw = fp8_gemm(dy2d, x2d, out_dtype, transpose_a=True, transpose_b=True)
    else:
        dw = dy2d.t() @ x2d
    return dw.mul_(alpha) if alpha != 1.0 else dw


def add_into_main_grad(
    op_name: str, param_name: str, w: torch.Tensor, dw: torch.Tensor, dummy: Optional[torch.Tensor]
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Add ``dw`` into ``w.main_grad`` (Megatron's gradient_accumulation_fusion; overwrite
    when ``w.overwrite_main_grad``). Returns ``(gradient for autograd, dummy to cache)``
    (:func:`_megatron_dummy`)."""
    main_grad = getattr(w, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.shape != w.shape:
        raise ValueError(
            f"{op_name}: {param_name}.main_grad is not set or has the wrong "
            f"shape: {param_name}.main_grad must be a tensor of shape {tuple(w.shape)} (attach it before the "
            f"backward pass, e.g. Megatron's DistributedDataParallel does), got "
            f"{tuple(main_grad.shape) if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__}"
        )
    with torch.no_grad():
        if getattr(w, "overwrite_main_grad", False):
            main_grad.copy_(dw)
        else:
            main_grad.add_(dw.to(main_grad.dtype))
    return _megatron_dummy(w, dummy)


def _megatron_dummy(
    w: torch.Tensor, dummy: Optional[torch.Tensor]
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(gradient for autograd, dummy to cache)`` once dW is (or will be) in ``w.main_grad``:
    None without Megatron's ``grad_added_to_main_grad`` flag, else the flag set and a zero
    dummy (the cached one when it still fits), so that Megatron DDP's grad hooks still fire
    (and skip their own add)."""
    if not hasattr(w, "grad_added_to_main_grad"):
        return None, dummy
    w.grad_added_to_main_grad = True
    if dummy is None or dummy.shape != w.shape or dummy.dtype != w.dtype or dummy.device != w.device:
        dummy = torch.zeros_like(w.detach())
    return dummy, dummy


class WgradSink:
    """Where one weight's gradient goes (``accumulate_into_main_grad``: ``weight.main_grad``).

    ``op_name`` / ``param_name`` name the op and the weight in error messages.
    """

    def __init__(self, op_name: str, param_name: str, accumulate_into_main_grad: bool = False) -> None:
        self.op_name = op_name
        self.param_name = param_name
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._dummy: Optional[torch.Tensor] = None

    def _converted(self, w: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
        # Computed in the input's (autocast) dtype; main_grad takes it in its own dtype.
        if dw.dtype != w.dtype and not self.accumulate_into_main_grad:
            return dw.to(w.dtype)
        return dw

    def finish(self, w: torch.Tensor, dw: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The gradient to return to autograd for ``w`` when ``dw`` was computed in the
        backward pass: ``dw`` in ``w``'s dtype, or -- with ``accumulate_into_main_grad`` --
        None / a zero dummy after adding it into ``w.main_grad``."""
        if dw is None:
            return None
        dw = self._converted(w, dw)
        if not self.accumulate_into_main_grad:
            return dw
        grad, self._dummy = add_into_main_grad(
            f"{self.op_name}(accumulate_into_main_grad=True)", self.param_name, w, dw, self._dummy)
        return grad

    def placeholder(self, w: torch.Tensor) -> Optional[torch.Tensor]:
        """What autograd gets for ``w`` while its dW waits for ``backward_dw()``: None, or with
        ``accumulate_into_main_grad`` and Megatron's ``grad_added_to_main_grad`` flag the zero
        dummy with the flag set (Transformer Engine's behaviour)."""
        if not self.accumulate_into_main_grad:
            return None
        grad, self._dummy = _megatron_dummy(w, self._dummy)
        return grad

    def deliver(self, w: torch.Tensor, dw: torch.Tensor) -> None:
        """Put a deferred ``dw`` where the backward pass would have: into ``w.main_grad``
        (``accumulate_into_main_grad``), else added into ``w.grad`` (set when None), as
        autograd accumulates. Transformer Engine's ``backward_dw`` assigns ``w.grad``
        instead (the same when it was None)."""
        dw = self._converted(w, dw)
        if self.accumulate_into_main_grad:
            _, self._dummy = add_into_main_grad(
                f"{self.op_name}(accumulate_into_main_grad=True)", self.param_name, w, dw, self._dummy)
            return
        if not w.is_leaf:
            raise ValueError(f"{self.op_name}.backward_dw(): {self.param_name} is not a leaf tensor (a "
                             "concatenation of parameters?): a deferred weight gradient goes into a "
                             "parameter's .grad")
        with torch.no_grad():
            if w.grad is None:
                w.grad = dw
            else:
                w.grad.add_(dw)


class DeferredWgrads:
    """Transformer Engine's ``WeightGradStore`` for one op: with ``enabled``
    (``delay_wgrad_compute=True``) each backward pass queues its weight-gradient work here
    and ``backward_dw()`` runs the oldest (first in, first out, as TE's queue)."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = bool(enabled)
        self._pending: collections.deque[Callable[[], None]] = collections.deque()

    def __len__(self) -> int:
        return len(self._pending)

    def set_enabled(self, owner: str, value: bool) -> None:
        """Switch deferral on or off (TE's ``enable/disable_delay_wgrad_compute``); switching
        it off while gradients wait would lose them (ValueError)."""
        if not isinstance(value, bool):
            raise ValueError(f"{owner}: delay_wgrad_compute must be a bool, got {value!r}")
        if not value and self._pending:
            raise ValueError(f"{owner}: delay_wgrad_compute=False while {len(self._pending)} deferred weight "
                             "gradient(s) wait: call backward_dw() first")
        self.enabled = value

    def put(self, work: Callable[[], None]) -> None:
        """Queue one backward pass's weight-gradient work (its operands held until it runs)."""
        self._pending.append(work)

    def run_next(self, owner: str) -> None:
        """Run the oldest queued work; ValueError when none waits."""
        if not self._pending:
            raise ValueError(f"{owner}: no deferred weight gradient is waiting: with delay_wgrad_compute=True "
                             "call backward_dw() once after each backward pass through this op")
        self._pending.popleft()()


class DeferredWgradMixin:
    """Transformer Engine's ``delay_wgrad_compute`` switch for an op that owns a
    :class:`DeferredWgrads` queue (``self._deferred_wgrads``). Each op keeps its own
    ``backward_dw``: what one deferred backward pass computes differs per op."""

    _deferred_wgrads: DeferredWgrads

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether the weight gradients wait for ``backward_dw()`` (see the op's class docs)."""
        return self._deferred_wgrads.enabled

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, value: bool) -> None:
        self._deferred_wgrads.set_enabled(type(self).__name__, value)

    def need_backward_dw(self) -> bool:
        """Transformer Engine's: whether ``backward_dw()`` must run to finish the weight gradients."""
        return self._deferred_wgrads.enabled
