"""Built-in ``wrap()`` plans for Hugging Face decoder families, keyed by ``config.model_type``.

Each plan shards the attention and MLP projections Megatron-style (column-parallel in,
row-parallel out) and checks the attention heads against the TP size before anything is
changed. The attention code of these families reshapes projections with ``-1`` heads and
pairs query/key heads by a fixed group ratio, so local heads work unchanged once every
rank holds whole heads. Head counts and widths stored on the attention modules (GPT-2's
``split_size``, ``num_heads``, ``embed_dim``) are localized by ``wrap`` for every plan
(``tp_fuse.layers.wrap.heads``); Phi-3's fused ``qkv_proj`` (``[q; k; v]``, unequal under GQA) is
split where ``config.num_attention_heads`` and ``num_key_value_heads`` say: its attention
modules get a :class:`LocalHeadsConfig` view with this rank's head counts (the family's
fix-up); Bloom's attention modules take this rank's heads of the ALiBi bias that
``BloomModel`` builds for all heads (its fix-up). Replicated parameters used on the sharded
heads (Qwen3's ``q_norm`` / ``k_norm``) are found by ``wrap``'s trace and get their
gradient summed over TP. OLMo2's ``q_norm`` / ``k_norm`` are different: one RMSNorm over
the whole q (k) projection, ``[heads * head_dim]``, so its statistic spans every head; the
olmo2 plan shards them with the heads (plan style ``"sharded_norm"``: weight split, mean of
squares summed over TP). MoE families shard attention (and Qwen2-MoE's shared expert) and
keep the routed experts replicated (``FamilyPlan.notes``, listed in the report).

A family's checks and fix-ups apply to an explicit ``plan=`` for a model of that family
too (when the plan shards attention projections).

Hugging Face activations are ``[batch, seq, hidden]``: sequence parallelism (which
splits dim 0) does not apply to these models; ``wrap`` refuses it for a family plan.

This module reads only the model's ``config`` attributes: it never imports
``transformers`` (GPT-2's ``Conv1D`` is recognised by its class name and layout).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .plan_styles import FusedColumn
from .modules import ParallelLinearAdapter

__all__ = ["FusedColumn", "FamilyPlan", "LocalHeadsConfig", "family_plan", "FAMILIES"]


@dataclasses.dataclass
class FamilyPlan:
    """A family's plan, its head checks and the attribute fix-ups after conversion.

    ``plan`` is a ``{glob: style}`` dict, or a function of the model's config returning
    one (a fused projection's split sizes depend on the head counts: Phi-3)."""

    model_type: str
    plan: Union[dict[str, Any], Callable[[Any], dict[str, Any]]]
    check: Callable[[Any, int], list[str]]
    fixup: Optional[Callable[[torch.nn.Module, int], None]] = None
    #: ``{module glob: why it stays replicated}``, listed in the wrap report (MoE experts).
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    def plan_for(self, config: Any) -> dict[str, Any]:
        """The ``{glob: style}`` plan for a model with this ``config``."""
        return dict(self.plan(config) if callable(self.plan) else self.plan)


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

_GATED_MLP = {
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
}
_ATTENTION = {k: v for k, v in _LLAMA_LIKE.items() if ".self_attn." in k}

# OLMo2: q_norm / k_norm normalise the whole q / k projection output (all heads), so
# under TP they are sharded norms (weight split with the features, statistics summed over
# TP); replicated, each rank would normalise its own heads only (wrong numbers) or fail on
# the shapes.
_OLMO2 = {**_LLAMA_LIKE, "model.layers.*.self_attn.q_norm": "sharded_norm",
          "model.layers.*.self_attn.k_norm": "sharded_norm"}

_STARCODER2 = {**_ATTENTION, "model.layers.*.mlp.c_fc": "column", "model.layers.*.mlp.c_proj": "row"}

_PHI = {
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.dense": "row",
    "model.layers.*.mlp.fc1": "column",
    "model.layers.*.mlp.fc2": "row",
}

_OPT = {
    "model.decoder.layers.*.self_attn.q_proj": "column",
    "model.decoder.layers.*.self_attn.k_proj": "column",
    "model.decoder.layers.*.self_attn.v_proj": "column",
    "model.decoder.layers.*.self_attn.out_proj": "row",
    "model.decoder.layers.*.fc1": "column",
    "model.decoder.layers.*.fc2": "row",
}

_GPTJ = {
    "transformer.h.*.attn.q_proj": "column",
    "transformer.h.*.attn.k_proj": "column",
    "transformer.h.*.attn.v_proj": "column",
    "transformer.h.*.attn.out_proj": "row",
    "transformer.h.*.mlp.fc_in": "column",
    "transformer.h.*.mlp.fc_out": "row",
}

# MoE families: attention (and Qwen2-MoE's shared expert) sharded; the routed experts are
# fused [experts, ...] parameters that every rank keeps whole (replicated, not sharded).
_ROUTED = {"model.layers.*.mlp.experts": "routed MoE experts: replicated on every TP rank (not sharded)"}
_QWEN2_MOE = {**_ATTENTION, **{k.replace(".mlp.", ".mlp.shared_expert."): v for k, v in _GATED_MLP.items()}}


def _cohere_check(config: Any, tp: int) -> list[str]:
    problems = _heads_check(config, tp)
    if getattr(config, "use_qk_norm", False):
        problems.append("Cohere with use_qk_norm=True: its q/k LayerNorm weights are per head ([heads, head_dim]) "
                        "and are not sharded with the heads; exclude the attention blocks (model.layers.*.self_attn)")
    return problems


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


def _gpt2_check(config: Any, tp: int) -> list[str]:
    problems = _heads_check(config, tp)
    if getattr(config, "add_cross_attention", False):
        problems.append("GPT-2 with add_cross_attention=True is not supported by the built-in plan")
    return problems


def _phi3_plan(config: Any) -> dict[str, Any]:
    # qkv_proj = [q: heads*d; k: kv*d; v: kv*d] (unequal under GQA); gate_up_proj = [gate; up].
    # Sizes, not head counts: _heads_check already names num_key_value_heads once for the
    # whole model instead of once per layer and part.
    plan: dict[str, Any] = {
        "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_up_proj": FusedColumn(2, names=("gate", "up")),
        "model.layers.*.mlp.down_proj": "row",
    }
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0:  # else _heads_check has reported it already
        kv = getattr(config, "num_key_value_heads", None) or heads
        d = getattr(config, "head_dim", None) or config.hidden_size // heads  # as Phi3Attention computes it
        plan["model.layers.*.self_attn.qkv_proj"] = FusedColumn((heads * d, kv * d, kv * d), names=("q", "k", "v"))
    return plan


class LocalHeadsConfig:
    """A view of a shared model config whose head counts are this rank's.

    Phi3Attention finds the end of q in its fused projection's output with
    ``self.config.num_attention_heads * head_dim``; after wrapping the output holds this
    rank's ``[q_r; k_r; v_r]``, so that attention module must read ``heads / tp``. The
    config object is shared by the whole model (and saved with it), so it is not edited:
    each converted attention module gets this view instead. Every other attribute is
    read from (and written to) the shared config, so later changes to it (e.g.
    ``set_attn_implementation``) still reach the attention modules.
    """

    _LOCAL = ("num_attention_heads", "num_key_value_heads")

    def __init__(self, base: Any, num_attention_heads: int, num_key_value_heads: int) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "num_attention_heads", num_attention_heads)
        object.__setattr__(self, "num_key_value_heads", num_key_value_heads)

    def __getattr__(self, name: str) -> Any:  # only called for names not set on the view
        if name.startswith("__") or name == "_base":  # copy/pickle probe a bare instance
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._LOCAL:
            raise ValueError(f"LocalHeadsConfig: {name} is this rank's head count after wrap(); change the "
                             f"model's config before wrapping")
        setattr(self._base, name, value)

    def __repr__(self) -> str:
        return (f"LocalHeadsConfig(num_attention_heads={self.num_attention_heads}, "
                f"num_key_value_heads={self.num_key_value_heads}, base={type(self._base).__name__})")


def _phi3_fixup(model: torch.nn.Module, tp: int) -> None:
    # Only attention modules whose qkv_proj was converted (not excluded) see local heads.
    for m in model.modules():
        if type(m).__name__ == "Phi3Attention" and isinstance(getattr(m, "qkv_proj", None), ParallelLinearAdapter):
            config = m.config._base if isinstance(m.config, LocalHeadsConfig) else m.config
            kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            m.num_key_value_heads = kv // tp  # the k/v slice bounds; num_key_value_groups is unchanged
            m.config = LocalHeadsConfig(config, config.num_attention_heads // tp, kv // tp)


_BLOOM = {
    "transformer.h.*.self_attention.query_key_value": "column",  # per head [q, k, v]: whole heads per rank
    "transformer.h.*.self_attention.dense": "row",
    "transformer.h.*.mlp.dense_h_to_4h": "column",
    "transformer.h.*.mlp.dense_4h_to_h": "row",
}


def _bloom_check(config: Any, tp: int) -> list[str]:
    problems = _heads_check(config, tp)
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        problems.append("Bloom with slow_but_exact=True and pretraining_tp > 1 (a sliced output projection) is not "
                        "supported: set slow_but_exact=False (the same numbers up to rounding)")
    return problems


def _local_alibi(module: torch.nn.Module, args: tuple, kwargs: dict, rank: int, tp: int) -> tuple[tuple, dict]:
    """BloomModel builds the ALiBi bias for all heads, ``[batch * heads, 1, seq]``
    (batch-major), and passes it to every attention module; after wrap this module holds
    heads ``[rank * h, (rank + 1) * h)`` with ``h = module.num_heads`` (already local)."""
    alibi = kwargs.get("alibi")
    if isinstance(alibi, torch.Tensor):
        local = module.num_heads
        batch = alibi.shape[0] // (local * tp)
        full = alibi.view(batch, local * tp, *alibi.shape[1:])
        kwargs["alibi"] = full[:, rank * local:(rank + 1) * local].reshape(batch * local, *alibi.shape[1:])
    return args, kwargs


def _bloom_fixup(model: torch.nn.Module, tp: int) -> None:
    # Only attention modules whose query_key_value was converted (not excluded) hold local heads.
    for m in model.modules():
        qkv = getattr(m, "query_key_value", None)
        if type(m).__name__ == "BloomAttention" and isinstance(qkv, ParallelLinearAdapter):
            rank = dist.get_rank(qkv._tp.tp_group)
            m.register_forward_pre_hook(functools.partial(_local_alibi, rank=rank, tp=tp), with_kwargs=True)


FAMILIES: dict[str, FamilyPlan] = {
    **{t: FamilyPlan(t, _LLAMA_LIKE, _heads_check) for t in ("llama", "mistral", "qwen2", "qwen3")},
    "gpt_neox": FamilyPlan("gpt_neox", _GPT_NEOX, _heads_check),
    "gpt2": FamilyPlan("gpt2", _GPT2, _gpt2_check),
    "phi3": FamilyPlan("phi3", _phi3_plan, _heads_check, _phi3_fixup),
    "bloom": FamilyPlan("bloom", _BLOOM, _bloom_check, _bloom_fixup),
    **{t: FamilyPlan(t, _LLAMA_LIKE, _heads_check) for t in ("gemma", "gemma2", "gemma3_text", "granite")},
    "cohere": FamilyPlan("cohere", _LLAMA_LIKE, _cohere_check),
    "starcoder2": FamilyPlan("starcoder2", _STARCODER2, _heads_check),
    "olmo2": FamilyPlan("olmo2", _OLMO2, _heads_check),
    # StableLM's per-head q/k LayerNorms (qk_layernorm=True) are refused by wrap's
    # per-head module-list check (tp_fuse.layers.wrap.heads).
    "stablelm": FamilyPlan("stablelm", {**_ATTENTION, **_GATED_MLP}, _heads_check),
    "phi": FamilyPlan("phi", _PHI, _heads_check),
    "opt": FamilyPlan("opt", _OPT, _heads_check),
    "gptj": FamilyPlan("gptj", _GPTJ, _heads_check),
    **{t: FamilyPlan(t, _ATTENTION, _heads_check, notes=_ROUTED) for t in ("mixtral", "qwen3_moe")},
    "qwen2_moe": FamilyPlan("qwen2_moe", _QWEN2_MOE, _heads_check, notes=_ROUTED),
}


def family_plan(model: torch.nn.Module, explicit: bool = False) -> Optional[FamilyPlan]:
    """The built-in plan for ``model.config.model_type``; None when the model has no such
    config. A Hugging Face model of a family without a plan is a ``ValueError``, unless
    the caller has its own plan (``explicit``: None then)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        return None
    if model_type not in FAMILIES:
        if explicit:
            return None
        raise ValueError(f"wrap: no built-in plan for model_type {model_type!r} (built in: {sorted(FAMILIES)}); "
                         f"pass plan={{glob: style}}")
    return FAMILIES[model_type]
