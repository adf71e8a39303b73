"""``wrap()`` on models that are not Hugging Face's (issue 39): nanoGPT and torchtitan's Llama.

Gloo, CPU, 2 ranks, one start; hidden 48, 6 heads (torchtitan: 2 KV heads), vocabulary 97,
TP=2, float64, every parameter perturbed. Both take token ids (nanoGPT's ``idx``,
torchtitan's ``tokens``), so ``wrap`` builds its automatic probe for them and verifies
by default:

* nanoGPT (a copy of karpathy's ``model.py``, its flash-attention path):

  - ``"column"`` on the fused ``c_attn`` is refused at ``wrap()`` time naming
    ``FusedColumn(3)``, with ``verify=False`` too (the trace runs on the probe anyway);
  - the plan a user writes (``c_attn`` ``FusedColumn(3)``, ``c_proj`` row, ``mlp.c_fc``
    column, ``mlp.c_proj`` row) is refused at ``wrap()`` time with one message: nanoGPT's
    attention takes its head size from its input's width (``C // self.n_head`` with
    ``C = x.size(-1)``), which stays whole on every rank, so no attribute wrap can set
    makes it run on half of the heads. The refusal names the attention, its plan entries
    and the exclude; with that exclude (the MLP sharded, the attention replicated) the
    model matches the unwrapped one;
  - the same plan on a nanoGPT whose attention reads its widths from its attributes
    (``self.n_embd // self.n_head``) matches the unwrapped model: wrap halves ``n_head``
    and ``n_embd`` (the fused parts' size, where ``c_attn``'s output is split);

* torchtitan's Llama with a naive sequence-parallel plan (its norms ``"sequence_parallel"``,
  ``sequence_parallel=True``, nothing scattering the sequence or slicing ``freqs_cis``) is
  refused at ``wrap()`` time naming those plan entries and ``sequence_parallel=False``;
  that plan with ``sequence_parallel=False`` matches the unwrapped model.

Outside the ranks: which models get an automatic probe, and its length.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import case_values, run_cases, run_distributed
from tp_fuse.layers.wrap.probe import auto_probe, token_input
from tp_fuse.layers.wrap.verify import TOLERANCE

H, HEADS, KV, V, POSITIONS = 48, 6, 2, 97, 16
F64 = torch.float64
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


# ---- nanoGPT (karpathy/nanoGPT model.py) ---------------------------------------------------


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused ``c_attn`` split at ``n_embd``, heads by ``n_head``."""

    def __init__(self, config: "GPTConfig") -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class AttributeWidthAttention(CausalSelfAttention):
    """nanoGPT's attention with its widths read from its attributes, not from ``x``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k, q, v = (t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2) for t in (k, q, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd)))


class MLP(nn.Module):
    """nanoGPT's MLP."""

    def __init__(self, config: "GPTConfig") -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """nanoGPT's pre-norm block."""

    def __init__(self, config: "GPTConfig") -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = config.attention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = POSITIONS
    vocab_size: int = V
    n_layer: int = 2
    n_head: int = HEADS
    n_embd: int = H
    dropout: float = 0.0
    bias: bool = True
    attention: type = CausalSelfAttention  # the test's switch (nanoGPT has one attention)


class GPT(nn.Module):
    """nanoGPT's GPT: ``forward(idx, targets=None) -> (logits, loss)``, tied ``lm_head``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Any:
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: the last position only
            loss = None
        return logits, loss


NANO_PLAN = {"transformer.h.*.attn.c_attn": "FusedColumn(3)", "transformer.h.*.attn.c_proj": "row",
             "transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"}


# ---- torchtitan's Llama (torchtitan/models/llama3/model) ----------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    return freqs_cis.view(*[d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)])


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


@dataclass
class ModelArgs:
    dim: int = H
    n_layers: int = 2
    n_heads: int = HEADS
    n_kv_heads: int = KV
    vocab_size: int = V
    hidden_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = POSITIONS


class Attention(nn.Module):
    """torchtitan's attention: views with ``-1`` heads (TP-ready), GQA by ``n_rep``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    """torchtitan's SwiGLU feed-forward."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """torchtitan's block: ``attention_norm`` / ``ffn_norm`` RMSNorms around the residual."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.dim = args.n_heads, args.dim
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama: ``forward(tokens)``, rotary tables in the ``freqs_cis`` buffer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                                               args.rope_theta), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, input_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


TITAN_TP = {"layers.*.attention.wq": "column", "layers.*.attention.wk": "column", "layers.*.attention.wv": "column",
            "layers.*.attention.wo": "row", "layers.*.feed_forward.w1": "column",
            "layers.*.feed_forward.w3": "column", "layers.*.feed_forward.w2": "row"}
# What a user porting torchtitan's SP plan writes: its SequenceParallel() norms.
TITAN_SP = {**TITAN_TP, "layers.*.attention_norm": "sequence_parallel", "layers.*.ffn_norm": "sequence_parallel",
            "norm": "sequence_parallel"}


# ---- the ranks -----------------------------------------------------------------------------


def _perturbed(model: nn.Module) -> nn.Module:
    """``model`` in float64 with every parameter moved off its init (norm weights 1, biases
    0 would hide a misplaced shard); the same on every rank."""
    g = torch.Generator().manual_seed(7)
    model = model.to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=F64))
    return model


def _nanogpt(attention: type = CausalSelfAttention) -> nn.Module:
    torch.manual_seed(0)
    return _perturbed(GPT(GPTConfig(attention=attention)))


def _titan() -> nn.Module:
    torch.manual_seed(0)
    return _perturbed(Transformer(ModelArgs()))


def _plan(plan: dict[str, str]) -> dict[str, Any]:
    from tp_fuse.layers import FusedColumn

    return {k: FusedColumn(3) if v == "FusedColumn(3)" else v for k, v in plan.items()}


def _wrap(model: nn.Module, **kw: Any) -> str:
    """``"verified: ..."`` or the error's text."""
    from tp_fuse.layers import wrap

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = wrap(model, dist.new_group([0, 1]), verbose=False, **kw)
    except Exception as e:  # noqa: BLE001 - the tests read what kind of error it was
        return f"{type(e).__name__}: {e}"
    return f"verified: {wrapped.tp_fuse_wrap_report.verified}"


def _against_unwrapped(make: Callable[[], nn.Module], **kw: Any) -> dict[str, Any]:
    """Wrap ``make()`` (verified by default), then one forward and backward on a batch that
    is not the probe against the unwrapped model: the largest relative difference of the
    logits and of every gradient (sharded ones gathered)."""
    from tp_fuse.layers import wrap
    from tp_fuse.layers.sharding import gather_tensor

    group = dist.new_group([0, 1])
    ref = make()
    model = wrap(copy.deepcopy(ref), group, verbose=False, **kw)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (ref, model):
        out = m(ids)
        logits = out[0] if isinstance(out, tuple) else out
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
        (logits * w).sum().backward()
        outs.append(logits.detach())
    params = dict(model.named_parameters())
    grads = {}
    for name, p in ref.named_parameters():
        got = gather_tensor(params[name].grad, getattr(params[name], "tp_shard", None), group)
        grads[name] = ((got - p.grad).abs().max() / p.grad.abs().max()).item()
    report = model.tp_fuse_wrap_report
    return {"verified": report.verified, "localized": report.localized,
            "converted": [n for n, _ in report.converted],
            "logits": ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item(), "grads": grads}


@case
def nanogpt(rank: int, world: int) -> Any:
    column = {**NANO_PLAN, "transformer.h.*.attn.c_attn": "column"}
    return {
        "column": _wrap(_nanogpt(), plan=column),
        "column_unverified": _wrap(_nanogpt(), plan=column, verify=False),
        "fused": _wrap(_nanogpt(), plan=_plan(NANO_PLAN)),
        # What the refusal of "fused" says to do.
        "excluded": _against_unwrapped(_nanogpt, plan=_plan(NANO_PLAN), exclude=["transformer.h.*.attn"]),
        "attribute_widths": _against_unwrapped(lambda: _nanogpt(AttributeWidthAttention), plan=_plan(NANO_PLAN)),
    }


@case
def torchtitan(rank: int, world: int) -> Any:
    return {
        "sp": _wrap(_titan(), plan=TITAN_SP, sequence_parallel=True),
        # What the refusal says to write.
        "no_sp": _against_unwrapped(_titan, plan=TITAN_SP, sequence_parallel=False),
    }


def _run_all_cases(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    return run_cases(_CASES, rank, world)


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(2, _run_all_cases, timeout=300)


def _one_refusal(text: str) -> None:
    """Refused before anything changed, in one message."""
    assert text.startswith("ValueError: wrap: cannot convert the model:"), text
    assert text.count("\n  - ") == 1, text


def _matches(v: dict[str, Any]) -> None:
    tol = TOLERANCE[F64]
    assert v["verified"].startswith("outputs and every gradient match the original on the probe"), v["verified"]
    assert v["logits"] < tol, v["logits"]
    worst = max(v["grads"], key=v["grads"].get)
    assert v["grads"][worst] < tol, (worst, v["grads"][worst])


@pytest.mark.multirank
def test_nanogpt_fused_c_attn_as_column_refused_naming_the_fused_column(results) -> None:
    v = case_values(results, "nanogpt")[0]
    for key in ("column", "column_unverified"):
        _one_refusal(v[key])
        assert ("transformer.h.*.attn.c_attn: plan['transformer.h.*.attn.c_attn'] = 'column', but the model's forward "
                "(split in transformer.h.*.attn) has its output cut into parts of [48, 48, 48] features") in v[key], v
        assert "Write plan['transformer.h.*.attn.c_attn'] = FusedColumn(3)" in v[key], v[key]


@pytest.mark.multirank
def test_nanogpt_attention_refused_at_wrap_time_and_its_exclude_is_correct(results) -> None:
    v = case_values(results, "nanogpt")[0]
    lines = v["fused"].split("\n  - ")
    assert lines[0].startswith("ValueError: wrap(verify=...): the wrapped model does not match"), v["fused"]
    assert lines[1].startswith("TP ranks 0, 1: the wrapped model raised in transformer.h.0.attn (RuntimeError: "
                               "shape '[2, 8, 3, 16]' is invalid"), v["fused"]
    assert "a width read from the module's input, which stays whole: nanoGPT's C = x.size(-1)" in lines[1], lines[1]
    assert ("Plan entries sharding transformer.h.0.attn: transformer.h.0.attn.c_attn: "
            "plan['transformer.h.*.attn.c_attn'] = FusedColumn(3)") in lines[1], lines[1]
    assert "Exclude 'transformer.h.*.attn' (it stays replicated)" in lines[1], lines[1]
    excluded = v["excluded"]
    _matches(excluded)
    assert excluded["converted"] == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                                     "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"], excluded["converted"]


@pytest.mark.multirank
def test_nanogpt_attention_with_attribute_widths_matches_the_unwrapped_model(results) -> None:
    v = case_values(results, "nanogpt")[0]["attribute_widths"]
    _matches(v)
    assert ("transformer.h.0.attn", "n_head 6 -> 3, n_embd 48 -> 24") in v["localized"], v["localized"]
    assert "transformer.h.1.attn.c_attn" in v["converted"], v["converted"]


@pytest.mark.multirank
def test_naive_sequence_parallel_plan_on_torchtitan_refused_naming_the_entries(results) -> None:
    v = case_values(results, "torchtitan")[0]
    _one_refusal(v["sp"])
    assert ("plan['layers.*.attention_norm'] = 'sequence_parallel', plan['layers.*.ffn_norm'] = 'sequence_parallel', "
            "plan['norm'] = 'sequence_parallel' with wrap(sequence_parallel=True)") in v["sp"], v["sp"]
    assert "Transformer embeds token ids itself (tok_embeddings)" in v["sp"], v["sp"]
    assert "Write wrap(..., sequence_parallel=False)" in v["sp"], v["sp"]
    _matches(v["no_sp"])
    assert len(v["no_sp"]["converted"]) == 19, v["no_sp"]["converted"]  # 14 projections, 5 norms kept


def test_automatic_probe_for_models_that_take_token_ids() -> None:
    nano = token_input(GPT(GPTConfig()))
    assert (nano.vocab, nano.positions, nano.keyword, nano.embedding) == (V, POSITIONS, False, "transformer.wte")
    titan = token_input(Transformer(ModelArgs(max_seq_len=6)))
    assert (titan.vocab, titan.positions, titan.embedding) == (V, 6, "tok_embeddings"), titan
    # The probe is as long as the model allows, and no head count (6 heads, 2 KV heads).
    ids = auto_probe(Transformer(ModelArgs(max_seq_len=6)))(_Record())
    assert ids.shape == (2, 5) and int(ids.max()) < V, ids


class _Record(nn.Module):
    """Returns the probe's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class _Positional(nn.Module):
    """megatron-core GPTModel's signature: more required arguments than the token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, 8)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids + position_ids)


class _Activations(nn.Module):
    """A model on activations (``x``): no token ids to draw."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("model", [_Positional, _Activations, lambda: nn.Linear(2, 2)])
def test_no_automatic_probe_without_token_ids(model: Callable[[], nn.Module]) -> None:
    assert token_input(model()) is None and auto_probe(model()) is None
