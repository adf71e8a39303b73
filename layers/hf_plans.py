"""Built-in ``wrap()`` plans for Hugging Face decoder families, keyed by ``config.model_type``.

Each plan shards the attention and MLP projections Megatron-style (column-parallel in,
row-parallel out) and checks the attention heads against the TP size before anything is
changed. The attention code of these families reshapes projections with ``-1`` heads and
pairs query/key heads by a fixed group ratio, so local heads work unchanged once every
rank holds whole heads -- except GPT-2, whose ``split_size`` is set to the local width.

Hugging Face activations are ``[batch, seq, hidden]``: sequence parallelism (which
splits dim 0) does not apply to these models; ``wrap`` refuses it for a family plan.

This module reads only the model's ``config`` attributes: it never imports
``transformers`` (GPT-2's ``Conv1D`` is recognised by its class name and layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["FusedColumn", "FamilyPlan", "family_plan", "FAMILIES"]


@dataclasses.dataclass(frozen=True)
class FusedColumn:
    """Plan style for a fused projection whose output features are ``parts`` equal blocks
    (nanoGPT / GPT-2 ``c_attn`` = ``[q; k; v]``): each block is split over the TP ranks
    separately, so rank r holds ``[q_r; k_r; v_r]`` and a local ``split``/``chunk(3)``
    still separates q, k and v. (A head-interleaved projection such as GPT-NeoX's
    ``query_key_value`` -- per head ``[q_h, k_h, v_h]`` -- is a plain ``"column"``: a
    contiguous slice of whole heads.)"""

    parts: int

    def __post_init__(self) -> None:
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 2:
            raise ValueError(f"FusedColumn: parts must be an int >= 2, got {self.parts!r}")


@dataclasses.dataclass
class FamilyPlan:
    """A family's plan, its head checks and the attribute fix-ups after conversion."""

    model_type: str
    plan: dict[str, Any]
    check: Callable[[Any, int], list[str]]
    fixup: Optional[Callable[[torch.nn.Module, int], None]] = None


def _heads_check(config: Any, tp: int) -> list[str]:
    problems = []
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        return ["config has no num_attention_heads: cannot check the attention heads against the TP size"]
    if heads % tp:
        problems.append(f"config.num_attention_heads ({heads}) is not divisible by the TP size ({tp})")
    if kv % tp:
        problems.append(
            f"config.num_key_value_heads ({kv}) is not divisible by the TP size ({tp}): every rank needs whole "
            f"key/value heads (replicating them would break the model's query-to-KV-head grouping); use a TP "
            f"size that divides {kv}")
    return problems


_LLAMA_LIKE = {
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
}

_GPT_NEOX = {
    "gpt_neox.layers.*.attention.query_key_value": "column",  # per head [q, k, v]: whole heads per rank
    "gpt_neox.layers.*.attention.dense": "row",
    "gpt_neox.layers.*.mlp.dense_h_to_4h": "column",
    "gpt_neox.layers.*.mlp.dense_4h_to_h": "row",
}

_GPT2 = {
    "transformer.h.*.attn.c_attn": FusedColumn(3),
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
}


def _gpt2_fixup(model: torch.nn.Module, tp: int) -> None:
    # GPT2Attention splits c_attn's output with split(self.split_size) = hidden: make it
    # the local width so that [q_r; k_r; v_r] separates again.
    for m in model.modules():
        if type(m).__name__ == "GPT2Attention":
            m.split_size = m.embed_dim // tp


def _gpt2_check(config: Any, tp: int) -> list[str]:
    problems = _heads_check(config, tp)
    if getattr(config, "add_cross_attention", False):
        problems.append("GPT-2 with add_cross_attention=True is not supported by the built-in plan")
    return problems


FAMILIES: dict[str, FamilyPlan] = {
    **{t: FamilyPlan(t, _LLAMA_LIKE, _heads_check) for t in ("llama", "mistral", "qwen2", "qwen3")},
    "gpt_neox": FamilyPlan("gpt_neox", _GPT_NEOX, _heads_check),
    "gpt2": FamilyPlan("gpt2", _GPT2, _gpt2_check, _gpt2_fixup),
}


def family_plan(model: torch.nn.Module) -> Optional[FamilyPlan]:
    """The built-in plan for ``model.config.model_type``; None when the model has no such
    config. A Hugging Face model of a family without a plan is a ``ValueError``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return None
    if model_type not in FAMILIES:
        raise ValueError(f"wrap: no built-in plan for model_type {model_type!r} (built in: {sorted(FAMILIES)}); "
                         f"pass plan={{glob: style}}")
    return FAMILIES[model_type]
