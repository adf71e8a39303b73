"""Checks on delayed-scaling FP8 state loaded from a checkpoint (an untrusted source).

A delayed-scaling quantizer casts this step with the scale computed from its amax
history. Loaded state that no training run can produce poisons a whole history length
of steps without any error: an inf scale saturates every cast, a 3e38 amax in the
history makes the scale ~1e-36 so every value underflows to zero, a NaN freezes the
scale. The loss then looks merely worse (5.17 instead of 4.90 in the issue's run). So,
at load, for every field (the message names the key and the first bad value):

* ``scale``: finite and a normal positive float32 (``scale_inv = 1 / scale`` is what the
  GEMM multiplies by; it must be finite and non-zero too);
* ``amax_history``, ``last_amax``: finite, ``>= 0`` and at most :data:`MAX_AMAX` (2**64):
  a tensor with larger values overflows float32 when squared, so its norm, variance and
  gradient norm are inf and the run's non-finite guard would have stopped it;
* ``nonfinite_amax_count``: ``>= 0``;
* recipe fields stored beside the state (:func:`check_recipe_fields`): ``margin`` an int
  in ``[0, 64]`` (``2**margin`` of headroom; more flushes every scale to zero),
  ``amax_history_len`` an int in ``[1, MAX_HISTORY_LEN]``, ``reduce_amax`` a bool.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["MAX_AMAX", "MAX_HISTORY_LEN", "MAX_MARGIN", "check_delayed_state", "check_recipe_fields",
           "delayed_state_problem", "first_bad_value"]

#: Largest amax a checkpoint may hold: sqrt(float32 max) ~ 1.8e19 (see the module docstring).
MAX_AMAX = 2.0 ** 64
#: Longest amax history accepted from a checkpoint (Transformer Engine's default is 1024).
MAX_HISTORY_LEN = 1 << 20
#: Largest recipe margin accepted from a checkpoint.
MAX_MARGIN = 64
_TINY = torch.finfo(torch.float32).tiny


def first_bad_value(t: torch.Tensor, bad: torch.Tensor) -> str:
    """``"inf"`` or ``"[3] = 3e+38"``: the first element of ``t`` where ``bad`` is true."""
    i = int(bad.reshape(-1).nonzero()[0, 0])
    value = t.reshape(-1)[i].item()
    text = format(value, ".6g") if isinstance(value, float) else repr(value)
    return text if t.dim() == 0 else f"[{i}] = {text}"


def delayed_state_problem(field: str, value: Any) -> str | None:
    """What is wrong with one field of a delayed-scaling quantizer's state (None: nothing).

    ``field`` is the state's name (``scale``, ``amax_history``, ``last_amax`` or
    ``nonfinite_amax_count``); other names are not checked.
    """
    if not isinstance(value, torch.Tensor):
        return f"expected a tensor, got {type(value).__name__}"
    t = value.detach()
    if t.numel() == 0:
        return None
    if field == "nonfinite_amax_count":
        if t.is_floating_point():
            bad = ~torch.isfinite(t) | (t < 0)
        else:
            bad = t < 0
        if bool(bad.any()):
            return f"is {first_bad_value(t, bad)}: a counter must be >= 0"
        return None
    if field not in ("scale", "amax_history", "last_amax"):
        return None
    t = t.float()
    if field == "scale":
        bad = ~torch.isfinite(t) | (t < _TINY)
        if bool(bad.any()):
            return (f"is {first_bad_value(t, bad)}: an FP8 scale must be finite and > 0 (a normal float32, so that "
                    "scale_inv = 1/scale is finite)")
        return None
    bad = ~torch.isfinite(t) | (t < 0) | (t > MAX_AMAX)
    if bool(bad.any()):
        return (f"is {first_bad_value(t, bad)}: an FP8 amax must be finite, >= 0 and <= 2**64 (a larger value overflows "
                "float32 when squared; no finite training run records it)")
    return None


def check_delayed_state(values: Mapping[str, Any], where: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error("<where>/<field> ...")`` for the first field of ``values`` that is out of range.

    Args:
        values: ``{field: tensor}`` of one quantizer (see :func:`delayed_state_problem`).
        where: how the message names the quantizer, e.g. its checkpoint key prefix.
        error: the exception class (``CheckpointError`` in the launcher).
    """
    for field, value in values.items():
        problem = delayed_state_problem(field, value)
        if problem is not None:
            raise error(f"{where}{field} {problem}")


def _int_in(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def check_recipe_fields(fields: Mapping[str, Any], where: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming ``<where>.<field>`` if a stored DelayedScaling field is out of range."""
    checks = {
        "margin": (lambda v: _int_in(v, 0, MAX_MARGIN), f"an int in [0, {MAX_MARGIN}]"),
        "amax_history_len": (lambda v: _int_in(v, 1, MAX_HISTORY_LEN), f"an int in [1, {MAX_HISTORY_LEN}]"),
        "reduce_amax": (lambda v: isinstance(v, bool), "a bool"),
    }
    for key, (ok, expected) in checks.items():
        if key in fields and not ok(fields[key]):
            raise error(f"{where}.{key} is {fields[key]!r}, expected {expected}")
