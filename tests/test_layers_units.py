"""Single-process tests of the layers package: math against independent float64 references,
sharding helpers, initialization, RNG streams and input validation (TP size 1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tp_fuse.layers import (
    GPT,
    DropoutRNG,
    GPTConfig,
    LayerNormLinear,
    LayerNormMLP,
    MultiheadAttention,
    RowParallelLinear,
    ShardSpec,
    TransformerLayer,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from tp_fuse.layers.rope import RotaryEmbedding, apply_rotary
from tp_fuse.layers.sharding import full_state_dict, load_full_state_dict

TINY = dict(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=2, num_heads=4)


# ---- sharding and init ------------------------------------------------------------------


def test_shard_tensor_blocks_slice_each_part_separately() -> None:
    full = torch.arange(8 * 3).reshape(8, 3)
    gate, up = full[:4], full[4:]
    for rank in range(2):
        shard = shard_tensor(full, ShardSpec(dim=0, blocks=2), rank, 2)
        torch.testing.assert_close(shard, torch.cat([gate[2 * rank:2 * rank + 2], up[2 * rank:2 * rank + 2]]))
    cols = shard_tensor(full, ShardSpec(dim=1), 1, 3)
    torch.testing.assert_close(cols, full[:, 1:2])
    with pytest.raises(ValueError, match="cannot shard dimension 0 of size 8"):
        shard_tensor(full, ShardSpec(dim=0, blocks=3), 0, 2)


def test_init_is_seeded_by_name_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = full_state_dict(GPT(GPTConfig(**TINY), seed=7), None)
    assert torch.equal(torch.get_rng_state(), before), "init must not consume the caller's RNG"
    b = full_state_dict(GPT(GPTConfig(**TINY), seed=7), None)
    c = full_state_dict(GPT(GPTConfig(**TINY), seed=8), None)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    differing = [k for k in a if a[k].std() > 0 and not torch.equal(a[k], c[k])]
    assert len(differing) >= 10, differing  # every random weight depends on the seed
    # Two layers never share weights (seeds derive from the parameter's name).
    assert not torch.equal(a["layers.0.mlp.fc1.linear.weight"], a["layers.1.mlp.fc1.linear.weight"])


def test_load_full_state_dict_reports_every_mismatch() -> None:
    model = GPT(GPTConfig(**TINY))
    full = full_state_dict(model, None)
    full.pop("final_norm.weight")
    full["bogus"] = torch.zeros(1)
    full["embedding.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"(?s)missing: \['final_norm.weight'\].*unexpected: \['bogus'\].*embedding.weight"):
        load_full_state_dict(model, full, None)


def test_scaled_init_for_output_projections() -> None:
    cfg = GPTConfig(**{**TINY, "num_layers": 8, "hidden_size": 128, "num_heads": 4, "init_std": 0.02})
    layer = TransformerLayer.from_config(cfg)
    std_fc1 = layer.mlp.fc1.linear.weight.std().item()
    std_fc2 = layer.mlp.fc2.linear.weight.std().item()
    assert std_fc1 == pytest.approx(0.02, rel=0.05)
    assert std_fc2 == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


# ---- math against float64 references -------------------------------------------------------


def test_cross_entropy_matches_torch_with_ignore_index() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (5, 3), generator=gen)
    labels[0, 1] = -100
    loss = vocab_parallel_cross_entropy(logits, labels, None)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 11\)"):
        vocab_parallel_cross_entropy(logits, torch.full((5, 3), 11), None)
    with pytest.raises(ValueError, match="ignore_index"):
        vocab_parallel_cross_entropy(logits, torch.full((5, 3), -100), None)


def test_rope_matches_complex_rotation() -> None:
    # Independent formulation: pair (x_i, x_{i+d/2}) as a complex number, rotate by p * theta^(-2i/d).
    s, b, n, d = 6, 2, 3, 8
    x = torch.randn(s, b, n, d, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    rope = RotaryEmbedding(d, theta=500.0)
    cos, sin = rope.cos_sin(s, x.device)
    got = apply_rotary(x, cos, sin)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    angle = torch.arange(s).double()[:, None] * 500.0 ** (-torch.arange(0, d, 2).double() / d)
    rotated = z * torch.polar(torch.ones_like(angle), angle)[:, None, None, :]
    ref = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even head dimension"):
        RotaryEmbedding(7)


def _reference_attention(x, attn: MultiheadAttention, rope: bool) -> torch.Tensor:
    """float64 causal GQA attention from the TP=1 weights, written out by hand."""
    x = x.double()
    norm = attn.qkv.ops.norm
    h = F.layer_norm(x, (x.shape[-1],), norm.weight.double(), norm.bias.double(), norm.eps)
    qkv = h @ attn.qkv.weight.double().t() + attn.qkv.bias.double()
    s, b, _ = x.shape
    n, g, d = attn.num_heads, attn.num_query_groups, attn.head_dim
    qkv = qkv.view(s, b, g, n // g + 2, d)
    q = qkv[:, :, :, : n // g].reshape(s, b, n, d)
    k = qkv[:, :, :, n // g]
    v = qkv[:, :, :, n // g + 1]
    if rope:
        cos, sin = attn.rotary.cos_sin(s, x.device)
        q, k = apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double())
    k = k.repeat_interleave(n // g, dim=2)
    v = v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * d)
    proj = attn.proj.linear.weight.double()
    return x + ctx @ proj.t() + attn.proj.bias.bias.double()


@pytest.mark.parametrize("groups,rope", [(4, False), (2, True), (1, False)])
def test_attention_matches_reference(groups: int, rope: bool) -> None:
    attn = MultiheadAttention(32, 4, num_query_groups=groups, residual_connection=True,
                              position_embedding="rope" if rope else "none", seed=3)
    with torch.no_grad():
        attn.proj.bias.bias.normal_()
        attn.qkv.bias.normal_()
    x = torch.randn(7, 2, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(attn(x).double(), _reference_attention(x, attn, rope), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_mlp_matches_reference(activation: str) -> None:
    mlp = LayerNormMLP(16, 24, activation=activation, normalization="RMSNorm", residual_connection=True, seed=4)
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(3))
    xd = x.double()
    rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * mlp.fc1.norm.weight.double()
    h = rms @ mlp.fc1.linear.weight.double().t() + mlp.fc1.bias.bias.double()
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)  # TP=1 layout [gate; up]
        h = F.silu(gate) * up
    else:
        h = F.gelu(h, approximate="tanh")
    ref = xd + h @ mlp.fc2.linear.weight.double().t() + mlp.fc2.bias.bias.double()
    torch.testing.assert_close(mlp(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_gpt_loss_matches_plain_pytorch_gpt() -> None:
    """The whole model against a from-scratch float64 GPT on the same weights."""
    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=5)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.randint(0, 64, (2, 16), generator=gen)
    w = {k: v.double() for k, v in full_state_dict(model, None).items()}
    x = w["embedding.weight"][tokens.t()] + w["position.weight"][:16, None, :]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = F.layer_norm(x, (32,), w[p + "attention.qkv.ops.norm.weight"], w[p + "attention.qkv.ops.norm.bias"])
        qkv = h @ w[p + "attention.qkv.ops.linear.weight"].t() + w[p + "attention.qkv.ops.bias.bias"]
        qkv = qkv.view(16, 2, 4, 3, 8)  # MHA: per head [q, k, v] x head_dim
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        ctx = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        ctx = ctx.permute(2, 0, 1, 3).reshape(16, 2, 32)
        x = x + ctx @ w[p + "attention.proj.linear.weight"].t() + w[p + "attention.proj.bias.bias"]
        h = F.layer_norm(x, (32,), w[p + "mlp.fc1.norm.weight"], w[p + "mlp.fc1.norm.bias"])
        h = F.gelu(h @ w[p + "mlp.fc1.linear.weight"].t() + w[p + "mlp.fc1.bias.bias"], approximate="tanh")
        x = x + h @ w[p + "mlp.fc2.linear.weight"].t() + w[p + "mlp.fc2.bias.bias"]
    x = F.layer_norm(x, (32,), w["final_norm.weight"], w["final_norm.bias"])
    logits = x @ w["embedding.weight"].t()  # tied output layer
    ref = F.cross_entropy(logits.reshape(-1, 64), labels.t().reshape(-1))
    assert model(tokens, labels).item() == pytest.approx(ref.item(), rel=1e-5)


# ---- dropout RNG ----------------------------------------------------------------------------


def test_dropout_rng_streams() -> None:
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    r0, r1 = DropoutRNG(11, tp_rank=0), DropoutRNG(11, tp_rank=1)
    draws = {}
    for name, rng in (("r0", r0), ("r1", r1)):
        for stream in ("replicated", "tp_local"):
            with rng.fork(stream):
                draws[name, stream] = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), outside), "fork must restore the caller's RNG"
    assert torch.equal(draws["r0", "replicated"], draws["r1", "replicated"])
    assert not torch.equal(draws["r0", "tp_local"], draws["r1", "tp_local"])
    # A stream continues where it left off (not re-seeded each fork).
    state = r0.state_dict()
    with r0.fork("replicated"):
        nxt = torch.rand(8)
    assert not torch.equal(nxt, draws["r0", "replicated"])
    r0.load_state_dict(state)
    with r0.fork("replicated"):
        assert torch.equal(torch.rand(8), nxt)


def test_dropout_is_reproducible_and_off_in_eval() -> None:
    cfg = GPTConfig(**{**TINY, "hidden_dropout": 0.2, "attention_dropout": 0.2})
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = GPT(cfg, seed=1), GPT(cfg, seed=1)
    la, lb = a(tokens, tokens), b(tokens, tokens)
    assert la.item() == lb.item()
    assert a(tokens, tokens).item() != la.item()  # the stream advanced: new masks
    a.eval()
    assert a(tokens, tokens).item() == a(tokens, tokens).item()


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(normalization="BatchNorm"), "model.normalization"),
        (dict(activation="relu"), "model.activation"),
        (dict(position_embedding="alibi"), "model.position_embedding"),
        (dict(num_heads=5), r"model.hidden_size \(32\) must be divisible by model.num_heads \(5\)"),
        (dict(num_query_groups=3), r"model.num_heads \(4\) must be divisible by model.num_query_groups \(3\)"),
        (dict(hidden_size=0), "model.hidden_size must be a positive int"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPT(GPTConfig(**{**TINY, **kwargs}))


def test_bad_inputs_raise_value_error() -> None:
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        model(torch.zeros(2, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        model(torch.full((2, 4), 64))
    with pytest.raises(ValueError, match="tokens must be"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="overlap must be a tp_fuse.overlap.config.TPOverlap"):
        LayerNormLinear(8, 8, overlap={"method": "bulk"})
    with pytest.raises(ValueError, match="activation must be one of .*'swiglu'"):
        LayerNormMLP(8, 8, activation="tanh")
    with pytest.raises(ValueError, match="activation_params"):
        LayerNormMLP(8, 8, activation="swiglu", activation_params={"limit": 7.0})
    with pytest.raises(ValueError, match="return_layernorm_output are exclusive"):
        LayerNormLinear(8, 8, return_residual=True, return_layernorm_output=True)
    with pytest.raises(ValueError, match="tp_group must be a torch.distributed.ProcessGroup"):
        LayerNormLinear(8, 8, tp_group="tp")
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        TransformerLayer(8, 8, 2, num_layers=0)


def test_layernorm_mlp_without_dropout_makes_no_rng_stream() -> None:
    # TE's LayerNormMLP (device="cuda" in TE's tests) is built on this block: without dropout
    # no stream is drawn from, so none is made (a CUDA generator needs a CUDA build).
    assert LayerNormMLP(8, 16).rng is None
    assert LayerNormMLP(8, 16, hidden_dropout=0.1).rng is not None
