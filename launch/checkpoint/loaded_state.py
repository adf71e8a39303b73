"""Range checks on a checkpoint's tensors after DCP loaded them, before they reach the model.

A checkpoint is untrusted input (``launch.safe_dcp`` keeps it from running code); this
keeps it from *poisoning* a run that then reports success. Per key of the loaded state
dict (``tp_fuse.launch.checkpoint.manager`` lists the keys):

* ``rank<r>/fp8/<module>/<role>/<field>``: delayed-scaling FP8 state, checked by
  :func:`tp_fuse.quantization.state_check.delayed_state_problem` (finite positive scales;
  finite amaxes in ``[0, 2**64]``; counters ``>= 0``). An inf scale with a 3e38 history
  otherwise trains at a worse loss for a whole history length, exit 0, no warning.
* ``train/step``, ``train/consumed_samples``, ``optim/<param>/step``: ``>= 0`` (finite).
* ``model/<param>``, ``optim/<param>/exp_avg``: finite; ``optim/<param>/exp_avg_sq``:
  finite and ``>= 0`` (tp-fuse never saves non-finite state; such a checkpoint was
  altered, and resuming it would only skip steps until the run stops as diverged).

The message names the key and the first bad value.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from tp_fuse.quantization.state_check import delayed_state_problem, first_bad_value

__all__ = ["loaded_state_problem"]


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _problem(key: str, value: Any) -> Optional[str]:
    if "/fp8/" in key:
        return delayed_state_problem(key.rsplit("/", 1)[1], value)
    t = _local(value)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    t = t.detach()
    counter = key in ("train/step", "train/consumed_samples") or (key.startswith("optim/") and key.endswith("/step"))
    if counter:
        bad = t < 0
        if t.is_floating_point():
            bad = bad | ~torch.isfinite(t)
        return f"is {first_bad_value(t, bad)}: a counter must be >= 0" if bool(bad.any()) else None
    if not t.is_floating_point():
        return None
    bad = ~torch.isfinite(t)
    if key.endswith("/exp_avg_sq"):
        bad = bad | (t < 0)
    return f"is {first_bad_value(t, bad)}: expected finite values (tp-fuse never saves others)" if bool(bad.any()) else None


def loaded_state_problem(sd: dict[str, Any]) -> Optional[str]:
    """``"<key> is <value>: <why>"`` for the first out-of-range entry of ``sd``, or None."""
    for key in sorted(sd):
        problem = _problem(key, sd[key])
        if problem is not None:
            return f"{key} {problem}"
    return None
