"""TE's ``te.MultiheadAttention`` and ``te.TransformerLayer`` on tp_fuse's module classes.

Float64 references with hand-written attention (causal, no mask, arbitrary mask, GQA, both
QKV layouts), TE's defaults (dropouts, mask type, ``input_layernorm=False``, ``return_bias``),
the residual variants, refused arguments, the debug names reaching nvdlfw-inspect, and
tensor parallelism on 2 gloo ranks against the TP=1 layer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import nvdlfw_inspect.api as debug_api
import tp_fuse as te
from debug_logging import start_debug
from dist_utils import run_distributed

torch.set_num_threads(1)

S, B, H, FFN, N, G = 5, 3, 16, 24, 4, 2  # seq, batch, hidden, ffn, heads, GQA groups


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (biases and norm weights start at 0 / 1 in TE)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _attention(q, k, v, mask=None, causal=True):
    """Hand-written softmax(q k^T / sqrt(d)) v, q [s, b, n, d], k/v [s, b, g, d] -> [s, b, n*d];
    query head i uses group i // (n/g); ``mask`` True = masked out."""
    s, b, n, d = q.shape
    k = k.repeat_interleave(n // k.shape[2], dim=2)
    v = v.repeat_interleave(n // v.shape[2], dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v)
    return ctx.reshape(s, b, n * d)


def _split(qkv, n, g, interleaved):
    s, b = qkv.shape[:2]
    d = qkv.shape[-1] // (n + 2 * g)
    if interleaved:
        x = qkv.view(s, b, g, n // g + 2, d)
        return x[:, :, :, : n // g].reshape(s, b, n, d), x[:, :, :, -2], x[:, :, :, -1]
    q, k, v = qkv.split([n * d, g * d, g * d], dim=-1)
    return q.reshape(s, b, n, d), k.reshape(s, b, g, d), v.reshape(s, b, g, d)


def _qkv_weight_bias(p, prefix):
    """The QKV GEMM's weight and bias: fused (``fuse_qkv_params``) or TE's split parameters."""
    if prefix + "weight" in p:
        return p[prefix + "weight"], p[prefix + "bias"]
    return (torch.cat([p[f"{prefix}{n}_weight"] for n in ("query", "key", "value")]),
            torch.cat([p[f"{prefix}{n}_bias"] for n in ("query", "key", "value")]))


def _ref_mha(x, att, n, g, *, interleaved=False, mask=None, causal=True):
    """MHA as TE defines it, from the module's own parameters (float64)."""
    p = dict(att.named_parameters())
    ln = None
    if "layernorm_qkv.layer_norm_weight" in p:
        ln = F.layer_norm(x, (x.shape[-1],), p["layernorm_qkv.layer_norm_weight"],
                          p["layernorm_qkv.layer_norm_bias"], 1e-5)
        w, b = _qkv_weight_bias(p, "layernorm_qkv.")
        qkv = ln @ w.T + b
    else:
        w, b = _qkv_weight_bias(p, "qkv.")
        qkv = x @ w.T + b
    q, k, v = _split(qkv, n, g, interleaved)
    return _attention(q, k, v, mask, causal) @ p["proj.weight"].T, p["proj.bias"], ln


def _ref_layer(x, layer, n, g, variant="pre_ln"):
    p = dict(layer.layernorm_mlp.named_parameters())
    att, att_bias, ln1 = _ref_mha(x, layer.self_attention, n, g)

    def mlp(h):
        ln2 = F.layer_norm(h, (h.shape[-1],), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5)
        hid = F.gelu(ln2 @ p["fc1_weight"].T + p["fc1_bias"], approximate="tanh")
        return hid @ p["fc2_weight"].T + p["fc2_bias"], ln2

    if variant == "parallel":
        return x + att + att_bias + mlp(x)[0]
    h = (ln1 if variant == "post_ln_residual" else x) + att + att_bias
    m, ln2 = mlp(h)
    y = (ln2 if variant == "post_ln_residual" else h) + m
    if variant == "output_layernorm":
        lp = dict(layer.layernorm.named_parameters())
        y = F.layer_norm(y, (y.shape[-1],), lp["weight"], lp["bias"], 1e-5)
    return y


_VARIANTS = {
    "pre_ln": {},
    "post_ln_residual": dict(apply_residual_connection_post_layernorm=True),
    "parallel": dict(parallel_attention_mlp=True),
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_transformer_layer_float64_reference_forward_backward(variant):
    torch.manual_seed(0)
    layer = te.TransformerLayer(H, FFN, N, num_gqa_groups=G, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.float64, **_VARIANTS[variant])
    _randomize(layer)
    x = torch.randn(S, B, H, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    xr = x.detach().clone().requires_grad_(True)
    want = _ref_layer(xr, layer, N, G, variant)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *layer.parameters()], dy)
    ref = torch.autograd.grad(want, [xr, *layer.parameters()], dy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_transformer_layer_output_layernorm_reference():
    torch.manual_seed(0)
    layer = te.TransformerLayer(H, FFN, N, hidden_dropout=0.0, attention_dropout=0.0, output_layernorm=True,
                                params_dtype=torch.float64)
    _randomize(layer)
    # TE: with output_layernorm the attention has no input norm (plain Linear "qkv").
    assert hasattr(layer.self_attention, "qkv") and not hasattr(layer.self_attention, "layernorm_qkv")
    x = torch.randn(S, B, H, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _ref_layer(x, layer, N, N, "output_layernorm"), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fuse,interleaved", [(False, True), (True, False), (True, True)])
def test_mha_qkv_layouts_gqa(fuse, interleaved):
    torch.manual_seed(0)
    m = te.MultiheadAttention(H, N, num_gqa_groups=G, attention_dropout=0.0, fuse_qkv_params=fuse,
                              qkv_weight_interleaved=interleaved, params_dtype=torch.float64)
    _randomize(m)
    x = torch.randn(S, B, H, dtype=torch.float64)
    # TE: without fuse_qkv_params the layout is [q; k; v] whatever qkv_weight_interleaved says.
    att, bias, _ = _ref_mha(x, m, N, G, interleaved=fuse and interleaved)
    torch.testing.assert_close(m(x), att + bias, rtol=1e-10, atol=1e-10)


def test_mha_masks_and_kv_channels():
    torch.manual_seed(0)
    m = te.MultiheadAttention(H, N, kv_channels=6, attention_dropout=0.0, attn_mask_type="no_mask",
                              params_dtype=torch.float64)
    _randomize(m)
    assert m.qkv.query_weight.shape == m.qkv.key_weight.shape == (N * 6, H) and m.proj.weight.shape == (H, N * 6)
    x = torch.randn(S, B, H, dtype=torch.float64)
    att, bias, _ = _ref_mha(x, m, N, N, causal=False)
    torch.testing.assert_close(m(x), att + bias, rtol=1e-10, atol=1e-10)
    # The forward's mask type overrides the constructor's; TE ignores attention_mask for it.
    att, _, _ = _ref_mha(x, m, N, N, causal=True)
    junk = torch.ones(B, 1, S, S, dtype=torch.bool)
    torch.testing.assert_close(m(x, attention_mask=junk, attn_mask_type="causal"), att + bias,
                               rtol=1e-10, atol=1e-10)
    mask = torch.rand(B, 1, S, S) < 0.3
    mask[..., 0] = False  # every query keeps one key
    att, _, _ = _ref_mha(x, m, N, N, mask=mask, causal=False)
    torch.testing.assert_close(m(x, attention_mask=mask, attn_mask_type="arbitrary"), att + bias,
                               rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="arbitrary"):
        m(x, attn_mask_type="arbitrary")


def test_mha_te_defaults_return_bias_and_layernorm_output():
    torch.manual_seed(0)
    m = te.MultiheadAttention(64, 4)
    # TE's defaults: no input norm (a plain Linear named qkv), causal, attention dropout 0.1.
    # ... whose weight and bias are TE's split parameters (fuse_qkv_params=False).
    assert [n for n, _ in m.named_parameters()] == [
        "qkv.query_weight", "qkv.key_weight", "qkv.value_weight", "qkv.query_bias", "qkv.key_bias",
        "qkv.value_bias", "proj.weight", "proj.bias"]
    assert m.attn_mask_type == "causal" and m.core_attention.attention_dropout == 0.1
    assert m.input_layernorm is False and m.layer_number == 1 and m.qkv_weight_interleaved is False
    assert abs(m.qkv.query_weight.std().item() - 0.023) < 0.003 and abs(m.proj.weight.std().item() - 0.023) < 0.003
    x = torch.randn(6, 2, 64)
    m.train()
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(2)
    assert not torch.equal(a, m(x))  # attention dropout is on in training
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    # return_bias: proj's bias is returned, not added; return_layernorm_output needs input_layernorm (TE).
    r = te.MultiheadAttention(H, N, attention_dropout=0.0, return_bias=True, return_layernorm_output=True,
                              params_dtype=torch.float64)
    _randomize(r)
    xd = torch.randn(S, B, H, dtype=torch.float64)
    y, bias = r(xd)
    att, want_bias, _ = _ref_mha(xd, r, N, N)
    torch.testing.assert_close(y, att, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(bias, want_bias)
    ln = te.MultiheadAttention(H, N, attention_dropout=0.0, input_layernorm=True, return_bias=True,
                               return_layernorm_output=True, params_dtype=torch.float64)
    _randomize(ln)
    y, bias, ln_out = ln(xd)
    att, want_bias, want_ln = _ref_mha(xd, ln, N, N)
    torch.testing.assert_close(y, att, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ln_out, want_ln, rtol=1e-10, atol=1e-10)


def test_transformer_layer_te_defaults():
    layer = te.TransformerLayer(32, 48, 4)
    assert layer.hidden_dropout == 0.1 and layer.self_attention.core_attention.attention_dropout == 0.1
    assert layer.self_attn_mask_type == "causal" and layer.layer_type == "encoder"
    assert layer.self_attention.input_layernorm and layer.self_attention.return_bias
    assert layer.layernorm_mlp.return_bias and layer.layernorm_mlp.activation == "gelu"
    x = torch.randn(4, 2, 32)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    torch.manual_seed(1)
    a = layer(x)
    torch.manual_seed(2)
    assert not torch.equal(a, layer(x))


def test_fp8_runs_and_stays_close():
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(8, 2, 32)
    ref = layer(x)
    with te.autocast(enabled=True):
        y = layer(x)
    y.sum().backward()
    assert (y - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        ("MultiheadAttention", dict(attention_type="cross"), "attention_type='cross'"),
        ("MultiheadAttention", dict(attn_mask_type="padding"), "attn_mask_type='padding'"),
        ("MultiheadAttention", dict(window_size=(4, 0)), "window_size=\\(4, 0\\)"),
        ("MultiheadAttention", dict(qkv_format="bshd"), "qkv_format='bshd'"),
        ("MultiheadAttention", dict(qk_norm_type="RMSNorm"), "qk_norm_type='RMSNorm'"),
        ("MultiheadAttention", dict(softmax_type="learnable"), "softmax_type='learnable'"),
        ("MultiheadAttention", dict(ub_overlap_ag=True), "ub_overlap_ag=True"),
        ("MultiheadAttention", dict(tp_size=2), "tp_size=2"),
        ("TransformerLayer", dict(layer_type="decoder"), "layer_type='decoder'"),
        ("TransformerLayer", dict(drop_path_rate=0.1), "drop_path_rate=0.1"),
        ("TransformerLayer", dict(ub_tp_comm_overlap=True), "ub_tp_comm_overlap=True"),
        ("TransformerLayer", dict(self_attn_mask_type="padding_causal"), "self_attn_mask_type='padding_causal'"),
        ("TransformerLayer", dict(attn_input_format="thd"), "attn_input_format='thd'"),
    ],
)
def test_refused_arguments(cls, kwargs, match):
    args = (16, 4) if cls == "MultiheadAttention" else (16, 32, 4)
    with pytest.raises(ValueError, match=rf"{cls}: {match} is not supported by tp_fuse \("):
        getattr(te, cls)(*args, **kwargs)


def test_refused_forward_arguments():
    layer = te.TransformerLayer(16, 32, 4)
    x = torch.randn(3, 2, 16)
    for kwargs, match in ((dict(rotary_pos_emb=torch.zeros(3, 1, 1, 4)), "rotary_pos_emb"),
                          (dict(inference_params=object()), "inference_params"),
                          (dict(core_attention_bias_type="alibi"), "core_attention_bias_type"),
                          (dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), "cu_seqlens_q"),
                          (dict(encoder_output=x), "encoder_output"),
                          (dict(self_attn_mask_type="padding"), "attn_mask_type='padding'")):
        with pytest.raises(ValueError, match=f"{match}.* is not supported by tp_fuse"):
            layer(x, **kwargs)
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation=True requires fuse_qkv_params=True"):
        te.TransformerLayer(16, 32, 4, fuse_wgrad_accumulation=True)


# ---- the debug names reach nvdlfw-inspect --------------------------------------------------

_LOG_YAML = """
log:
  enabled: True
  layers:
    layer_name_regex_pattern: ".*"
  transformer_engine:
    LogTensorStats:
      enabled: True
      tensors: [activation]
      stats: [max]
"""


def test_debug_names_reach_debug_api(tmp_path):
    rows = start_debug(tmp_path, _LOG_YAML)
    try:
        torch.manual_seed(0)
        layer = te.TransformerLayer(16, 32, 4, name="layer")
        mha = te.MultiheadAttention(16, 4, name="mha")
        x = torch.randn(3, 2, 16)
        (layer(x).sum() + mha(x).sum()).backward()
        debug_api.step()
    finally:
        debug_api.end_debug()
    names = {name for name, _ in rows.rows}
    assert names == {f"{n}_activation_max" for n in (
        "layer.self_attention.layernorm_linear_qkv", "layer.self_attention.proj",
        "layer.layernorm_mlp.fc1", "layer.layernorm_mlp.fc2", "mha.linear_qkv", "mha.proj")}
    assert rows.rows[("mha.linear_qkv_activation_max", 0)] == pytest.approx(x.max().item())


# ---- tensor parallelism on 2 gloo ranks -----------------------------------------------------


def _tp_layer(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.manual_seed(0)
    kw = dict(num_gqa_groups=G, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    full = te.TransformerLayer(H, FFN, N, **kw)
    _randomize(full)
    x = torch.randn(2 * S, B, H, dtype=torch.float64)  # the sequence splits over 2 ranks under SP
    for sp in (False, True):
        tp = te.TransformerLayer(H, FFN, N, set_parallel_mode=True, tp_group=group, sequence_parallel=sp, **kw)
        fp = dict(full.named_parameters())
        d = H // N
        with torch.no_grad():
            for name, p in tp.named_parameters():
                w = fp[name]
                if name.rsplit(".", 1)[-1] in ("query_weight", "key_weight", "value_weight", "query_bias",
                                               "key_bias", "value_bias"):
                    # TE's per-rank [q_r; k_r; v_r]: each part split over the ranks.
                    w = w.chunk(2, 0)[rank]
                elif name.endswith("fc1_weight") or name.endswith("fc1_bias"):
                    w = w.chunk(2, 0)[rank]
                elif name.endswith("proj.weight") or name.endswith("fc2_weight"):
                    w = w.chunk(2, 1)[rank]
                p.copy_(w)
        inp = x.chunk(2, 0)[rank] if sp else x
        want = full(x)
        torch.testing.assert_close(tp(inp), want.chunk(2, 0)[rank] if sp else want, rtol=1e-10, atol=1e-10)
    return "ok"


@pytest.mark.multirank
def test_transformer_layer_tensor_parallel_two_ranks():
    assert run_distributed(2, _tp_layer, timeout=120) == ["ok", "ok"]
