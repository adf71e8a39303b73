"""The delayed-scaling update of many quantizers at once: one kernel per direction per step.

Every delayed-scaling quantizer that updates together keeps its state in rows of stacked
buffers (``tp_fuse.quantization.quantizer``'s shared state)::

    hist       [n, L]  fp32   amax history, slot 0 = this step's amax (maxed in by the casts)
    scale      [n]     fp32   quantization scale (fp8 = x * scale)
    last_amax  [n]     fp32   the amax the last update used
    count      [n]     int64  updates whose slot-0 amax was NaN/inf
    fp8_max    [n]     float64  per row: largest value of the row's FP8 dtype
    pow2_margin [n]    float64  per row: 2**margin
    most_recent [n]    bool   per row: amax_compute_algo == "most_recent" (else "max")

``delayed_scale_update`` does, for every row, what ``DelayedScalingQuantizer.update``
does for one quantizer (Transformer Engine's fused amax-and-scale update):

1. a NaN/inf slot-0 amax is counted and replaced by 0 ("no data");
2. ``amax`` = slot 0 (``most_recent``) or the max over the history (``max``);
3. ``scale = (fp8_max / amax) / 2**margin`` in float64, clamped to the fp32 range and
   rounded to fp32 once, when ``amax > 0``; else the previous scale;
4. ``last_amax = amax``; the history rolls left by one and slot 0 is zeroed.

Torch reference (any device; a dozen small ops) and a Triton kernel (CUDA: one launch,
one program per row), bit-identical. Everything is updated in place: the buffers are
allocated once and never rebound (CUDA graphs and compiled steps hold their addresses).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import dispatch

__all__ = ["delayed_scale_update"]

_FP32_MAX = float(torch.finfo(torch.float32).max)


def delayed_scale_update(
    hist: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    count: torch.Tensor,
    fp8_max: torch.Tensor,
    pow2_margin: torch.Tensor,
    most_recent: torch.Tensor,
    *,
    any_margin: bool,
    any_most_recent: bool,
    all_most_recent: bool,
    backend: Optional[str] = None,
) -> None:
    """Update every row's scale from its amax history, in place (see the module doc).

    ``any_margin`` / ``any_most_recent`` / ``all_most_recent`` summarize the per-row
    constants (decided once when the rows are stacked), so that the torch path skips the
    ops no row needs. On CUDA one kernel launch.
    """
    assert hist.dim() == 2 and hist.dtype == torch.float32 and hist.is_contiguous(), "hist: [n, L] fp32"
    choice = dispatch.select_backend("delayed_scale_update", hist.device, backend)
    if choice.backend == "torch":
        _update_torch(hist, scale, last_amax, count, fp8_max, pow2_margin, most_recent,
                      any_margin, any_most_recent, all_most_recent)
        variant = "reference"
    else:
        from . import scale_update_triton  # triton only when a Triton path is taken

        variant = scale_update_triton.delayed_scale_update_triton(
            hist, scale, last_amax, count, fp8_max, pow2_margin, most_recent,
            any_margin=any_margin, any_most_recent=any_most_recent, all_most_recent=all_most_recent,
        )
    dispatch.log_call("delayed_scale_update", choice, variant, hist.device)


def _update_torch(
    hist: torch.Tensor,
    scale: torch.Tensor,
    last_amax: torch.Tensor,
    count: torch.Tensor,
    fp8_max: torch.Tensor,
    pow2_margin: torch.Tensor,
    most_recent: torch.Tensor,
    any_margin: bool,
    any_most_recent: bool,
    all_most_recent: bool,
) -> None:
    current = hist[:, 0]  # [n] view: this step's slots
    # finite <=> |x| < inf (NaN compares false): two cheap ops where torch.isfinite
    # is a composite of four on CPU; this runs twice per step.
    bad_current = ~(current.abs() < math.inf)
    current.masked_fill_(bad_current, 0.0)
    # From here the history holds only finite values (slot 0 just sanitized, the others
    # earlier slot-0 values, loaded states checked by check_delayed_state), so amax is
    # finite: update()'s non-finite-amax test is always false here.
    if all_most_recent:
        amax = current
    elif any_most_recent:
        amax = torch.where(most_recent, current, hist.amax(dim=1))
    else:
        amax = hist.amax(dim=1)
    # (fp8_max / amax) / 2**margin in float64 when amax > 0, else the previous scale;
    # clamped to the fp32 range.
    amax64 = amax.to(torch.float64)
    usable = amax64 > 0
    new = fp8_max / amax64  # inf where amax is 0: discarded by the where() below
    if any_margin:  # dividing by 2**0 = 1 is exact: skipped
        new = new / pow2_margin
    # (where promotes the fp32 scale to float64 exactly; copy_ rounds the new one once)
    scale.copy_(torch.where(usable, new.clamp_(max=_FP32_MAX), scale))
    count.add_(bad_current)
    last_amax.copy_(amax)
    # Roll every row left by one (slot 0 goes last), then zero the new slot 0.
    hist.copy_(torch.roll(hist, -1, 1))
    current.zero_()
