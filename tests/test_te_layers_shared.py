"""TE's ``MultiheadAttention`` / ``TransformerLayer`` are constructors over ``tp_fuse.layers``'
blocks (issue 37 point 1): one implementation, checked structurally and in float64 against
the layers-built block with the same weights (outputs and gradients bit for bit)."""

from __future__ import annotations

import pytest
import torch

import tp_fuse as te
from tp_fuse import layers
from tp_fuse.distributed import CudaRNGStatesTracker

torch.set_num_threads(1)

S, B, H, FFN, N, G = 5, 2, 16, 24, 4, 2  # seq, batch, hidden, ffn, heads, GQA groups
F64 = torch.float64


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _copy(dst: torch.nn.Module, src: torch.nn.Module, names: dict[str, str]) -> None:
    """``dst``'s parameter ``names[k]`` <- ``src``'s parameter ``k``; every parameter of both."""
    src_p, dst_p = dict(src.named_parameters()), dict(dst.named_parameters())
    assert sorted(names) == sorted(src_p) and sorted(names.values()) == sorted(dst_p)
    with torch.no_grad():
        for s_name, d_name in names.items():
            dst_p[d_name].copy_(src_p[s_name])


def _run(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


_MHA_NAMES = {  # TE's fused-QKV parameter -> the layers block's
    "layernorm_qkv.layer_norm_weight": "qkv.ops.norm.weight", "layernorm_qkv.layer_norm_bias": "qkv.ops.norm.bias",
    "layernorm_qkv.weight": "qkv.ops.linear.weight", "layernorm_qkv.bias": "qkv.ops.bias.bias",
    "proj.weight": "proj.linear.weight", "proj.bias": "proj.bias.bias",
}
_MLP_NAMES = {
    "layernorm_mlp.layer_norm_weight": "mlp.fc1.norm.weight", "layernorm_mlp.layer_norm_bias": "mlp.fc1.norm.bias",
    "layernorm_mlp.fc1_weight": "mlp.fc1.linear.weight", "layernorm_mlp.fc1_bias": "mlp.fc1.bias.bias",
    "layernorm_mlp.fc2_weight": "mlp.fc2.linear.weight", "layernorm_mlp.fc2_bias": "mlp.fc2.bias.bias",
}


def test_te_classes_are_the_layers_classes_with_no_second_computation():
    assert issubclass(te.MultiheadAttention, layers.MultiheadAttention)
    assert issubclass(te.TransformerLayer, layers.TransformerLayer)
    # The TE classes hold their constructor, TE's argument adapter (forward) and TE's
    # name / TP-group plumbing: no QKV split, core attention or residual add of their own.
    for cls in (te.MultiheadAttention, te.TransformerLayer):
        own = {k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")}
        assert own <= {"forward", "_sync_names", "set_tensor_parallel_group"}, own


@pytest.mark.parametrize("interleaved", [True, False])
def test_te_mha_equals_layers_mha_float64(interleaved):
    """TE's fused QKV weight in either layout, GQA, causal mask: the same outputs and gradients
    as the layers block built on its own ops (the layers block's layout is TE's interleaved)."""
    te_mha = te.MultiheadAttention(H, N, num_gqa_groups=G, attention_dropout=0.0, input_layernorm=True,
                                   fuse_qkv_params=True, qkv_weight_interleaved=interleaved, params_dtype=F64)
    own = layers.MultiheadAttention(H, N, num_query_groups=G, dtype=F64, qkv_interleaved=interleaved)
    _randomize(te_mha)
    _copy(own, te_mha, _MHA_NAMES)
    x = torch.randn(S, B, H, dtype=F64, generator=torch.Generator().manual_seed(1))
    y_te, dx_te, g_te = _run(te_mha, x)
    y_own, dx_own, g_own = _run(own, x)
    assert torch.equal(y_te, y_own) and torch.equal(dx_te, dx_own)
    for te_name, own_name in _MHA_NAMES.items():
        assert torch.equal(g_te[te_name], g_own[own_name]), te_name


def test_te_transformer_layer_equals_layers_layer_float64():
    """TE's layer (biases returned by its blocks, added with the residual by the layer) and the
    layers layer on its own blocks (bias and residual inside the last op sequences). Not bit for
    bit: the own blocks add the bias in the GEMM (``addmm``, the fused linear+bias), TE's return
    it -- float64 rounding apart (measured: 1.3e-15 at most)."""
    te_layer = te.TransformerLayer(H, FFN, N, num_gqa_groups=G, hidden_dropout=0.0, attention_dropout=0.0,
                                   fuse_qkv_params=True, params_dtype=F64)
    own = layers.TransformerLayer(H, FFN, N, num_query_groups=G, dtype=F64)
    _randomize(te_layer)
    names = {"self_attention." + k: "attention." + v for k, v in _MHA_NAMES.items()}
    names.update(_MLP_NAMES)
    _copy(own, te_layer, names)
    x = torch.randn(S, B, H, dtype=F64, generator=torch.Generator().manual_seed(2))
    y_te, dx_te, g_te = _run(te_layer, x)
    y_own, dx_own, g_own = _run(own, x)
    close = dict(rtol=0.0, atol=1e-13)
    torch.testing.assert_close(y_te, y_own, **close)
    torch.testing.assert_close(dx_te, dx_own, **close)
    for te_name, own_name in names.items():
        torch.testing.assert_close(g_te[te_name], g_own[own_name], **close, msg=te_name)


def test_te_mha_attention_dropout_in_tracker_fork_and_replayed_by_checkpoint():
    """TE's attention dropout draws inside ``get_rng_state_tracker().fork()`` (layers'
    TrackerRNG), and ``checkpoint_core_attention`` replays the tracker's state: the same
    gradients as without recompute, and the global RNG is not drawn from."""
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)  # TE's init draws in the fork too
    mha = te.MultiheadAttention(H, N, attention_dropout=0.5, input_layernorm=True, params_dtype=F64,
                                get_rng_state_tracker=lambda: tracker)
    _randomize(mha)
    x = torch.randn(S, B, H, dtype=F64, generator=torch.Generator().manual_seed(3))
    grads = []
    for recompute in (False, True):
        tracker.reset()
        tracker.add("model-parallel-rng", 1234)
        global_state = torch.get_rng_state()
        xr = x.clone().requires_grad_(True)
        mha(xr, checkpoint_core_attention=recompute).sum().backward()
        assert torch.equal(torch.get_rng_state(), global_state)
        grads.append(xr.grad)
    assert torch.equal(grads[0], grads[1])


def test_layers_options_refused_where_they_cannot_act():
    """The options TE needs that the layers blocks' own op sequences cannot express are refused there."""
    with pytest.raises(ValueError, match="residual_from_norm and parallel_attention_mlp need prebuilt blocks"):
        layers.TransformerLayer(H, FFN, N, residual_from_norm=True)
    with pytest.raises(ValueError, match="parallel_attention_mlp need prebuilt blocks"):
        layers.TransformerLayer(H, FFN, N, parallel_attention_mlp=True)
    with pytest.raises(ValueError, match="return_layernorm_output needs input_layernorm=True"):
        layers.MultiheadAttention(H, N, residual_connection=True, return_layernorm_output=True)
    mha = layers.MultiheadAttention(H, N, dtype=F64)
    x = torch.randn(S, B, H, dtype=F64)
    with pytest.raises(ValueError, match="attention_mask is given with attn_mask_type='arbitrary' only"):
        mha(x, torch.zeros(S, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        mha(x, attn_mask_type="padding")
    # "arbitrary" with an all-False mask (nothing masked out) is "no_mask".
    torch.testing.assert_close(mha(x, torch.zeros(S, S, dtype=torch.bool), attn_mask_type="arbitrary"),
                               mha(x, attn_mask_type="no_mask"), rtol=0, atol=1e-15)
