"""The plain-torch references of ``examples/bench_gpu.py``'s ``torch_bf16`` rows: the block,
the transformer layer and the GPT written in ``torch.nn`` / ``torch.nn.functional``, each a
copy of a tp_fuse model's weights (so parity compares the same function at the same init).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tp_fuse import ops
from tp_fuse.layers import GPT, TransformerLayer
from tp_fuse.layers.rope import apply_rotary
from tp_fuse.layers.sharding import set_shard_spec

__all__ = ["TorchBlock", "TorchGPT", "TorchLayer", "torch_gpt_factory"]


def _param(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[nn.Parameter]:
    """A copy of ``t`` in the benchmark's dtype: plain torch bf16 keeps every parameter in bf16."""
    return None if t is None else nn.Parameter(t.detach().to(dtype).clone())


def _norm(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], eps: float, rms: bool) -> torch.Tensor:
    """RMSNorm or LayerNorm over the last dimension, as ``torch.nn.functional`` computes it."""
    if rms:
        return F.rms_norm(x, x.shape[-1:], w, eps)
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


class TorchBlock(nn.Module):
    """LayerNorm -> Linear -> GELU(tanh) -> Linear in plain ``torch.nn``, a copy of ``seq``'s weights."""

    def __init__(self, seq: ops.Sequential, dtype: torch.dtype) -> None:
        super().__init__()
        ln, fc1, _, fc2 = list(seq)
        self.ln = nn.LayerNorm(ln.weight.shape[0], eps=ln.eps, device=ln.weight.device, dtype=dtype)
        self.fc1, self.fc2 = (nn.Linear(*reversed(f.weight.shape), device=f.weight.device, dtype=dtype)
                              for f in (fc1, fc2))
        with torch.no_grad():
            for mine, theirs in ((self.ln, ln), (self.fc1, fc1), (self.fc2, fc2)):
                mine.weight.copy_(theirs.weight)
                mine.bias.copy_(theirs.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


class TorchLayer(nn.Module):
    """A ``tp_fuse.layers.TransformerLayer`` (TP=1) in plain torch, a copy of its weights:
    ``h = x + proj(SDPA(rope(qkv(norm1(x)))))``, ``y = h + fc2(act(fc1(norm2(h))))``.
    The fused qkv weight keeps Megatron's grouped layout ``[g, n/g + 2, d]``; SwiGLU's
    gate is fc1's first half, as in ``tp_fuse.ops.SwiGLU``."""

    def __init__(self, layer: TransformerLayer, dtype: torch.dtype) -> None:
        super().__init__()
        att, mlp = layer.attention, layer.mlp
        sd = {k: v for k, v in layer.state_dict().items() if not k.endswith("_extra_state")}
        names = {"n1w": "attention.qkv.ops.norm.weight", "n1b": "attention.qkv.ops.norm.bias",
                 "qkv_w": "attention.qkv.ops.linear.weight", "qkv_b": "attention.qkv.ops.bias.bias",
                 "proj_w": "attention.proj.linear.weight", "proj_b": "attention.proj.bias.bias",
                 "n2w": "mlp.fc1.norm.weight", "n2b": "mlp.fc1.norm.bias",
                 "fc1_w": "mlp.fc1.linear.weight", "fc1_b": "mlp.fc1.bias.bias",
                 "fc2_w": "mlp.fc2.linear.weight", "fc2_b": "mlp.fc2.bias.bias"}
        for attr, key in names.items():
            self.register_parameter(attr, _param(sd.get(key), dtype))
        self.rms = "RMSNorm" in type(att.qkv.ops.norm).__name__
        self.eps1, self.eps2 = att.qkv.ops.norm.eps, mlp.fc1.norm.eps
        self.heads, self.groups, self.d = att.num_heads, att.num_query_groups, att.head_dim
        self.rotary = copy.deepcopy(att.rotary)
        self.swiglu = mlp.activation == "swiglu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        n, g, d = self.heads, self.groups, self.d
        qkv = F.linear(_norm(x, self.n1w, self.n1b, self.eps1, self.rms), self.qkv_w, self.qkv_b)
        qkv = qkv.view(s, b, g, n // g + 2, d)
        q, k, v = qkv[:, :, :, : n // g].reshape(s, b, n, d), qkv[:, :, :, n // g], qkv[:, :, :, n // g + 1]
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(s, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != n)
        h = x + F.linear(o.permute(2, 0, 1, 3).reshape(s, b, n * d), self.proj_w, self.proj_b)
        u = F.linear(_norm(h, self.n2w, self.n2b, self.eps2, self.rms), self.fc1_w, self.fc1_b)
        if self.swiglu:
            gate, up = u.chunk(2, dim=-1)
            u = F.silu(gate) * up
        else:
            u = F.gelu(u, approximate="tanh")
        return h + F.linear(u, self.fc2_w, self.fc2_b)


class TorchGPT(nn.Module):
    """``tp_fuse.layers.GPT`` (TP=1) in plain torch, a copy of its weights: the launcher's
    ``model_factory`` for the ``torch_bf16`` GPT rows (``forward(tokens, labels) -> loss``)."""

    def __init__(self, ref: GPT, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding = _param(ref.embedding.weight, dtype)
        self.position = _param(ref.position.weight, dtype) if ref.position is not None else None
        self.layers = nn.ModuleList(TorchLayer(layer, dtype) for layer in ref.layers)
        self.final_w = _param(ref.final_norm.weight, dtype)
        self.final_b = _param(getattr(ref.final_norm, "bias", None), dtype)
        self.final_eps, self.rms = ref.final_norm.eps, ref.config.normalization == "RMSNorm"
        self.output = self.embedding if ref.config.tie_embeddings else _param(ref.output_weight, dtype)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens.t(), self.embedding)  # [s, b, h]
        if self.position is not None:
            x = x + self.position[: tokens.shape[1]].unsqueeze(1)
        for layer in self.layers:
            x = layer(x)
        x = _norm(x, self.final_w, self.final_b, self.final_eps, self.rms)
        logits = F.linear(x, self.output)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten())


def torch_gpt_factory(config, *, tp_group=None, dtype=torch.float32, device=None, seed=0, **_unused) -> TorchGPT:
    """Build tp_fuse's GPT with the launcher's seed (the same init), then its plain-torch copy."""
    if tp_group is not None:
        raise ValueError("torch_bf16 GPT rows run at parallel.tp=1")
    model = TorchGPT(GPT(config, dtype=dtype, device=device, seed=seed), dtype)
    for p in model.parameters():
        set_shard_spec(p, None)  # replicated: what the launcher's gradient norm asks of every parameter
    return model
