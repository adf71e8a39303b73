"""Triton kernel of ``scale_update.delayed_scale_update`` (semantics documented there).

One program per quantizer row: it reads the row's whole history into registers (``L``
rounded up to a power of two), computes the new scale in float64 exactly as the torch
reference does, and writes scale, last amax, counter and the rolled history back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import pow2

_FP32_MAX = float(torch.finfo(torch.float32).max)


@triton.jit
def _delayed_update_kernel(
    hist_ptr, scale_ptr, last_ptr, count_ptr, fp8_max_ptr, margin_ptr, recent_ptr, L, fp32_max,
    ALGO: tl.constexpr,  # 0: every row "max", 1: every row "most_recent", 2: per row
    MARGIN: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_L)
    in_row = offs < L
    base = hist_ptr + row * L
    h = tl.load(base + offs, mask=in_row, other=0.0)
    current = tl.load(base)
    # A NaN/inf amax ("no data") is counted and dropped: |x| < inf is False for NaN too.
    bad = ~(tl.abs(current) < float("inf"))
    current = tl.where(bad, 0.0, current)
    # The history holds only finite values >= 0 once slot 0 is sanitized: a float max is exact.
    h = tl.where(offs == 0, current, h)
    if ALGO == 1:
        amax = current
    else:
        amax = tl.max(h, axis=0)
        if ALGO == 2:
            amax = tl.where(tl.load(recent_ptr + row) != 0, current, amax)
    amax64 = amax.to(tl.float64)
    # float64 division lowers to PTX div.rn.f64 (IEEE, correctly rounded: the torch
    # reference's); tl.div_rn exists for fp32 only, whose plain "/" is approximate.
    new = tl.load(fp8_max_ptr + row) / amax64
    if MARGIN:
        new = new / tl.load(margin_ptr + row)
    new = tl.minimum(new, fp32_max)
    old = tl.load(scale_ptr + row)
    tl.store(scale_ptr + row, tl.where(amax64 > 0, new.to(tl.float32), old))
    tl.store(last_ptr + row, amax)
    tl.store(count_ptr + row, tl.load(count_ptr + row) + bad.to(tl.int64))
    # Roll left by one: slot j takes slot j + 1, the last slot takes this step's amax,
    # and slot 0 starts the next step at 0 (every load above precedes these stores).
    shifted = tl.load(base + offs + 1, mask=offs + 1 < L, other=0.0)
    rolled = tl.where(offs == L - 1, current, shifted)
    tl.store(base + offs, tl.where(offs == 0, 0.0, rolled), mask=in_row)


def delayed_scale_update_triton(
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
) -> str:
    """One launch over every row; returns the kernel-log variant. Arguments as the caller's."""
    n, length = hist.shape
    algo = 1 if all_most_recent else (2 if any_most_recent else 0)
    if n > 0:
        _delayed_update_kernel[(n,)](
            hist, scale, last_amax, count, fp8_max, pow2_margin, most_recent, length, _FP32_MAX,
            ALGO=algo, MARGIN=any_margin, BLOCK_L=pow2(length), num_warps=4,
        )
    return "rows"
