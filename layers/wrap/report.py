"""What ``wrap()`` did to a model: converted modules, modules left as they are, and why."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .checks import name_pattern

__all__ = ["WrapReport"]


def _grouped(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Entries that differ only in layer indices, once (``model.layers.*.self_attn``, ``x2``)."""
    counts: dict[tuple[str, str], int] = {}
    for name, how in entries:
        key = (name_pattern(name), name_pattern(how))
        counts[key] = counts.get(key, 0) + 1
    return [(name if n == 1 else f"{name} (x{n})", how) for (name, how), n in counts.items()]


@dataclasses.dataclass
class WrapReport:
    """Returned by ``wrap(..., report=True)`` and stored as ``model.tp_fuse_wrap_report``.

    Attributes:
        converted: ``(module name, how)``, e.g. ``("decoder.layers.0.mlp.linear_fc1",
            "Megatron column-parallel, [gate; up] blocks=2")``.
        left: ``(module name, why)`` for the linear-like modules not converted: excluded by
            the caller, or not named by the plan (they stay replicated and run unsharded).
        localized: ``(attention module, changes)``: head counts / widths stored on the
            module set to this rank's (``tp_fuse.layers.wrap.heads``), e.g. ``"num_heads 4 -> 2"``.
        synced: ``(parameter name, why)``: replicated parameters used on TP-sharded
            activations, whose gradient is summed over TP (``tp_fuse.layers.wrap.trace``).
        traced: how those were found when not on a probe before conversion.
        verified: set when the wrapped model was compared with the original on a probe
            (the default whenever wrap shards anything), with the comparison's cost.
        verify_seconds: what that comparison cost, in seconds.
        unverified: why a wrap that shards modules did not verify them (no automatic
            probe, ``verify=False``).
        family: the Hugging Face ``model_type`` whose built-in plan (or checks and fix-ups,
            with an explicit plan) was used, or None.
    """

    converted: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    left: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    localized: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    synced: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    traced: Optional[str] = None
    verified: Optional[str] = None
    verify_seconds: Optional[float] = None
    unverified: Optional[str] = None
    family: str | None = None

    def __str__(self) -> str:
        lines = [f"wrap: converted {len(self.converted)} module(s)"
                 + (f" (plan for model_type {self.family!r})" if self.family else "") + ":"]
        lines += [f"  + {name}: {how}" for name, how in self.converted]
        lines.append(f"left as they are: {len(self.left)} module(s):")
        lines += [f"  - {name}: {why}" for name, why in self.left]
        if self.localized:
            lines.append("attention attributes set to this rank's heads:")
            lines += [f"  ~ {name}: {how}" for name, how in _grouped(self.localized)]
        if self.synced:
            lines.append(f"replicated parameters with gradients summed over TP: {len(self.synced)}:")
            lines += [f"  ~ {name}: {how}" for name, how in _grouped(self.synced)]
        if self.traced:
            lines.append(f"sharded-activation trace: {self.traced}")
        if self.verified:
            lines.append(f"verified: {self.verified}")
        if self.unverified:
            lines.append(f"NOT verified: {self.unverified}")
        return "\n".join(lines)
