"""Delayed scaling: :class:`DelayedScalingQuantizer` and the once-per-step update of its state.

A delayed-scaling quantizer casts with last step's scale and records this step's amax in
its history; the history and scale are updated once per step by the autocast's amax
reduction (:mod:`~tp_fuse.quantization.amax_reduction`), never by ``quantize``. The update
runs over groups of quantizers whose state lives in shared, statically allocated buffers
(:class:`_SharedDelayedState`): one fused kernel per group and direction, as Transformer
Engine's fused amax-and-scale update does, on addresses CUDA graphs can hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from ... import kernels
from ...recipe import DelayedScaling
from .. import scaling
from ..quantizer import (
    Quantizer,
    amax_abs,
    cast_per_tensor,
    is_backward_role,
    move_state_before_capture,
    new_scale_inv,
    no_grad_if_enabled,
    with_transpose,
)
from .tensor import Float8Tensor

__all__ = ["DelayedScalingQuantizer", "fix_delayed_groups", "update_delayed_quantizers"]


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
            data, data_t, _ = cast_per_tensor(x, self.scale, self.fp8_dtype, transpose=transpose,
                                    amax_out=self.current_amax, scale_inv_out=scale_inv)
        return with_transpose(Float8Tensor.wrap_checked(data, scale_inv, x.dtype), data_t)

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
            data, data_t, _ = cast_per_tensor(x, scale, self.fp8_dtype, transpose=transpose, with_amax=False,
                                    scale_inv_out=scale_inv)
        return with_transpose(Float8Tensor.wrap_checked(data, scale_inv, x.dtype), data_t)

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
        return with_transpose(Float8Tensor.wrap_checked(data, scale_inv, dtype), data_t)

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
        amax = amax_abs(x).to(self.amax_history.device)
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
