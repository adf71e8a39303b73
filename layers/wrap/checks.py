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
* :func:`sequence_parallel_problems` -- ``sequence_parallel=True`` for plan modules of a
  model that embeds token ids itself (a Hugging Face model, torchtitan's Llama, nanoGPT):
  its activations are ``[batch, seq, hidden]`` and whole on every rank, while sequence
  parallelism splits dim 0 of the plan modules' inputs (Megatron's ``[seq, batch,
  hidden]``, the sequence scattered before the first of them). Nothing in such a model
  scatters it (nor slices its residual stream or rotary tables by position): the column
  projections all-gather dim 0, the batch, and the attention's reshape fails or mixes
  sequences.
* :func:`attention_converted` -- whether a plan shards any attention projection (a
  family's head checks then apply to an explicit plan too).
* :func:`replicated_norm_check` -- for the trace (``tp_fuse.layers.wrap.trace``): a
  LayerNorm/RMSNorm-like module over the full width of a projection the plan shards,
  entered with a TP-sharded input but left replicated. Each rank would normalise only its
  slice of the features with that slice's statistics: a shape error at best (the weight
  or ``normalized_shape`` is full width), wrong numbers silently at worst (a norm that
  broadcasts or has no weight). It must be sharded with the features (plan style
  ``"sharded_norm"``, RMSNorms) or its block left unsharded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional

import torch

from .probe import token_input

__all__ = ["collapse", "expert_problems", "tied_problems", "sequence_parallel_problems", "attention_converted",
           "name_pattern",
           "norm_width", "replicated_norm_check"]

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


def sequence_parallel_problems(model: torch.nn.Module, planned: Mapping[str, Any], entries: Mapping[str, str],
                               sequence_parallel: Optional[bool]) -> list[str]:
    """``sequence_parallel=True`` with plan projections (``planned``: ``{module name:
    style}``; ``entries``: their plan entries as written) on a model that embeds token
    ids itself: one line naming the plan's ``"sequence_parallel"`` entries and what to
    write instead."""
    tokens = token_input(model) if sequence_parallel else None
    if tokens is None or all(s in ("sequence_parallel", "sharded_norm") for s in planned.values()):
        return []
    marked = sorted({entries[n] for n, s in planned.items() if s == "sequence_parallel"})
    what = ", ".join(marked) if marked else "the plan"
    return [f"{what} with wrap(sequence_parallel=True): sequence parallelism splits the sequence along dim 0 of the "
            f"plan modules' inputs (Megatron's [seq, batch, hidden], scattered before the first of them), but "
            f"{type(model).__name__} embeds token ids itself ({tokens.embedding}): its activations are [batch, seq, "
            f"hidden], whole on every rank, and nothing in it scatters them (nor slices the residual stream or the "
            f"rotary tables by position), so the column projections would all-gather the batch. Write "
            f"wrap(..., sequence_parallel=False): the same plan shards the same projections"
            + (" and keeps the 'sequence_parallel' norms replicated" if marked else "")]


def attention_converted(model: torch.nn.Module, columns: Iterable[str]) -> bool:
    """Whether any of ``columns`` sits in an attention module (class name contains
    ``Attention``, or the module path ``attn`` / ``attention``)."""
    for name in columns:
        parent = name.rpartition(".")[0]
        cls = type(model.get_submodule(parent)).__name__ if parent else ""
        if "Attention" in cls or re.search(r"attn|attention", parent, re.IGNORECASE):
            return True
    return False


# Norms over something else than the last (feature) dim: batch / instance / group norms
# normalise per channel (dim 1), a TP-sharded feature dim is not what they reduce over.
_OTHER_NORMS: tuple[type, ...] = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm,
                                  torch.nn.LocalResponseNorm)


def norm_width(m: torch.nn.Module) -> Optional[int]:
    """The number of features a LayerNorm/RMSNorm-like module normalises over, or None if
    ``m`` is not one (or its width cannot be read).

    Norm-like: ``nn.LayerNorm`` / ``nn.RMSNorm``, or any class whose name contains
    ``Norm`` (Hugging Face ``LlamaRMSNorm``, ``Olmo2RMSNorm``, Apex/Megatron fused norms)
    other than the batch/instance/group norms. Its width: a one-dimensional
    ``normalized_shape`` (torch's norms, with or without a weight), else a one-dimensional
    ``weight`` (Hugging Face RMSNorms keep no shape besides it).
    """
    if isinstance(m, _OTHER_NORMS) or "Norm" not in type(m).__name__:
        return None
    shape = getattr(m, "normalized_shape", None)
    if isinstance(shape, int) and not isinstance(shape, bool):
        return shape
    if isinstance(shape, (tuple, list, torch.Size)):
        # Over several dims (nn.LayerNorm((heads, head_dim))): not a width to compare.
        return int(shape[0]) if len(shape) == 1 else None
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        return int(w.shape[0])
    return None


def replicated_norm_check(widths: Mapping[int, list[str]], tp: int, shardable: Callable[[torch.nn.Module], bool],
                          shardable_names: Iterable[str] = ()
                          ) -> Callable[[str, torch.nn.Module, torch.Tensor, bool], Optional[str]]:
    """A ``module_check`` for the trace: the problem line for a replicated norm entered
    with a TP-sharded input ``x`` whose width is the full width of a sharded projection.

    ``widths``: ``{full output width: the column-parallel modules with it}`` (a fused
    projection's parts too); the message names the one nearest the norm (longest common
    module path: the same layer's projection, not layer 0's). The norm is flagged when
    its width is one of them AND ``x``'s last dim is that width (the original model) or
    its ``1/tp`` slice (the wrapped model): the sharded features are then, as far as
    shapes tell (the trace does not follow which dim is sharded), the ones it normalises.
    A per-head norm (Qwen3's ``q_norm``, ``[head_dim]`` on ``[.., heads, head_dim]``
    sharded by heads) has a width no projection has (every rank holds whole heads, so
    ``heads * head_dim > head_dim``), and stays replicated with its gradient summed (the
    trace's sync).
    ``shardable(m)``: whether plan style ``"sharded_norm"`` can convert ``m``
    (``shardable_names``: those classes, for the message).
    """

    def check(name: str, m: torch.nn.Module, x: torch.Tensor, local: bool) -> Optional[str]:
        width = norm_width(m)
        if width is None or width not in widths or x.dim() == 0:
            return None
        if x.shape[-1] != (width // tp if local else width):
            return None
        if x.dim() >= 4:
            # [batch, seq, heads, dim] (or heads before seq): a norm over each head's (or
            # head pair's: DiffLlama's groupnorm) features whose width happens to equal a
            # projection's, not one over the projection's whole output ([batch, seq, width]).
            return None
        column = max(widths[width], key=lambda c: (_common_prefix(c, name), -widths[width].index(c)))
        cls = type(m).__name__
        why = (f"{name}: this {cls} normalises over {width} features, the full output width of {column}, which the "
               f"plan shards; its input is TP-sharded but the plan leaves it replicated, so each rank would "
               f"normalise only its own {width // tp} features with their statistics alone (wrong numbers, or a "
               f"shape error). ")
        if shardable(m):
            return why + (f"Add {name_pattern(name)!r} to the plan as 'sharded_norm' (weight split with the "
                          f"features, statistics summed over TP)")
        supported = ", ".join(["nn.RMSNorm", *shardable_names])
        return why + (f"Plan style 'sharded_norm' shards only RMSNorms ({supported}), not a {cls}: leave "
                      f"{name_pattern(column)} unsharded (take it out of the plan, or exclude the block that holds "
                      f"both)")

    return check


def _common_prefix(a: str, b: str) -> int:
    """How many leading module-path components ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n
