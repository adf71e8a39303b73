"""``wrap()`` checks that look at the model as a whole, and the shape of its error message.

* :func:`collapse` -- one line per distinct problem: lines that differ only in the
  layer / expert indices of module names (``decoder.layers.3.mlp...``) become one line
  with ``*`` and ``(N modules)``, so a real model's refusal is readable (a 64-expert,
  48-layer MoE gave thousands of lines).
* :func:`expert_problems` -- megatron-core MoE expert layers (``is_expert`` /
  ``explicit_expert_comm``): one line for all of them that names the ``exclude`` glob
  that works (megatron-core keeps its own expert parallelism for them).
* :func:`tied_problems` -- a plan that shards one module of a weight tie (``lm_head``
  tied to ``embed_tokens``): sharding one side makes a new, sharded ``Parameter`` and
  silently unties them (``lm_head`` ``[V/tp, h]`` while the embedding stays ``[V, h]``).
* :func:`attention_converted` -- whether a plan shards any attention projection (a
  family's head checks then apply to an explicit plan too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["collapse", "expert_problems", "tied_problems", "attention_converted", "name_pattern"]

# A numeric component of a module path (``layers.3`` / ``h.0`` / ``local_experts.12``),
# not a decimal number in the message (``0.5``): a letter or underscore before the dot.
_INDEX = re.compile(r"(?<=[A-Za-z_])\.\d+(?=[.:'\"\s,\]\)]|$)")


def name_pattern(text: str) -> str:
    """``text`` with the numeric components of module paths replaced by ``*``."""
    return _INDEX.sub(".*", text)


def collapse(lines: Iterable[str]) -> list[str]:
    """One line per distinct problem, in first-seen order: a line that several modules
    share is given once with ``*`` for the indices and ``(N modules)``; a line that only
    one module has is kept as it is."""
    groups: dict[str, list[str]] = {}
    for line in lines:
        groups.setdefault(name_pattern(line), []).append(line)
    return [same[0] if len(same) == 1 else f"{key} ({len(same)} modules)" for key, same in groups.items()]


def expert_problems(experts: Mapping[str, list[str]]) -> list[str]:
    """``experts``: ``{module name: its expert flags set}`` for megatron-core expert
    layers. One line naming the flags, the layers (as patterns) and the exclude that
    works: the nearest ancestor called ``experts`` (else the expert layer itself)."""
    if not experts:
        return []
    flags = sorted({f for fs in experts.values() for f in fs})
    layers = sorted({name_pattern(n) for n in experts})
    globs = []
    for name in experts:
        parts = name.split(".")
        cut = max((i for i, p in enumerate(parts) if p == "experts"), default=len(parts) - 1)
        glob = name_pattern(".".join(parts[:cut + 1]))
        if glob not in globs:
            globs.append(glob)
    return [f"{', '.join(layers)}: {' / '.join(f'{f}=True' for f in flags)} is not supported "
            f"({len(experts)} megatron-core MoE expert layers: their tokens are routed per expert); pass "
            f"exclude={globs!r} to leave the experts to megatron-core's own tensor/expert parallelism and convert "
            f"the rest of the model"]


def tied_problems(model: torch.nn.Module, planned: Mapping[str, Any]) -> list[str]:
    """Planned GEMM modules whose weight or bias is the same ``Parameter`` as another
    module's (``named_parameters(remove_duplicate=False)`` lists it under both names)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    problems = []
    for mod_name, style in planned.items():
        if style == "sequence_parallel":
            continue
        m = model.get_submodule(mod_name)
        for attr in ("weight", "bias"):
            p = getattr(m, attr, None)
            if not isinstance(p, torch.nn.Parameter):
                continue
            mine = f"{mod_name}.{attr}"
            others = [n for n in owners.get(id(p), []) if n != mine]
            if others:
                tie = "config.tie_word_embeddings=True" if "embed" in " ".join(others) else "a shared Parameter"
                problems.append(
                    f"{mod_name}: its {attr} is tied to {', '.join(others)} (the same Parameter, {tie}); sharding "
                    f"{mod_name} alone would untie them (a new {tuple(p.shape)} -> 1/tp sharded weight while "
                    f"{others[0]} keeps the full one). Remove {mod_name!r} from the plan, or untie the weights "
                    f"before wrap")
    return problems


def attention_converted(model: torch.nn.Module, columns: Iterable[str]) -> bool:
    """Whether any of ``columns`` sits in an attention module (class name contains
    ``Attention``, or the module path ``attn`` / ``attention``)."""
    for name in columns:
        parent = name.rpartition(".")[0]
        cls = type(model.get_submodule(parent)).__name__ if parent else ""
        if "Attention" in cls or re.search(r"attn|attention", parent, re.IGNORECASE):
            return True
    return False
