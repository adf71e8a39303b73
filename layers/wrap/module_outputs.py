"""The output of every module, in forward order, for ``wrap``'s verification to name the
first one that differs (issue 39, point 4).

A wrong plan makes many tensors differ: the logits, and every gradient -- the first
gradient in parameter order is the embedding's, which says nothing about the plan entry
at fault. The first *module output* that differs, in the order the forward produced
them, is where the error enters: the row projection closing the sharded region that went
wrong (GPT-2's ``attn.c_proj`` after a fused ``c_attn`` split as a plain column), or the
converted module itself.

:class:`ModuleOutputs` records, with forward hooks on every module, each call's output
tensors (detached; ``[2, 8]``-token probes keep this small) keyed by ``(module name,
call index)`` in completion order. :func:`first_difference` walks the wrapped model's
record in that order and compares each output with the original's of the same key;
outputs whose shapes differ are TP-sharded (a column projection's, a head slice) and are
not compared. The plan entries of the converted modules run since the last output that
matched are named with the difference: they produced what went wrong.

A wrapped model that raises on the probe (a shape error: a per-head tensor or a width the
conversion did not reach) is named by :meth:`ModuleOutputs.failure`: the innermost module
it was in, and the plan entries sharding its nearest block that has some.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from .checks import name_pattern
from .trace import output_leaves

__all__ = ["ModuleOutputs", "first_difference"]

Key = tuple[str, int]


class ModuleOutputs:
    """Forward hooks on every module of ``model`` while in use (``with``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[tuple[Key, list[torch.Tensor]]] = []
        self._count: dict[str, int] = {}
        #: The modules entered and not yet left (the innermost last): where a failure was.
        self.stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "ModuleOutputs":
        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._enter(name or "<root>")))
            self._handles.append(m.register_forward_hook(self._hook(name or "<root>")))
        return self

    def _enter(self, name: str) -> Callable[..., None]:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)

        return pre

    def failure(self, error: Exception, plan_entries: dict[str, str]) -> str:
        """The line for a wrapped model whose probe forward (or backward) raised: the
        innermost module it was in (a module left unfinished), and the plan entries
        converted under its nearest ancestor that has some -- they changed a size that
        module still computes with."""
        where = self.stack[-1] if self.stack else "<root>"
        path = where.split(".")
        entries: list[str] = []
        for cut in range(len(path), -1, -1):
            prefix = ".".join(path[:cut])
            entries = [f"{n}: {e}" for n, e in plan_entries.items()
                       if prefix in ("", "<root>") or n == prefix or n.startswith(prefix + ".")]
            if entries:
                block = prefix or "<root>"
                break
        else:
            block = where
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return (f"the wrapped model raised in {where} ({type(error).__name__}: {text}): a size there still counts "
                f"every head or feature the plan now splits over the ranks (a per-head parameter or buffer, a tensor "
                f"built for all heads, a width or head count kept where wrap does not localize it, a width read "
                f"from the module's input, which stays whole: nanoGPT's C = x.size(-1) as n_head * head_dim). "
                f"Plan entries sharding {block}: {'; '.join(entries[:4]) or 'none'}. Exclude {name_pattern(block)!r} (it stays "
                f"replicated) or pass wrap(fixup=f) to set what it keeps to this rank's share")

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            index = self._count.get(name, 0)
            self._count[name] = index + 1
            self.calls.append(((name, index), [t.detach().clone() for _, t in output_leaves(out)]))

        return hook

    def by_key(self) -> dict[Key, list[torch.Tensor]]:
        return dict(self.calls)


def _differs(mine: list[torch.Tensor], ref: list[torch.Tensor], tol: float,
             rel: Callable[[torch.Tensor, torch.Tensor], float]) -> Optional[float]:
    """The largest relative difference above ``tol`` between outputs of the same shapes,
    else None (None too when the shapes say the outputs are sharded)."""
    if len(mine) != len(ref) or any(a.shape != b.shape for a, b in zip(mine, ref)):
        return None
    worst = None
    for a, b in zip(mine, ref):
        if a.is_floating_point() and b.is_floating_point() and (err := rel(a, b)) > tol:
            worst = max(worst or 0.0, err)
    return worst


def first_difference(wrapped: ModuleOutputs, original: dict[Key, list[torch.Tensor]], tol: float,
                     rel: Callable[[torch.Tensor, torch.Tensor], float], plan_entries: dict[str, str]
                     ) -> Optional[str]:
    """The line naming the first module output of the wrapped model (in forward order)
    that differs from the original's, with the plan entries run since the last matching
    output; None when every comparable output matches."""
    since: list[str] = []
    for key, outs in wrapped.calls:
        name = key[0]
        if key not in original:
            continue  # a module wrap put in (the inner layer of an adapter)
        err = _differs(outs, original[key], tol, rel)
        if name in plan_entries and f"{name}: {plan_entries[name]}" not in since:
            since.append(f"{name}: {plan_entries[name]}")
        if err is None:
            if outs and len(outs) == len(original[key]) and all(a.shape == b.shape
                                                                for a, b in zip(outs, original[key])):
                since = []  # matched: what ran before it was right
            continue
        call = f" (call {key[1] + 1})" if key[1] else ""
        entries = "; ".join(since) if since else "none (a module the plan does not convert: see its inputs)"
        return (f"first differing module output in forward order: {name}{call}, max relative difference {err:.2e} "
                f"(tolerance {tol:.0e}); plan entries run since the last matching output: {entries}")
    return None
