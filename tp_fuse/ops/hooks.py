"""Hooks that packages above the op layer register into.

The op layer calls these hooks; it never imports the packages that provide them, so the
import graph stays one-way (``tp_fuse.debug`` -> ``tp_fuse.ops``, never back). Today one kind
of hook exists:

* **first forward of a GEMM op** (:func:`register_first_forward_hook`): run by
  ``BasicLinear.pre_first_fuser_forward``, before the fuser decides its fusions. The debug
  package registers the join to nvdlfw-inspect's debug API there
  (``tp_fuse.debug.inspect_api``): a GEMM with debug features must stay out of fusions.

A hook is a plain callable taking the op; it decides itself whether it applies (e.g. whether
the debug API is initialized). Registering the same callable twice keeps one entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["FirstForwardHook", "first_forward_hooks", "register_first_forward_hook", "run_first_forward_hooks"]

FirstForwardHook = Callable[[Any], None]

_FIRST_FORWARD: list[FirstForwardHook] = []


def register_first_forward_hook(hook: FirstForwardHook) -> FirstForwardHook:
    """Run ``hook(op)`` at every GEMM op's first forward pass; returns ``hook`` (a decorator)."""
    if not callable(hook):
        raise ValueError(f"register_first_forward_hook: expected a callable, got {hook!r}")
    if hook not in _FIRST_FORWARD:
        _FIRST_FORWARD.append(hook)
    return hook


def first_forward_hooks() -> tuple[FirstForwardHook, ...]:
    """The registered first-forward hooks, in registration order."""
    return tuple(_FIRST_FORWARD)


def run_first_forward_hooks(op: Any) -> None:
    """Call every registered first-forward hook on ``op`` (nothing registered: nothing runs)."""
    for hook in _FIRST_FORWARD:
        hook(op)
