"""Names of a model's GEMM layers, shared by debug configs and FP8 statistics.

Every ``BasicLinear`` gets ``(layer, gemm)``: ``layer`` is its module path up to and
including the first numeric component (the transformer-layer index, e.g.
``"layers.3"``), or its parent path when there is none; ``gemm`` is the op's
``comm_name`` (``qkv``, ``proj``, ``fc1``, ``fc2``) when it has one, else the rest of
the path. The debug layer name is ``f"{layer}.{gemm}"`` (``"layers.3.fc1"``), and FP8
statistics are logged as ``fp8/<layer>/<gemm>/<tensor>/<stat>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from .hooks import LinearDebugHooks
from ..ops.basic.basic_linear import BasicLinear

__all__ = ["LinearName", "hooks_for", "name_linears"]


@dataclasses.dataclass(frozen=True)
class LinearName:
    """Where one ``BasicLinear`` sits in the model."""

    qualname: str
    layer: str
    gemm: str
    op: Any

    @property
    def layer_name(self) -> str:
        return f"{self.layer}.{self.gemm}" if self.layer else self.gemm


def _split(qualname: str, comm_name: Optional[str]) -> tuple[str, str]:
    parts = qualname.split(".") if qualname else []
    for i, p in enumerate(parts):
        if p.isdigit():
            layer, rest = ".".join(parts[: i + 1]), parts[i + 1 :]
            break
    else:
        layer, rest = ".".join(parts[:-1]), parts[-1:]
    gemm = comm_name or ".".join(rest) or "linear"
    return layer, gemm


def name_linears(model: torch.nn.Module) -> list[LinearName]:
    """Every ``BasicLinear`` of ``model`` with its ``(layer, gemm)`` name, in module order.

    Names are unique: if two ops would share one (e.g. two GEMMs with the same
    ``comm_name`` in one layer), their full module paths are used instead.
    """

    found = []
    seen: set[int] = set()
    for qualname, module in model.named_modules():
        if isinstance(module, BasicLinear) and id(module) not in seen:
            seen.add(id(module))
            found.append((qualname, module))
    names = [_split(q, m.comm_name) for q, m in found]
    counts: dict[tuple[str, str], int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    out = []
    for (qualname, module), (layer, gemm) in zip(found, names):
        if counts[(layer, gemm)] > 1:
            layer, gemm = _split(qualname, None)
            layer, gemm = (layer, gemm) if layer else ("", qualname or "linear")
        out.append(LinearName(qualname=qualname, layer=layer, gemm=gemm, op=module))
    return out


def hooks_for(name: LinearName, tp_group: Optional[dist.ProcessGroup]) -> LinearDebugHooks:
    """The op's hooks object, created on first use (a session and a collector share it)."""
    hooks = getattr(name.op, "debug_hooks", None)
    if hooks is None:
        hooks = LinearDebugHooks(name.layer, name.gemm, tp_group)
        name.op.debug_hooks = hooks
    elif hooks.layer_name != name.layer_name:
        raise ValueError(
            f"{name.qualname}: already attached as {hooks.layer_name!r} (another model?); "
            f"now named {name.layer_name!r}"
        )
    if tp_group is not None:
        hooks.tp_group = tp_group
    return hooks
