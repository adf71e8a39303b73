"""``+model=hf model.path=<dir>``: a Hugging Face decoder from a local directory, wrapped for TP.

The directory is untrusted input. Nothing in it runs code:

* ``config.json`` is read as JSON (its ``model_type`` must have a built-in ``wrap`` plan,
  ``tp_fuse.layers.wrap.hf_plans.FAMILIES``); ``transformers`` builds the model with
  ``trust_remote_code=False`` and ``local_files_only=True`` (no hub access);
* weights are loaded only from ``*.safetensors`` (a directory with pickled
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

import glob
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.layers import wrap

from ..tokenizer import FileTokenizer
from tp_fuse.layers.wrap.hf_plans import FAMILIES

__all__ = ["read_hf_config", "gpt_fields", "load_tokenizer", "build_hf_model", "CausalLMLoss"]

# Families with a SwiGLU MLP and RMSNorm (the others: GELU and LayerNorm).
_SWIGLU_RMSNORM = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# The families +model=hf takes: gpt_fields reads their config.json spellings (wrap's other
# built-in families, tp_fuse.layers.wrap.hf_plans.FAMILIES, work through the API).
LAUNCHER_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2")


def read_hf_config(path: Any) -> dict[str, Any]:
    """``<path>/config.json`` as a dict; ValueError naming the file and the field."""
    if not isinstance(path, str) or not path:
        raise ValueError("model.path: +model=hf needs model.path=<local directory with config.json>")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model.path: {file} does not exist (a local Hugging Face model directory is needed)")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path: {file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.path: {file} must hold a JSON object")
    model_type = data.get("model_type")
    if model_type not in LAUNCHER_FAMILIES:
        raise ValueError(f"{file}: model_type {model_type!r} has no built-in wrap plan in the launcher; supported: "
                         f"{sorted(LAUNCHER_FAMILIES)}" + (" (wrap() itself has one: use the API)"
                                                           if model_type in FAMILIES else ""))
    return data


def _int_field(data: dict[str, Any], file: str, *names: str) -> int:
    for name in names:
        value = data.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{file}: {name} must be a positive int, got {value!r}")
            return value
    raise ValueError(f"{file}: missing {' / '.join(names)}")


def gpt_fields(path: str) -> dict[str, Any]:
    """The launcher's model sizes (``tp_fuse.layers.GPTConfig`` fields) read from ``config.json``:
    they drive validation (``parallel.tp`` vs heads, ``data.seq_len`` vs positions) and the
    checkpoint manifest; the model itself is built by ``transformers``."""
    data = read_hf_config(path)
    file = os.path.join(path, "config.json")
    heads = _int_field(data, file, "num_attention_heads", "n_head")
    hidden = _int_field(data, file, "hidden_size", "n_embd")
    gpt2 = data["model_type"] == "gpt2"
    fields: dict[str, Any] = {
        "vocab_size": _int_field(data, file, "vocab_size"),
        "max_seq_len": _int_field(data, file, "max_position_embeddings", "n_positions"),
        "hidden_size": hidden,
        "num_layers": _int_field(data, file, "num_hidden_layers", "n_layer"),
        "num_heads": heads,
        "num_query_groups": data.get("num_key_value_heads") or None,
        "ffn_hidden_size": (data.get("n_inner") or 4 * hidden) if gpt2 else _int_field(data, file, "intermediate_size"),
        "activation": "swiglu" if data["model_type"] in _SWIGLU_RMSNORM else "gelu",
        "normalization": "RMSNorm" if data["model_type"] in _SWIGLU_RMSNORM else "LayerNorm",
        "position_embedding": "learned" if gpt2 else "rope",
        "tie_embeddings": bool(data.get("tie_word_embeddings", gpt2)),
        "bias": data["model_type"] in ("gpt2", "gpt_neox"),
    }
    return fields


def load_tokenizer(path: str) -> FileTokenizer:
    """The model directory's ``tokenizer.json`` (a ``tokenizers`` file: JSON, no code runs)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
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


def build_hf_model(path: str, *, tp_group: Any, dtype: torch.dtype, device: torch.device, seed: int,
                   overlap: Any, verify: bool = True) -> CausalLMLoss:
    """Build (weights from safetensors if present, else seeded random init), wrap (with
    ``verify=True`` at TP size > 1 when ``verify``), return."""
    import transformers

    read_hf_config(path)
    safetensors = glob.glob(os.path.join(path, "*.safetensors"))
    pickled = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
    common = dict(trust_remote_code=False)
    if safetensors:
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
        wrap(model, tp_group, overlap=overlap, verify=True if check else None)
    return CausalLMLoss(model)
