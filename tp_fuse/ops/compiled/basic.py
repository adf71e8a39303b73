"""Which basic ops a fusion group traces under ``torch.compile``, and what their compiled forwards share.

Each op that ``torch.compile`` can trace has a ``compiled_forward`` method beside its eager
code (``tp_fuse/ops/basic/*.py``; ``tp_fuse.layers``' TP-region ops too)::

    compiled_forward(self, x, extra_inputs, fp8) -> (y, extra_outputs)

with ``fp8`` the :class:`~tp_fuse.quantization.compile_state.CompileKey` in force (None:
high precision). It is the op's forward written with differentiable torch ops (and, for
the GEMMs, the autograd functions of this package), so that dynamo traces it and
AOTAutograd derives the backward; inductor then fuses the elementwise work around the
GEMMs itself (the eager fuser's hand-written fusions are not used under compile). The
math is the op's documented equations, computed in the same dtypes as its eager kernels
(float32 for narrower inputs, rounded once to the input dtype), so compiled and eager
results agree to rounding.

An op traces when its own class defines ``compiled_forward`` (a subclass, which may
override the math, runs through the eager fuser unless it defines its own) and its
``compiled_unsupported(fp8)`` is None; :func:`unsupported_reason` says which and why.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...quantization.compile_state import CompileKey
from ..basic._checks import compute_dtype
from ..op import BasicOperation

__all__ = ["has_compiled_forward", "in_compute_dtype", "unsupported_reason"]


def has_compiled_forward(op: BasicOperation) -> bool:
    """Whether ``op``'s own class defines ``compiled_forward`` (see the module doc)."""
    return "compiled_forward" in type(op).__dict__


def unsupported_reason(op: BasicOperation, fp8: Optional[CompileKey]) -> Optional[str]:
    """Why ``op`` cannot run in a traced fusion group under ``fp8``, or None when it can."""
    if not has_compiled_forward(op):
        return f"{type(op).__name__} has no traced forward"
    return op.compiled_unsupported(fp8)


def in_compute_dtype(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` evaluated in float32 (float64 for float64 x), rounded once to x's dtype."""
    return fn(x.to(compute_dtype(x.dtype))).to(x.dtype)
