"""Model configuration shared by ``layers`` and the launcher.

Plain dataclasses: ``launch/`` converts the Hydra config into these once and
validates; model code only reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional


@dataclasses.dataclass
class GPTConfig:
    """Architecture of a GPT model (global sizes, independent of TP size)."""

    vocab_size: int = 256
    max_seq_len: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    #: Grouped-query attention: number of K/V head groups (None: = num_heads).
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden (GELU) or 8/3 * hidden rounded (SwiGLU)
    activation: Literal["gelu", "swiglu"] = "gelu"
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    #: ``"alibi"`` (a per-head bias on the attention scores, no position table) describes a
    #: Hugging Face model built by transformers (``+model=hf``: Bloom); tp-fuse's own models
    #: implement ``"learned"`` and ``"rope"`` (:meth:`validate` refuses ``"alibi"`` for them).
    position_embedding: Literal["learned", "rope", "alibi"] = "learned"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def kv_groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * ((8 * self.hidden_size // 3 + 63) // 64)
        return 4 * self.hidden_size

    def validate(self, tp_size: int = 1, *, alibi: bool = False) -> None:
        """Raise ValueError naming the field for an inconsistent configuration.

        ``alibi``: accept ``position_embedding="alibi"`` (only for sizes describing a model
        that transformers builds, ``+model=hf``; tp-fuse's GPT has no ALiBi)."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in ("vocab_size", "max_seq_len", "hidden_size", "num_layers", "num_heads"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"model.{name} must be a positive int, got {value!r}")
        need(self.hidden_size % self.num_heads == 0,
             f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})")
        need(self.num_heads % self.kv_groups == 0,
             f"model.num_heads ({self.num_heads}) must be divisible by model.num_query_groups ({self.kv_groups})")
        need(self.activation in ("gelu", "swiglu"), f"model.activation must be 'gelu' or 'swiglu', got {self.activation!r}")
        need(self.normalization in ("LayerNorm", "RMSNorm"),
             f"model.normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")
        positions = ("learned", "rope", "alibi") if alibi else ("learned", "rope")
        need(self.position_embedding in positions,
             f"model.position_embedding must be 'learned' or 'rope', got {self.position_embedding!r}"
             + (" (ALiBi is read from a Hugging Face Bloom config.json by +model=hf only)"
                if self.position_embedding == "alibi" else ""))
        if self.position_embedding == "rope":
            need(self.head_dim % 2 == 0, f"RoPE needs an even head dimension, got {self.head_dim}")
        for name, value in (("num_heads", self.num_heads), ("num_query_groups", self.kv_groups),
                            ("hidden_size", self.hidden_size), ("ffn_hidden_size", self.ffn_size),
                            ("vocab_size", self.vocab_size)):
            need(value % tp_size == 0, f"parallel.tp ({tp_size}) must divide model.{name} ({value})")
