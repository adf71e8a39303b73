"""``+model=hf``: the model directory's config.json, checked and read into the launcher's sizes.

config.json is untrusted input: it is first read as JSON (a bounded regular file; its
``model_type`` one of :data:`LAUNCHER_FAMILIES`; every size it gives a positive int under
:data:`SIZE_BOUNDS`), then resolved by ``transformers.AutoConfig`` with
``local_files_only=True`` and ``trust_remote_code=False`` (class defaults and spellings; an
``auto_map`` runs nothing). :func:`gpt_fields` maps it onto ``tp_fuse.layers.GPTConfig``'s
fields (validation, the FLOP/token of the MFU line, the checkpoint manifest) and refuses a
model larger than this machine's memory; the model itself is built by
:mod:`tp_fuse.launch.models.hf`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

from tp_fuse.layers.wrap.hf_plans import FAMILIES
from tp_fuse.safe_files import read_regular_file

from .hf_weights import JSON_LIMIT, check_weight_files

__all__ = ["LAUNCHER_FAMILIES", "SIZE_BOUNDS", "attention_head_dim", "gpt_fields", "hf_config", "moe_note",
           "needs_plan", "parameter_count", "read_hf_config"]

#: The families +model=hf takes, and how each one's config.json maps onto the launcher's
#: sizes (``tp_fuse.layers.GPTConfig``: validation, the FLOP/token of the MFU line, the
#: checkpoint manifest; the model itself is built by transformers):
#: ``(ffn width field, gated MLP, normalization, position embedding, bias)``.
#: A gated MLP (SwiGLU, Gemma's GeGLU) has three FFN matrices, counted as ``"swiglu"``
#: (only the FLOP/parameter accounting reads it). The ffn width field None: 4 x hidden
#: whatever config.json says (Bloom's MLP). For an MoE family the field is one routed
#: expert's width (:data:`_MOE`). These are every family of ``wrap``'s built-in plans
#: (``tp_fuse.layers.wrap.hf_plans.FAMILIES``), each tested TP=2 vs TP=1 through the
#: launcher (tests/test_launch_hf.py). OLMo2's full-width q/k norms are sharded by its plan
#: (plan style "sharded_norm"), nothing launcher-side differs; Gemma3's sliding-window
#: layers and q/k norms and Bloom's ALiBi bias (sliced per rank by its plan's fix-up) need
#: nothing here either.
_FORMATS: dict[str, tuple[Optional[str], bool, str, str, bool]] = {
    **{t: ("intermediate_size", True, "RMSNorm", "rope", False)
       for t in ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text", "granite",
                 "mixtral")},
    # Routed experts of width moe_intermediate_size (gated). Qwen2-MoE's q/k/v biases only,
    # as Qwen2's: no bias in the rest of the model.
    **{t: ("moe_intermediate_size", True, "RMSNorm", "rope", False) for t in ("qwen2_moe", "qwen3_moe")},
    # Cohere and StableLM: gated MLP with LayerNorm.
    **{t: ("intermediate_size", True, "LayerNorm", "rope", False) for t in ("cohere", "stablelm")},
    **{t: ("intermediate_size", False, "LayerNorm", "rope", True) for t in ("gpt_neox", "phi", "starcoder2")},
    "gpt2": ("n_inner", False, "LayerNorm", "learned", True),
    "gptj": ("n_inner", False, "LayerNorm", "rope", True),
    "opt": ("ffn_dim", False, "LayerNorm", "learned", True),
    # ALiBi (a per-head bias on the attention scores; no position table), a 4 x hidden MLP
    # (BloomMLP ignores any n_inner), biases everywhere.
    "bloom": (None, False, "LayerNorm", "alibi", True),
    # Families whose sizes the launcher reads but for which wrap has no built-in plan:
    # they need model.plan (checked at config time, :func:`needs_plan`). GLM: a fused
    # [gate; up] MLP (FusedColumn(2)), RMSNorm, partial rotary, q/k/v biases only.
    "glm": ("intermediate_size", True, "RMSNorm", "rope", False),
}
LAUNCHER_FAMILIES = tuple(_FORMATS)
#: MoE families +model=hf takes: ``(experts field, experts-per-token field, shared-expert
#: width field or None)``. Their plan keeps the routed experts replicated on every TP rank
#: (the wrap report says so) and shards attention and the shared expert (Qwen2-MoE's, gated
#: by its own sigmoid); the FLOP/token counts the experts one token goes through plus the
#: shared expert, the memory check all of the experts.
_MOE: dict[str, tuple[str, str, Optional[str]]] = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", None),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "shared_expert_intermediate_size"),
    "qwen3_moe": ("num_local_experts", "num_experts_per_tok", None),
}
#: Bloom's config has no position limit (ALiBi extrapolates): ``seq_length`` where
#: config.json gives one (Megatron-converted checkpoints), else BLOOM's training context.
_BLOOM_SEQ_LEN = 2048

#: Upper bounds on config.json sizes. Each is far above any published decoder (hidden
#: 25600, vocabulary 262144, 126 layers, FFN 73728, 128 heads) and far below what
#: overflows an allocation: a value above one is a typo or a crafted file, refused before
#: ``transformers`` asks the allocator for it.
SIZE_BOUNDS = {
    "hidden_size": 2**16,
    "intermediate_size": 2**20,
    "vocab_size": 2**22,
    "num_hidden_layers": 2**11,
    "num_attention_heads": 2**12,
    "max_position_embeddings": 2**24,
    "head_dim": 2**12,
}
#: config.json spellings of the same sizes (GPT-2's and Bloom's names, MoE widths) -> the bound's name.
_ALIASES = {"n_embd": "hidden_size", "n_embed": "hidden_size", "n_inner": "intermediate_size",
            "ffn_dim": "intermediate_size", "moe_intermediate_size": "intermediate_size",
            "shared_expert_intermediate_size": "intermediate_size", "n_layer": "num_hidden_layers",
            "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
            "seq_length": "max_position_embeddings"}
#: The smallest element size the launcher builds a model in (bfloat16): the memory check
#: refuses only models that cannot fit in any dtype the run could pick.
_MIN_ITEMSIZE = 2
#: JSON files besides config.json that ``from_pretrained`` reads (unbounded) from a model directory.
_OTHER_CONFIG_FILES = ("generation_config.json",)

def _read_config_file(file: str) -> bytes:
    """A model directory's JSON config file, at most :data:`JSON_LIMIT` bytes; ValueError
    naming the file and the limit (or what the file is: a FIFO, a device) otherwise."""
    try:
        return read_regular_file(file, JSON_LIMIT, "model.path: config file", follow_symlinks=True)
    except OSError as e:  # a dangling link, no permission
        raise ValueError(f"model.path: cannot read {file}: {e.strerror or e}") from None


def read_hf_config(path: Any) -> dict[str, Any]:
    """``<path>/config.json`` as a dict; ValueError naming the file and the field."""
    if not isinstance(path, str) or not path:
        raise ValueError("model.path: +model=hf needs model.path=<local directory with config.json>")
    file = os.path.join(path, "config.json")
    if not os.path.lexists(file):  # a FIFO or a link to a device exists: read_regular_file names it
        raise ValueError(f"model.path: {file} does not exist (a local Hugging Face model directory is needed)")
    # transformers reads generation_config.json too, with no size bound: bound it here first
    # (a regular file of at most JSON_LIMIT bytes; transformers parses it).
    for name in _OTHER_CONFIG_FILES:
        if os.path.lexists(os.path.join(path, name)):
            _read_config_file(os.path.join(path, name))
    raw = _read_config_file(file)
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"model.path: {file} is not valid JSON: {e}") from None
    except RecursionError:  # the C parser recurses per nesting level
        raise ValueError(f"model.path: {file} is JSON nested too deeply to be a model config") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.path: {file} must hold a JSON object")
    model_type = data.get("model_type")
    if model_type not in LAUNCHER_FAMILIES:
        raise ValueError(f"{file}: model_type {model_type!r} is not one the launcher reads the sizes of; supported: "
                         f"{sorted(LAUNCHER_FAMILIES)}" + (" (wrap() itself has a plan for it: use the API)"
                                                           if model_type in FAMILIES else ""))
    return data


def _check_int(value: Any, file: str, name: str) -> int:
    """``value`` of config field ``name``: a positive int within its :data:`SIZE_BOUNDS` bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{file}: {name} must be a positive int, got {value!r}")
    bound = SIZE_BOUNDS.get(_ALIASES.get(name, name))
    if bound is not None and value > bound:
        raise ValueError(f"{file}: {name} = {value} is above the sane bound {bound} (no published "
                         f"model comes close); refusing to allocate it (typo or crafted config?)")
    return value


def needs_plan(path: str) -> Optional[str]:
    """The ``model_type`` of the model in ``path`` when wrap has no built-in plan for it
    (``model.plan`` must then give one), else None."""
    model_type = read_hf_config(path)["model_type"]
    return model_type if model_type not in FAMILIES else None


def _check_file_sizes(data: dict[str, Any], file: str) -> None:
    """Every size config.json gives (under any of the spellings in :data:`SIZE_BOUNDS` /
    :data:`_ALIASES`) is a positive int within its bound, and ``num_key_value_heads`` a
    positive int: checked on the file's own values, before transformers reads them (a
    config class builds per-layer lists from ``num_hidden_layers``)."""
    for name, value in data.items():
        if value is not None and _ALIASES.get(name, name) in SIZE_BOUNDS:
            _check_int(value, file, name)
    kv = data.get("num_key_value_heads")
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0):
        raise ValueError(f"{file}: num_key_value_heads must be a positive int dividing num_attention_heads "
                         f"({data.get('num_attention_heads', '?')}), got {kv!r}")


def hf_config(path: str) -> Any:
    """The model directory's config as transformers builds the model from it:
    ``AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)`` (the
    family's class defaults for what config.json leaves out, each field under every spelling
    its class maps: GPT-2's ``n_embd`` is ``hidden_size``, Qwen3-MoE's ``num_experts`` is
    ``num_local_experts``, Bloom's legacy ``n_embed``). config.json is checked first
    (:func:`read_hf_config`: JSON, a launcher family; every size bounded); nothing in the
    directory runs (no remote code: an ``auto_map`` is ignored, the family's own class is used)."""
    data = read_hf_config(path)
    file = os.path.join(path, "config.json")
    _check_file_sizes(data, file)
    # Imported here: transformers is the `hf` extra; only +model=hf needs it.
    import transformers

    try:
        with warnings.catch_warnings():  # default special-token ids outside a tiny vocab etc.
            warnings.simplefilter("ignore")
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 -- an untrusted file: whatever transformers raises (its strict
        # field validation raises huggingface_hub's own error class) becomes one error naming the file
        raise ValueError(f"{file}: transformers cannot read it as a {data['model_type']} config: "
                         f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None


def _optional_int_field(config: Any, file: str, name: str) -> Optional[int]:
    """The config's ``name`` (checked as :func:`_check_int`), or None where it has none."""
    value = getattr(config, name, None)
    return None if value is None else _check_int(value, file, name)


def _int_field(config: Any, file: str, name: str) -> int:
    value = _optional_int_field(config, file, name)
    if value is None:
        raise ValueError(f"{file}: missing {name}")
    return value


def _host_memory_bytes() -> int:
    """This machine's physical memory (every rank builds the whole model on the host
    before wrapping it, so a model larger than this cannot be built)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parameter_count(fields: dict[str, Any], head_dim: int, experts: int = 1, experts_per_token: int = 1,
                    shared_ffn: int = 0) -> int:
    """The number of parameters of a decoder with these :func:`gpt_fields` (embeddings,
    output head unless tied, attention and MLP projections; norms, biases and MoE routers
    are noise). For an MoE model (``experts`` > 1) ``fields["ffn_hidden_size"]`` is the
    width a token goes through (``experts_per_token`` routed experts, plus a shared expert
    of width ``shared_ffn`` where the family has one): every one of the ``experts`` is
    counted, the shared expert once."""
    hidden, vocab, layers = fields["hidden_size"], fields["vocab_size"], fields["num_layers"]
    heads = fields["num_heads"]
    kv = fields["num_query_groups"] or heads
    count = vocab * hidden * (1 if fields["tie_embeddings"] else 2)
    if fields["position_embedding"] == "learned":
        count += fields["max_seq_len"] * hidden
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
    ffn = (fields["ffn_hidden_size"] - shared_ffn) // experts_per_token * experts + shared_ffn
    mlp = hidden * ffn * (3 if fields["activation"] == "swiglu" else 2)
    return count + layers * (attention + mlp)


#: Families whose attention is hidden_size / num_attention_heads wide whatever config.json's
#: ``head_dim`` says: their attention modules do not read it (a fact of transformers' modeling
#: code, which no config API states); every other family's attention reads
#: ``config.head_dim`` where it is set (Gemma's 256, Qwen3's 128; Qwen2's attention reads a
#: ``head_dim`` its config class does not even declare).
_FIXED_HEAD_DIM = ("gpt2", "gptj", "opt", "bloom", "gpt_neox", "stablelm")


def _head_dim(config: Any, file: str, hidden: int, heads: int) -> int:
    """The attention head width as the family's attention module computes it: the config's
    ``head_dim`` (config.json's or the class default) where it reads one, else hidden / heads."""
    if config.model_type in _FIXED_HEAD_DIM:
        return hidden // heads
    return _optional_int_field(config, file, "head_dim") or hidden // heads


def _moe_sizes(config: Any, file: str, layers: int) -> tuple[int, int, int]:
    """``(routed experts, experts per token, shared-expert width or 0)`` of an MoE family's
    config (:func:`hf_config`). Every layer must be an MoE layer: Qwen's
    ``mlp_only_layers`` / ``decoder_sparse_step`` can make some layers dense, which
    :class:`tp_fuse.layers.GPTConfig`'s one FFN shape for all layers cannot describe."""
    model_type = config.model_type
    experts_field, per_token_field, shared_field = _MOE[model_type]
    experts = _int_field(config, file, experts_field)
    per_token = _int_field(config, file, per_token_field)
    if per_token > experts:
        raise ValueError(f"{file}: {per_token_field} ({per_token}) is more than {experts_field} ({experts})")
    shared = _int_field(config, file, shared_field) if shared_field else 0
    only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1)
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ValueError(f"{file}: mlp_only_layers must be a list of layer indices, got {only!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"{file}: decoder_sparse_step must be a positive int, got {step!r}")
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if dense:
        raise ValueError(f"{file}: layers {dense} are dense MLP layers, not MoE (mlp_only_layers={only}, "
                         f"decoder_sparse_step={step}); +model=hf describes every layer with one FFN shape (its "
                         f"FLOP/token, parameter count and checks), so it takes {model_type} models that are MoE in "
                         f"every layer (as the published checkpoints are); train this one through the API (wrap())")
    return experts, per_token, shared


def gpt_fields(path: str) -> dict[str, Any]:
    """The launcher's model sizes (``tp_fuse.layers.GPTConfig`` fields) read from ``config.json``
    as transformers reads it (:func:`hf_config`: class defaults for what it leaves out):
    they drive validation (``parallel.tp`` vs heads, ``data.seq_len`` vs positions), the
    FLOP/token of the MFU line and the checkpoint manifest; the model itself is built by
    ``transformers``."""
    config = hf_config(path)
    file = os.path.join(path, "config.json")
    model_type = config.model_type
    ffn_field, gated, norm, position, bias = _FORMATS[model_type]
    heads = _int_field(config, file, "num_attention_heads")
    hidden = _int_field(config, file, "hidden_size")
    layers = _int_field(config, file, "num_hidden_layers")
    # Read by transformers and by every wrap plan (tp_fuse.layers.wrap.hf_plans): a negative
    # or zero value (which `or heads` would silently replace) fails after the process group
    # has started, and a count not dividing the heads breaks the query-to-KV-head grouping.
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None:
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or heads % kv:
            raise ValueError(f"{file}: num_key_value_heads must be a positive int dividing num_attention_heads "
                             f"({heads}), got {kv!r}")
    if ffn_field is None:  # Bloom: 4 x hidden, whatever config.json says
        inner = 4 * hidden
    elif ffn_field == "n_inner":  # GPT-2 / GPT-J: n_inner null means 4 x hidden (what their MLPs build)
        inner = _optional_int_field(config, file, ffn_field) or 4 * hidden
    else:
        inner = _int_field(config, file, ffn_field)
    experts = experts_per_token = 1
    shared = 0
    if model_type in _MOE:
        experts, experts_per_token, shared = _moe_sizes(config, file, layers)
        # FLOP/token: a token goes through experts_per_token experts of width `inner`, and
        # through the shared expert where the family has one (all gated MLPs).
        inner = inner * experts_per_token + shared
    if model_type == "bloom":  # ALiBi: no position table bounds the sequence
        max_seq_len = _optional_int_field(config, file, "seq_length") or _BLOOM_SEQ_LEN
    else:
        max_seq_len = _int_field(config, file, "max_position_embeddings")
    fields: dict[str, Any] = {
        "vocab_size": _int_field(config, file, "vocab_size"),
        "max_seq_len": max_seq_len,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_query_groups": kv,
        "ffn_hidden_size": inner,
        "activation": "swiglu" if gated else "gelu",
        "normalization": norm,
        "position_embedding": position,
        "tie_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "bias": bool(getattr(config, "use_bias", bias)),  # Starcoder2 says so in its config
    }
    params = parameter_count(fields, _head_dim(config, file, hidden, heads), experts, experts_per_token, shared)
    need, have = params * _MIN_ITEMSIZE, _host_memory_bytes()
    if need > have:
        raise ValueError(f"{file}: the model has {params:,} parameters, {need / 2**30:,.1f} GiB even in bfloat16, "
                         f"more than this machine's memory ({have / 2**30:,.1f} GiB); every rank builds the "
                         f"whole model on the host before sharding it, so it cannot be built here")
    check_weight_files(path)
    return fields


def attention_head_dim(path: str) -> int:
    """The attention head width of the model in ``path`` as its attention modules compute
    it: config.json's ``head_dim`` (or the class default: Gemma 256, Qwen3 128) where the
    family reads one, else hidden_size / num_attention_heads. ``num_heads x head_dim`` need
    not be hidden_size (Gemma, Qwen3): the FLOP/token's attention terms use this width."""
    config = hf_config(path)
    file = os.path.join(path, "config.json")
    heads = _int_field(config, file, "num_attention_heads")
    hidden = _int_field(config, file, "hidden_size")
    return _head_dim(config, file, hidden, heads)


def moe_note(path: str) -> Optional[str]:
    """For an MoE model directory: one line for the start report saying how its FLOP/token
    and its sharding treat the routed (and shared) experts; None for a dense model."""
    model_type = read_hf_config(path)["model_type"]
    if model_type not in _MOE:
        return None
    config = hf_config(path)
    file = os.path.join(path, "config.json")
    experts, per_token, shared = _moe_sizes(config, file, _int_field(config, file, "num_hidden_layers"))
    width = getattr(config, _FORMATS[model_type][0])
    return (f"MoE ({model_type}): {experts} routed experts per layer, {per_token} per token"
            + (f", and a shared expert (width {shared})" if shared else "")
            + f"; FLOP/token counts the {per_token} a token goes through"
            + (" and the shared expert" if shared else "")
            + f" (ffn = {per_token} x {width}" + (f" + {shared}" if shared else "")
            + f"), the parameter count includes all {experts}; the routed experts are replicated on every TP rank "
            + ("(not sharded), the shared expert is sharded" if shared else "(not sharded)"))
