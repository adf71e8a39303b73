"""Transformer Engine's grouped-MLP window ``[GroupedLinear, Scaled*, GroupedLinear]``:
reported, not fused.

Transformer Engine fuses this window (``GroupedMLP_CuTeGEMMGLU`` / ``..Unary``) with cuDNN
frontend grouped-GEMM kernels that exist only for CUDA sm100 with MXFP8/NVFP4 (and bf16)
operands. tp_fuse has no such kernel, so the three ops run as they are; this matcher only
records that decision, so that ``explain`` says why the window a Transformer Engine user
expects to fuse did not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from ..basic.grouped_linear import GroupedLinear
from ..basic.scaled_activations import _ScaledActivation
from ..fusion import FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusibleOperation

REASON = (
    "Transformer Engine fuses GroupedLinear, {act}, GroupedLinear with cuDNN grouped-GEMM "
    "kernels for CUDA sm100 only; tp_fuse has no fused grouped MLP, the three ops run unfused"
)


def fuse_grouped_mlp(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Record ``[GroupedLinear, Scaled*, GroupedLinear]`` windows as not fused (see above)."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        if len(window) < 3 or not isinstance(window[0], GroupedLinear):
            return None
        if isinstance(window[1], _ScaledActivation) and isinstance(window[2], GroupedLinear):
            return Reject(REASON.format(act=type(window[1]).__name__), 3)
        return None

    return fuse_by_window(ops, matcher, fusion_log)
