"""``wrap()``'s probes: the input it verifies and traces a model on.

A model whose forward takes token ids gets an automatic probe, ``[2, seq]`` random ids
(issue 39: verified by default):

* a Hugging Face model (``config.model_type`` and ``config.vocab_size``):
  ``model(input_ids=ids, use_cache=False)``, the launcher's probe;
* any other model whose ``forward``'s first parameter is named like token ids
  (:data:`TOKEN_PARAMS`: nanoGPT's ``idx``, torchtitan's ``tokens``), whose other
  parameters have defaults, and which has an ``nn.Embedding``: ``model(ids)``, the ids
  drawn from the first embedding's rows (module order: the token embedding is built
  first in nanoGPT, torchtitan and Megatron alike).

``seq`` is 8, or less where the model has fewer positions: ``config.block_size`` /
``max_seq_len`` / ``max_position_embeddings`` / ``n_positions`` (on ``model.config`` or
torchtitan's ``model.model_args``), and the other embeddings' sizes (a learned position
embedding such as nanoGPT's ``wpe``; indexing past it would raise). A length equal to a
head count is avoided: the trace's per-head check (``tp_fuse.layers.wrap.per_head``) would
mistake a ``[.., seq, seq]`` mask for a per-head tensor.

``verify=<probe>`` given by the caller: a tensor (``model(t)``), a tuple (``model(*t)``), a
dict (``model(**d)``) or a callable ``f(model) -> output``; ``True`` asks for the automatic
one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

from .heads import HEAD_ATTRS, KV_HEAD_ATTRS

__all__ = ["TOKEN_PARAMS", "WHO_GETS_ONE", "TokenInput", "token_input", "auto_probe", "make_probe"]

#: Names of a forward's first parameter that say it takes token ids.
TOKEN_PARAMS = ("input_ids", "idx", "tokens", "token_ids", "ids")
#: Which models get an automatic probe (for messages).
WHO_GETS_ONE = (f"a Hugging Face model with config.vocab_size, or a model with an nn.Embedding whose forward's first "
                f"parameter is token ids ({', '.join(TOKEN_PARAMS)}) and the others have defaults")
# Attributes giving a model's longest sequence, on its config (HF, nanoGPT) or model_args (torchtitan).
_LENGTH_ATTRS = ("block_size", "max_seq_len", "max_position_embeddings", "n_positions")
_PROBE_LENGTH = 8


@dataclasses.dataclass(frozen=True)
class TokenInput:
    """How a model takes token ids.

    Attributes:
        vocab: ids are drawn from ``[0, vocab)``.
        positions: the longest sequence the model takes (None: no limit found).
        keyword: a Hugging Face model: ids passed as ``input_ids=`` with ``use_cache=False``.
        heads: the model's head counts (a probe length to avoid).
        embedding: the module the ids index (for messages).
    """

    vocab: int
    positions: Optional[int]
    keyword: bool
    heads: frozenset[int]
    embedding: str


def _ints(holder: Any, names: tuple[str, ...]) -> list[int]:
    values = [getattr(holder, n, None) for n in names] if holder is not None else []
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]


def _head_counts(model: torch.nn.Module, config: Any) -> frozenset[int]:
    counts = _ints(config, HEAD_ATTRS + KV_HEAD_ATTRS)
    for m in model.modules():
        counts += _ints(m, HEAD_ATTRS + KV_HEAD_ATTRS) if any(a in vars(m) for a in HEAD_ATTRS) else []
    return frozenset(counts)


def _takes_token_ids(model: torch.nn.Module) -> bool:
    """``model.forward``'s first parameter is named like token ids and can be the only
    argument."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward inspect cannot read (a C function): no probe
        return False
    params = list(signature.parameters.values())
    if not params or params[0].name not in TOKEN_PARAMS or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return False
    try:
        signature.bind(None)
    except TypeError:  # more required arguments (megatron-core's GPTModel: position_ids, attention_mask)
        return False
    return True


def token_input(model: torch.nn.Module) -> Optional[TokenInput]:
    """How ``model`` takes token ids (see the module docstring), or None."""
    config = getattr(model, "config", None)
    hf = isinstance(getattr(config, "model_type", None), str)
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    if hf and _ints(config, ("vocab_size",)):
        vocab, name, others = _ints(config, ("vocab_size",))[0], "config.vocab_size", []
    elif not hf and embeddings and _takes_token_ids(model):
        name, first = embeddings[0]
        vocab, others = first.num_embeddings, [m.num_embeddings for _, m in embeddings[1:]]
    else:
        return None
    holders = (config, getattr(model, "model_args", None))
    lengths = [v for h in holders for v in _ints(h, _LENGTH_ATTRS)[:1]] + others
    return TokenInput(vocab, min(lengths) if lengths else None, hf, _head_counts(model, config), name)


def auto_probe(model: torch.nn.Module) -> Optional[Callable[[torch.nn.Module], Any]]:
    """The automatic probe of a model that takes token ids (:func:`token_input`), else None."""
    tokens = token_input(model)
    if tokens is None:
        return None
    seq = max(2, min(_PROBE_LENGTH, tokens.positions or _PROBE_LENGTH))
    while seq > 2 and seq in tokens.heads:
        seq -= 1
    ids = torch.randint(0, tokens.vocab, (2, seq), generator=torch.Generator().manual_seed(1234))

    def run(m: torch.nn.Module) -> Any:
        device = next(m.parameters()).device
        return m(input_ids=ids.to(device), use_cache=False) if tokens.keyword else m(ids.to(device))

    return run


def make_probe(model: torch.nn.Module, verify: Any) -> Callable[[torch.nn.Module], Any]:
    """The probe callable for ``wrap(verify=...)``; ValueError for what cannot be one."""
    if verify is True:
        probe = auto_probe(model)
        if probe is None:
            raise ValueError(f"wrap(verify=True): no automatic probe for this model (only {WHO_GETS_ONE} get one); "
                             f"pass verify=<input tensor | tuple of args | dict of kwargs | callable(model) -> output>")
        return probe
    if isinstance(verify, torch.Tensor):
        return lambda m: m(verify)
    if isinstance(verify, tuple):
        return lambda m: m(*verify)
    if isinstance(verify, Mapping):
        return lambda m: m(**verify)
    if callable(verify):
        return verify
    raise ValueError(f"wrap: verify must be None, True, a tensor, a tuple, a dict or a callable(model), "
                     f"got {type(verify).__name__}")
