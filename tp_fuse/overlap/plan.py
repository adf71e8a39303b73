"""``OverlapPlan``: what a fused op decided for one GEMM stage (config entry, TP size, methods).

Made by ``ops.fused.userbuffers_common.plan_overlap`` from a window of ops; read by the
Userbuffers fused linears and by ``explain``.
"""

from __future__ import annotations

import dataclasses

from .config import GemmOverlapConfig, TPOverlap
from .method import CONFIG_METHODS, Method


@dataclasses.dataclass
class OverlapPlan:
    """What a matcher decided for one GEMM stage."""

    overlap: TPOverlap
    key: str  # "fc1_fprop", or "column_fprop" for an unnamed GEMM (Megatron's role defaults)
    entry: GemmOverlapConfig
    tp_size: int
    # The overlap methods this window can use (what ``auto`` measures, with "unfused").
    methods: tuple[Method, ...] = CONFIG_METHODS

    def describe(self) -> str:
        """``"fc1_fprop: ring_exchange"`` plus the settings without effect here."""
        ignored = self.entry.ignored()
        tail = f" [ignored: {', '.join(i.split(' (')[0] for i in ignored)}]" if ignored else ""
        if self.entry.method is Method.AUTO:
            return f"{self.key}: auto (measured per shape among {', '.join((*self.methods, Method.UNFUSED))}){tail}"
        return f"{self.key}: {self.entry.describe()}{tail}"

    def auto_lines(self) -> list[str]:
        """For ``explain``: the measured choices of this GEMM stage (``auto`` only)."""
        if self.entry.method is not Method.AUTO:
            return []
        found = self.overlap.tuner.decisions_for(self.key)
        if not found:
            return [f"{self.key}: auto, not decided yet (measured at the first call with a new shape)"]
        return [d.describe() for d in found]
