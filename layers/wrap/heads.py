"""Per-head state of the attention modules whose projections ``wrap()`` shards.

After wrapping, each rank holds ``heads / tp`` whole heads of an attention module whose
q/k/v projections were converted to column-parallel. Code that reshapes with ``-1`` heads
(Llama, GPT-NeoX, GPT-J, GPT-2) needs nothing; code that reads a head count or a
projection width stored on the module needs the local value, and code that is wrong in
a way no attribute fixes must be refused:

* OPT reshapes ``q.view(bsz, -1, self.num_heads, self.head_dim)``: with the global
  ``num_heads`` the ``-1`` silently absorbs the halved width into the *sequence*
  dimension (no error, wrong numbers); StableLM and Bloom view with ``self.num_heads`` /
  ``self.num_key_value_heads``; GPT-2 and Bloom split the fused output at
  ``self.split_size``, nanoGPT at ``self.n_embd``.
* StableLM's per-head q/k LayerNorms are a ``ModuleList`` with one norm per head, zipped
  with the heads: after sharding rank 1 would normalise its heads with the norms of
  heads 0..h/tp-1.

The declared rule (:func:`localize_heads`), for every *attention module* -- the parent of
a plan-converted column projection that stores a head count as an int attribute:

==========================================================  ===============================
attribute (instance ``int``)                                becomes
==========================================================  ===============================
``num_heads``, ``num_attention_heads``, ``n_head``,          ``value / tp``
``n_heads``
``num_key_value_heads``, ``num_kv_heads``, ``n_kv_heads``,   ``value / tp``
``kv_heads``
``embed_dim``, ``hidden_size``, ``all_head_size``,           ``value / tp``, only where the
``split_size``, ``inner_dim``, ``n_embd``                    value is the projection width
                                                             ``heads * head_dim`` (module's
                                                             ``head_dim`` / ``head_size``)
                                                             or a part size of a converted
                                                             ``FusedColumn`` child
==========================================================  ===============================

``num_key_value_groups`` (a ratio) and ``head_dim`` are unchanged. Every change is listed
in the wrap report. Head counts not divisible by the TP size, and ``ModuleList``\\ s inside
an attention module with one entry per head (:func:`head_problems`), are refused before
anything changes. Anything else a model needs (a head count read from a shared config, a
bias built for all heads) is a family fix-up (``tp_fuse.layers.wrap.hf_plans``) or ``wrap(fixup=...)``;
``wrap(verify=...)`` catches what was missed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

__all__ = ["HEAD_ATTRS", "KV_HEAD_ATTRS", "WIDTH_ATTRS", "attention_modules", "head_problems", "localize_heads"]

HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
# ``kv_heads``: GPT-BigCode (1 under multi-query attention, which no TP size > 1 divides).
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")
# ``n_embd``: nanoGPT's attention splits its fused ``c_attn`` output at ``self.n_embd``.
WIDTH_ATTRS = ("embed_dim", "hidden_size", "all_head_size", "split_size", "inner_dim", "n_embd")
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size")


def _int_attr(module: torch.nn.Module, name: str) -> Optional[int]:
    value = vars(module).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _first(module: torch.nn.Module, names: Iterable[str]) -> Optional[tuple[str, int]]:
    for n in names:
        v = _int_attr(module, n)
        if v is not None:
            return n, v
    return None


def attention_modules(model: torch.nn.Module, columns: Iterable[str]) -> dict[str, torch.nn.Module]:
    """``{name: module}``: the parents of the ``columns`` (plan-converted column
    projections) that store a head count (an int ``HEAD_ATTRS`` or ``KV_HEAD_ATTRS``
    attribute on the instance)."""
    out: dict[str, torch.nn.Module] = {}
    for col in columns:
        parent = col.rpartition(".")[0]
        if parent in out or not col.count("."):
            continue
        m = model.get_submodule(parent)
        if _first(m, HEAD_ATTRS + KV_HEAD_ATTRS) is not None:
            out[parent] = m
    return out


def _head_counts(module: torch.nn.Module, config: Any) -> dict[int, str]:
    """Head counts this attention can have, ``{count: where it comes from}``."""
    counts: dict[int, str] = {}
    for attr in HEAD_ATTRS + KV_HEAD_ATTRS:
        v = _int_attr(module, attr)
        if v is not None and v > 1:
            counts.setdefault(v, f"{attr} = {v}")
    for attr in ("num_attention_heads", "num_key_value_heads"):
        v = getattr(config, attr, None) if config is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            counts.setdefault(v, f"config.{attr} = {v}")
    return counts


def head_problems(name: str, module: torch.nn.Module, tp: int, config: Any = None,
                  converted: Iterable[str] = ()) -> list[str]:
    """What stops the attention module ``name`` from being sharded by heads at TP size
    ``tp``: head counts not divisible by ``tp``, per-head module lists. ``config``: the
    model's config (its head counts also identify per-head lists); ``converted``: the
    names of the modules the plan converts (not per-head lists themselves)."""
    problems = []
    for attr in HEAD_ATTRS + KV_HEAD_ATTRS:
        v = _int_attr(module, attr)
        if v is not None and v % tp:
            problems.append(f"{name}: {attr} ({v}) is not divisible by the TP size ({tp}): every rank needs whole "
                            f"heads")
    counts = _head_counts(module, config)
    skip = tuple(c + "." for c in converted)
    for sub_name, sub in module.named_modules():
        full = f"{name}.{sub_name}" if sub_name else name
        if (isinstance(sub, torch.nn.ModuleList) and len(sub) in counts and not (full + ".").startswith(skip)
                and full not in converted):
            problems.append(
                f"{full}: a ModuleList of {len(sub)} modules, one per attention head ({counts[len(sub)]}); wrap does "
                f"not shard per-head module lists (each rank would apply the first {len(sub) // tp or 1} of them to "
                f"its own heads: wrong numbers on ranks > 0). Exclude {name!r} to keep this attention replicated, "
                f"or use shared modules (e.g. StableLM: qk_layernorm=False)")
    return problems


def localize_heads(module: torch.nn.Module, tp: int, part_widths: Iterable[int] = ()) -> list[str]:
    """Apply the declared rule to one attention module; returns the changes made
    (``["num_heads 4 -> 2", "embed_dim 32 -> 16"]``). Call once, after conversion.
    ``part_widths``: the part sizes of this module's converted fused projections (the
    model splits the output at such a width: OpenAI GPT's ``split_size``, a module without
    a ``head_dim`` attribute), localized like the projection width."""
    part_widths = set(part_widths)
    changes = []
    heads = _first(module, HEAD_ATTRS)
    head_dim = _first(module, _HEAD_DIM_ATTRS)
    width = heads[1] * head_dim[1] if heads is not None and head_dim is not None else None
    for attr in HEAD_ATTRS + KV_HEAD_ATTRS:
        v = _int_attr(module, attr)
        if v is not None:
            setattr(module, attr, v // tp)
            changes.append(f"{attr} {v} -> {v // tp}")
    for attr in WIDTH_ATTRS:
        v = _int_attr(module, attr)
        if v is not None and (v == width or v in part_widths):
            setattr(module, attr, v // tp)
            changes.append(f"{attr} {v} -> {v // tp}")
    return changes
