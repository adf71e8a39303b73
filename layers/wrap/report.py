"""What ``wrap()`` did to a model: converted modules, modules left as they are, and why."""

from __future__ import annotations

import dataclasses

__all__ = ["WrapReport"]


@dataclasses.dataclass
class WrapReport:
    """Returned by ``wrap(..., report=True)`` and stored as ``model.tp_fuse_wrap_report``.

    Attributes:
        converted: ``(module name, how)``, e.g. ``("decoder.layers.0.mlp.linear_fc1",
            "Megatron column-parallel, [gate; up] blocks=2")``.
        left: ``(module name, why)`` for the linear-like modules not converted: excluded by
            the caller, or not named by the plan (they stay replicated and run unsharded).
        family: the Hugging Face ``model_type`` whose built-in plan was used, or None.
    """

    converted: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    left: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    family: str | None = None

    def __str__(self) -> str:
        lines = [f"wrap: converted {len(self.converted)} module(s)"
                 + (f" (plan for model_type {self.family!r})" if self.family else "") + ":"]
        lines += [f"  + {name}: {how}" for name, how in self.converted]
        lines.append(f"left as they are: {len(self.left)} module(s):")
        lines += [f"  - {name}: {why}" for name, why in self.left]
        return "\n".join(lines)
