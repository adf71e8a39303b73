"""``+model=hf model.path=<dir>``: a Hugging Face decoder from a local directory, wrapped for TP.

The directory is untrusted input. Nothing in it runs code:

* ``config.json`` is first read as JSON (its ``model_type`` must be one of
  :data:`LAUNCHER_FAMILIES`: every family with a built-in ``wrap`` plan,
  ``tp_fuse.layers.wrap.hf_plans.FAMILIES``, each tested TP=2 vs TP=1 through the launcher;
  every size it gives bounded; GLM, which has no built-in plan, needs ``model.plan``), then
  resolved by ``transformers.AutoConfig`` (class defaults,
  spellings); ``transformers`` reads and builds with ``trust_remote_code=False`` and
  ``local_files_only=True`` (no hub access, an ``auto_map`` runs nothing);
* weight headers are read by ``safetensors`` (dtypes checked before loading); weights are
  loaded only from ``*.safetensors`` (a directory with pickled
  ``pytorch_model.bin`` weights only is refused); without weights the model is randomly
  initialized from the run's seed, identically on every rank;
* the tokenizer is ``tokenizer.json`` read by ``tokenizers`` (a data file, no code).

The model is wrapped with its family plan over the TP group (also at TP size 1, so that
FP8 reaches its GEMMs) and called by the trainer as ``model(tokens, labels) -> loss``.
At TP size > 1 the wrapped model is first checked against the original
(``wrap(verify=True)``: one forward and backward on a ``[2, 8]`` token probe, every output
and gradient compared; ``model.verify=false`` skips it): a model that would train wrong
stops at start-up with the first differing parameter named.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.layers import wrap
from tp_fuse.layers.wrap.convert import PLAN_STYLES
from tp_fuse.layers.wrap.hf_plans import FAMILIES
from tp_fuse.layers.wrap.plan_styles import FusedColumn
from tp_fuse.safe_files import open_regular_file, read_regular_file

from ..tokenizer import FileTokenizer

__all__ = ["read_hf_config", "hf_config", "needs_plan", "gpt_fields", "check_weight_files", "parameter_count",
           "load_tokenizer",
           "build_hf_model", "CausalLMLoss", "moe_note", "attention_head_dim"]

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
#: safetensors dtypes loaded as they are. Others are refused: transformers would cast an
#: int8 / uint8 / fp8 tensor to the run's float dtype without its quantization scales,
#: giving a model that loads and trains on garbage weights.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: Kept where the tensor is not a ``.weight``: buffers some checkpoints carry (Pythia's
#: causal mask ``attention.bias`` is BOOL, position ids are I64); transformers drops or
#: keeps them as they are, it never casts them into a float weight.
_BUFFER_DTYPES = ("BOOL", "I64")
#: config.json and model.safetensors.index.json: a few kB (an index: ~100 B per tensor).
_JSON_LIMIT = 64 * 2**20
_INDEX_FILE = "model.safetensors.index.json"
#: JSON files besides config.json that ``from_pretrained`` reads (unbounded) from a model directory.
_OTHER_CONFIG_FILES = ("generation_config.json",)


def _read_config_file(file: str) -> bytes:
    """A model directory's JSON config file, at most :data:`_JSON_LIMIT` bytes; ValueError
    naming the file and the limit (or what the file is: a FIFO, a device) otherwise."""
    try:
        return read_regular_file(file, _JSON_LIMIT, "model.path: config file", follow_symlinks=True)
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
    # (a regular file of at most _JSON_LIMIT bytes; transformers parses it).
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


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` (symbolic links resolved) lies in the directory ``root``."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root


def _safetensors_dtypes(file: str) -> dict[str, str]:
    """``{tensor name: dtype}`` from a safetensors file's header, read by the ``safetensors``
    library (which bounds the header at 100 MB, checks it is a JSON object of tensor entries
    and that their offsets fit the file; it reads no tensor data). The file is first checked
    to be a regular file (not a FIFO or device: ``tp_fuse.safe_files``)."""
    # Imported here: safetensors comes with the `hf` extra (transformers needs it), not with tp-fuse.
    from safetensors import SafetensorError, safe_open

    with open_regular_file(file, "model.path: weight file", follow_symlinks=True):
        pass
    try:
        with safe_open(file, framework="pt") as f:
            return {name: f.get_slice(name).get_dtype() for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"model.path: {file} is not a readable safetensors file: {e}") from None


def check_weight_files(path: str) -> None:
    """Refuse weights that would load wrong or from elsewhere, before any process starts.

    * ``model.safetensors.index.json`` entries must name files in ``path`` itself (not
      ``../x``, not absolute): transformers joins them to ``path`` and opens the result;
    * every ``*.safetensors`` file (found or named by the index) must lie in ``path`` once
      symbolic links are resolved;
    * every tensor must be float (F16/BF16/F32/F64): transformers casts int8 / uint8 /
      fp8 tensors to the run's dtype without their quantization scales (BOOL / I64 buffers
      that are not a ``.weight``, such as causal masks, are left to transformers).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, _INDEX_FILE)
    if os.path.lexists(index):
        try:
            doc = json.loads(read_regular_file(index, _JSON_LIMIT, "model.path: weight index", follow_symlinks=True))
        except ValueError as e:
            raise ValueError(f"model.path: {index} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"model.path: {index} is JSON nested too deeply to be a weight index") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.path: {index} must hold an object with a weight_map object")
        for tensor, name in weight_map.items():
            if (not isinstance(name, str) or not name or os.path.isabs(name) or os.sep in name
                    or (os.altsep and os.altsep in name) or name in (".", "..")):
                raise ValueError(f"model.path: {index}: weight_map[{tensor!r}] = {name!r} must be a file name in "
                                 f"{path} (no directory part, not absolute); refusing to load weights from elsewhere")
            files.append(os.path.join(path, name))
    for file in dict.fromkeys(files):  # in order, once each
        if not _inside(file, path):
            raise ValueError(f"model.path: {file} resolves to {os.path.realpath(file)}, outside {path}; refusing "
                             f"to load weights from outside the model directory (a Hugging Face cache snapshot "
                             f"links into ../../blobs: copy it with `cp -rL` into a directory of its own)")
        if not os.path.exists(file):
            raise ValueError(f"model.path: {file} (named in {_INDEX_FILE}) does not exist")
        for tensor, dtype in _safetensors_dtypes(file).items():
            if dtype not in _FLOAT_DTYPES and (dtype not in _BUFFER_DTYPES or tensor.endswith(".weight")):
                raise ValueError(f"model.path: {file}: tensor {tensor!r} has dtype {dtype}; only float weights "
                                 f"({', '.join(_FLOAT_DTYPES)}) are loaded (an integer or fp8 tensor would be cast "
                                 f"to float without its quantization scales). Dequantize the checkpoint first")


def load_tokenizer(path: str) -> FileTokenizer:
    """The model directory's ``tokenizer.json`` (a ``tokenizers`` file: JSON, no code runs)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.lexists(file):  # a FIFO or a link to a device: FileTokenizer names it
        raise ValueError(f"model.path: {file} does not exist; +model=hf tokenizes with the model directory's "
                         f"tokenizer.json (fast tokenizer file; no hub access)")
    return FileTokenizer(file, name=f"{path}/tokenizer.json")


class CausalLMLoss(torch.nn.Module):
    """``model(tokens, labels) -> mean cross-entropy`` (labels already shifted; -100 ignored)
    around a Hugging Face causal LM, the trainer's model contract."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits  # [b, s, vocab]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


#: ``model.plan=<module>:<attribute>``: a plan defined in the user's own Python code.
_PLAN_OBJECT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_plan_object(plan: Any) -> bool:
    """Whether ``model.plan`` names a plan in Python code (``my_plans:PLAN``)."""
    return isinstance(plan, str) and bool(_PLAN_OBJECT.match(plan))


def check_plan_styles(plan: Mapping, where: str) -> dict[str, Any]:
    """``plan`` as a dict after checking it is ``{module glob: style}`` with styles named in
    ``PLAN_STYLES`` or :class:`FusedColumn` objects; ValueError naming the bad entry."""
    if not plan:
        raise ValueError(f"{where}: the plan is empty; expected a mapping {{module glob: style}}")
    for glob_, style in plan.items():
        if not isinstance(glob_, str) or not glob_:
            raise ValueError(f"{where}: keys must be module-name globs (non-empty strings), got {glob_!r}")
        if not (isinstance(style, FusedColumn) or (isinstance(style, str) and style in PLAN_STYLES)):
            raise ValueError(f"{where}[{glob_!r}]: unknown style {style!r}; expected one of "
                             f"{', '.join(PLAN_STYLES)} or a tp_fuse.layers.FusedColumn")
    return dict(plan)


def load_plan_object(spec: str) -> Any:
    """Import ``<module>:<attribute>`` and return the attribute: a ``{module glob: style}``
    mapping (styles: ``PLAN_STYLES`` names or :class:`FusedColumn` objects) or a callable
    ``plan(config) -> mapping`` (given the model's transformers config, as the built-in
    family plans are). The module is the user's own code, named on their command line (not
    read from any model or run directory); it is imported from the current directory or
    ``PYTHONPATH``, once by the config check and once on every rank."""
    module_name, attr = spec.split(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # as ``python -m`` does: ``python launch/train.py`` puts launch/ first, not the cwd
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model.plan={spec}: cannot import module {module_name!r} ({e}); it must be importable "
                         f"from the current directory or PYTHONPATH") from None
    finally:
        if added:
            sys.path.remove(cwd)
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"model.plan={spec}: module {module_name!r} ({module.__file__}) has no attribute {attr!r}")
    if isinstance(obj, Mapping):
        check_plan_styles(obj, f"model.plan={spec}")
    elif not callable(obj):
        raise ValueError(f"model.plan={spec}: expected a mapping {{module glob: style}} or a callable "
                         f"plan(config) -> mapping, got {type(obj).__name__}")
    return obj


def resolve_plan(plan: Any, config: Any) -> Optional[dict[str, Any]]:
    """``model.plan`` as ``wrap``'s ``plan=``: None (the model's family plan), a built-in
    plan's name (its ``{glob: style}`` for this config), ``<module>:<attribute>`` (that
    mapping, or what that callable returns for this config), or the mapping itself."""
    if is_plan_object(plan):
        obj = load_plan_object(plan)
        return check_plan_styles(obj(config) if callable(obj) and not isinstance(obj, Mapping) else obj,
                                 f"model.plan={plan}")
    if isinstance(plan, str):
        return FAMILIES[plan].plan_for(config)  # the name was checked with the config
    return dict(plan) if plan is not None else None


@contextlib.contextmanager
def _transformers_progress(show: bool) -> Iterator[None]:
    """transformers' own progress bars (``Loading weights``) on or off while the block runs.

    Every rank loads the weights; one bar (rank 0's) is enough. transformers keeps the
    switch in its own module state, so it is put back as it was afterwards.
    """
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if show == was:
        yield
        return
    (hf_logging.enable_progress_bar if show else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def build_hf_model(path: str, *, tp_group: Any, dtype: torch.dtype, device: torch.device, seed: int,
                   overlap: Any, verify: bool = True, plan: Any = None, progress_bar: bool = True) -> CausalLMLoss:
    """Build (weights from safetensors if present, else seeded random init), wrap (with
    ``plan``: ``model.plan``, and ``verify=True`` at TP size > 1 when ``verify``), return.
    ``progress_bar`` False (ranks other than 0) silences transformers' weight-loading bar."""
    import transformers

    read_hf_config(path)
    check_weight_files(path)  # also checked by the config check, before any process group
    safetensors = glob.glob(os.path.join(path, "*.safetensors"))
    pickled = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
    common = dict(trust_remote_code=False)
    if safetensors:
        with _transformers_progress(progress_bar):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, use_safetensors=True, dtype=dtype, **common)
    elif pickled:
        raise ValueError(f"model.path: {path} has only pickled weights ({os.path.basename(pickled[0])}); they are "
                         f"not loaded (unpickling runs code). Convert them to safetensors")
    else:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, **common)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # identical on every rank: wrap checks it
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **common)
    model.to(device)
    if tp_group is not None:
        check = verify and dist.get_world_size(tp_group) > 1
        # verify=True: the automatic probe, required (its failure stops the run);
        # model.verify=false: wrap's explicit opt-out (it warns what is not checked).
        wrap(model, tp_group, plan=resolve_plan(plan, model.config), overlap=overlap,
             verify=True if check else (None if verify else False))
    return CausalLMLoss(model)
