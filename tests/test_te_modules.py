"""TE's module classes on tp_fuse's ops: ``te.Linear``, ``te.LayerNormLinear``, ``te.LayerNormMLP``.

Float64 references, gradients, TE's parameter names and state-dict keys, the debug ``name``
reaching nvdlfw-inspect, refused arguments, and column/row tensor parallelism on 2 gloo ranks.
"""

from __future__ import annotations


import pytest
import torch

import nvdlfw_inspect.api as debug_api
import tp_fuse as te
from debug_logging import start_debug
from dist_utils import run_distributed

torch.set_num_threads(1)


def _ref_linear(x, w, b):
    return x.double() @ w.double().T + (0 if b is None else b.double())


def test_linear_float64_reference_and_grads():
    torch.manual_seed(0)
    m = te.Linear(16, 8, params_dtype=torch.float64)
    with torch.no_grad():
        m.bias.normal_()
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert list(m.state_dict()) == ["weight", "bias", "_extra_state"]
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert y.shape == (2, 5, 8) and y.dtype == torch.float64
    torch.testing.assert_close(y, _ref_linear(x, m.weight, m.bias), rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy @ m.weight.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.weight.grad, dy.reshape(-1, 8).T @ x.detach().reshape(-1, 16),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.bias.grad, dy.sum((0, 1)), rtol=1e-12, atol=1e-12)


def test_linear_te_defaults_init_and_return_bias():
    torch.manual_seed(0)
    m = te.Linear(256, 128)
    assert abs(m.weight.std().item() - 0.023) < 0.002  # TE's default init_method
    assert torch.count_nonzero(m.bias) == 0
    m2 = te.Linear(4, 3, init_method=lambda w: torch.nn.init.constant_(w, 0.5), return_bias=True)
    x = torch.randn(2, 4)
    y, b = m2(x)
    torch.testing.assert_close(y, x @ torch.full((4, 3), 0.5))  # bias not added
    assert b.shape == (3,) and [n for n, _ in m2.named_parameters()] == ["weight", "bias"]
    m3 = te.Linear(4, 3, bias=False)
    assert m3.bias.numel() == 0 and [n for n, _ in m3.named_parameters()] == ["weight"]
    torch.testing.assert_close(m3(x), x @ m3.weight.detach().T)


def test_linear_replaced_parameter_and_state_dict_round_trip():
    torch.manual_seed(0)
    m = te.Linear(8, 4)
    m.weight = torch.nn.Parameter(torch.ones(4, 8))
    x = torch.randn(3, 8)
    torch.testing.assert_close(m(x), x @ torch.ones(8, 4))
    m.weight.data = torch.full((4, 8), 2.0)  # the test_numerics idiom
    torch.testing.assert_close(m(x), 2 * x @ torch.ones(8, 4))
    recipe = te.recipe.DelayedScaling()
    for _ in range(2):
        with te.autocast(recipe=recipe):
            m(x).sum().backward()
    sd = m.state_dict()
    assert sd["_extra_state"].numel() > 0
    m2 = te.Linear(8, 4)
    m2.load_state_dict(sd)
    torch.testing.assert_close(m2.fp8_meta["scaling_fwd"].scale, m.fp8_meta["scaling_fwd"].scale)
    with te.autocast(recipe=recipe):
        torch.testing.assert_close(m2(x), m(x))


def test_linear_fp8_close_to_reference():
    torch.manual_seed(0)
    m = te.Linear(64, 32)
    x = torch.randn(16, 64)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = m(x, is_first_microbatch=True)
    ref = _ref_linear(x, m.weight, m.bias).float()
    assert (y - ref).abs().max() / ref.abs().max() < 0.08
    assert not torch.equal(y, ref)  # really FP8


def test_fuse_wgrad_accumulation_into_main_grad():
    m = te.Linear(8, 4, fuse_wgrad_accumulation=True, bias=False)
    m.weight.main_grad = torch.ones(4, 8)
    x = torch.randn(3, 8, dtype=torch.float32)
    m(x).sum().backward()
    torch.testing.assert_close(m.weight.main_grad, 1 + torch.ones(3, 4).T @ x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(parameters_split=("q", "k"), return_bias=True), "parameters_split"),
        (dict(parameters_split=("q", "k"), fuse_wgrad_accumulation=True), "parameters_split"),
        (dict(parameters_split=("q", "k"), delay_wgrad_compute=True), "parameters_split"),
        (dict(ub_overlap_ag=True), "ub_overlap_ag"),
        (dict(symmetric_ar_type="one_shot"), "symmetric_ar_type"),
        (dict(save_original_input=True), "save_original_input"),
        (dict(tp_size=2), "tp_size"),
        (dict(parallel_mode="diagonal"), "parallel_mode"),
        (dict(rng_tracker_name="x"), "rng_tracker_name"),
    ],
)
def test_linear_refused_arguments(kwargs, match):
    with pytest.raises(ValueError, match=rf"Linear: {match}=.* is not supported by tp_fuse \("):
        te.Linear(8, 4, **kwargs)


def test_linear_parameters_split_te_names_values_and_grads():
    """TE's parameters_split: one parameter per part, read as their concatenation (float64)."""
    torch.manual_seed(0)
    m = te.Linear(8, 12, parameters_split={"query_": 6, "key_": 3, "value_": 3}, params_dtype=torch.float64)
    assert [n for n, _ in m.named_parameters()] == [
        "query_weight", "key_weight", "value_weight", "query_bias", "key_bias", "value_bias"]
    assert list(m.state_dict()) == ["query_weight", "key_weight", "value_weight", "query_bias", "key_bias",
                                    "value_bias", "_extra_state"]
    assert m.query_weight.shape == (6, 8) and m.key_weight.shape == (3, 8) and not hasattr(m, "weight")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    w = torch.cat([m.query_weight, m.key_weight, m.value_weight]).detach().requires_grad_()
    b = torch.cat([m.query_bias, m.key_bias, m.value_bias]).detach().requires_grad_()
    x = torch.randn(5, 8, dtype=torch.float64)
    y = m(x)
    want = _ref_linear(x, w, b)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(torch.cat([m.query_weight.grad, m.key_weight.grad, m.value_weight.grad]), w.grad)
    torch.testing.assert_close(torch.cat([m.query_bias.grad, m.key_bias.grad, m.value_bias.grad]), b.grad)
    # Replacing a part is seen by the next forward (the op reads the parts, not a copy).
    m.key_weight = torch.nn.Parameter(torch.zeros(3, 8, dtype=torch.float64))
    assert torch.equal(m(x)[:, 6:9], m.key_bias.detach().expand(5, 3))
    # Equal parts from a tuple; TE's reset_parameters re-initializes every part.
    t = te.LayerNormLinear(8, 6, parameters_split=("a", "b", "c"))
    assert t.a_weight.shape == (2, 8) and "layer_norm_weight" in dict(t.named_parameters())
    t.reset_parameters()
    assert torch.all(t.a_bias == 0) and t.c_weight.std() > 0


@pytest.mark.parametrize("split, match", [
    ({"q": 5, "k": 5}, "sizes .* must sum to out_features"),
    (("q", "k", "v", "w", "x"), "equal parts"),
    (("q", "q"), "distinct"),
    ("qkv", "must be None, a tuple"),
])
def test_linear_parameters_split_refuses_bad_splits(split, match):
    with pytest.raises(ValueError, match=match):
        te.Linear(8, 12, parameters_split=split)


@pytest.mark.parametrize("fp8", [False, True])
def test_layernorm_mlp_checkpoint_recomputes_with_equal_values(fp8):
    """TE's checkpoint=True: same outputs and gradients, fewer tensors kept for the backward."""
    torch.manual_seed(0)
    dtype = torch.float32 if fp8 else torch.float64
    plain = te.LayerNormMLP(16, 32, activation="swiglu", params_dtype=dtype)
    ckpt = te.LayerNormMLP(16, 32, activation="swiglu", params_dtype=dtype, checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 2, 16, dtype=dtype)
    results = []
    for m in (plain, ckpt):
        saved = []
        xi = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with te.autocast(enabled=fp8, recipe=te.recipe.DelayedScaling()):
                y = m(xi)
        y.sum().backward()
        results.append((y, xi.grad, m.fc1_weight.grad, len(saved)))
    (y0, gx0, gw0, n0), (y1, gx1, gw1, n1) = results
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert n1 < n0


def test_linear_return_bias_without_bias_returns_te_empty_tensor():
    y, b = te.Linear(8, 4, bias=False, return_bias=True)(torch.randn(2, 8))
    assert y.shape == (2, 4) and b.numel() == 0


def test_forward_refused_arguments():
    m = te.Linear(8, 4)
    with pytest.raises(ValueError, match="fp8_output"):
        m(torch.randn(2, 8), fp8_output=True)
    with pytest.raises(ValueError, match="is_first_microbatch"):
        m(torch.randn(2, 8), is_first_microbatch="yes")
    with pytest.raises(ValueError, match="checkpoint"):
        te.LayerNormMLP(8, 16, checkpoint="yes")
    with pytest.raises(ValueError, match="LayerNormLinear: parallel_mode='row'"):
        te.LayerNormLinear(8, 4, parallel_mode="row")
    with pytest.raises(ValueError, match="LayerNormMLP: activation='tanh'"):
        te.LayerNormMLP(8, 16, activation="tanh")


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_float64_reference(normalization):
    torch.manual_seed(0)
    m = te.LayerNormLinear(16, 8, normalization=normalization, params_dtype=torch.float64,
                           return_layernorm_output=True, eps=1e-6)
    with torch.no_grad():
        m.layer_norm_weight.normal_()
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.normal_()
        m.bias.normal_()
    names = ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    if normalization == "RMSNorm":
        names.remove("layer_norm_bias")
    assert [n for n, _ in m.named_parameters()] == names
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    y, ln_out = m(x)
    if normalization == "LayerNorm":
        ln = torch.nn.functional.layer_norm(x, (16,), m.layer_norm_weight, m.layer_norm_bias, 1e-6)
    else:
        ln = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.layer_norm_weight
    torch.testing.assert_close(ln_out, ln, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, _ref_linear(ln, m.weight, m.bias), rtol=1e-10, atol=1e-10)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    if normalization == "LayerNorm":
        ln2 = torch.nn.functional.layer_norm(x2, (16,), params[0], params[1], 1e-6)
    else:
        ln2 = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * params[0]
    (ln2 @ params[-2].T + params[-1]).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-10)
    for p, q in zip(m.parameters(), params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_layernorm_mlp_float64_reference(activation):
    torch.manual_seed(0)
    m = te.LayerNormMLP(16, 32, activation=activation, params_dtype=torch.float64)
    with torch.no_grad():
        m.fc1_bias.normal_()
        m.fc2_bias.normal_()
    assert [n for n, _ in m.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    assert m.fc1_weight.shape == ((64 if activation == "swiglu" else 32), 16)
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    y = m(x)
    h = torch.nn.functional.layer_norm(x, (16,), m.layer_norm_weight, m.layer_norm_bias, 1e-5)
    h = h @ m.fc1_weight.T + m.fc1_bias
    if activation == "gelu":
        h = torch.nn.functional.gelu(h, approximate="tanh")
    elif activation == "relu":
        h = torch.relu(h)
    else:
        a, g = h.chunk(2, -1)
        h = torch.nn.functional.silu(a) * g
    ref = h @ m.fc2_weight.T + m.fc2_bias
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    y.sum().backward()
    ref_grads = torch.autograd.grad(ref.sum(), [x, *m.parameters()])
    for got, want in zip([x.grad, *(p.grad for p in m.parameters())], ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ---- the debug name reaches nvdlfw-inspect --------------------------------------------------

_LOG_YAML = """
log:
  enabled: True
  layers:
    layer_name_regex_pattern: "my_lin|mlp.fc2"
  transformer_engine:
    LogTensorStats:
      enabled: True
      tensors: [activation, weight]
      stats: [max]
"""


def test_debug_name_reaches_debug_api(tmp_path):
    rows = start_debug(tmp_path, _LOG_YAML)
    try:
        torch.manual_seed(0)
        lin = te.Linear(8, 4, name="my_lin")
        mlp = te.LayerNormMLP(8, 16, name="mlp")
        other = te.Linear(8, 4, name="other")
        x = torch.randn(3, 8)
        (lin(x).sum() + mlp(x).sum() + other(x).sum()).backward()
        debug_api.step()
    finally:
        debug_api.end_debug()
    names = {name for name, _ in rows.rows}
    assert names == {"my_lin_activation_max", "my_lin_weight_max", "mlp.fc2_activation_max",
                     "mlp.fc2_weight_max"}
    assert rows.rows[("my_lin_activation_max", 0)] == pytest.approx(x.max().item())
    assert rows.rows[("my_lin_weight_max", 0)] == pytest.approx(lin.weight.max().item())


# ---- tensor parallelism on 2 gloo ranks -----------------------------------------------------


def _tp_cases(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.manual_seed(0)
    full_w = torch.randn(8, 6, dtype=torch.float64)
    full_b = torch.randn(8, dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64)
    dy = torch.randn(4, 8, dtype=torch.float64)
    ref = _ref_linear(x, full_w, full_b)
    xr = x.clone().requires_grad_(True)
    wr = full_w.clone().requires_grad_(True)
    br = full_b.clone().requires_grad_(True)
    (xr @ wr.T + br).backward(dy)
    for mode in ("column", "row"):
        for sp in (False, True):
            m = te.Linear(6, 8, parallel_mode=mode, tp_group=group, sequence_parallel=sp,
                          params_dtype=torch.float64)
            with torch.no_grad():
                if mode == "column":
                    m.weight.copy_(full_w.chunk(2, 0)[rank])
                    m.bias.copy_(full_b.chunk(2, 0)[rank])
                else:
                    m.weight.copy_(full_w.chunk(2, 1)[rank])
                    m.bias.copy_(full_b)
            assert m.weight.partition_dim == (0 if mode == "column" else 1)
            if mode == "column":
                inp = x.chunk(2, 0)[rank] if sp else x
            else:
                inp = x.chunk(2, 1)[rank]
            inp = inp.clone().requires_grad_(True)
            y = m(inp)
            if mode == "column":
                want, g = ref.chunk(2, 1)[rank], dy.chunk(2, 1)[rank]
            else:
                want, g = (ref.chunk(2, 0)[rank], dy.chunk(2, 0)[rank]) if sp else (ref, dy)
            torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
            y.backward(g)
            if mode == "column":
                torch.testing.assert_close(m.weight.grad, wr.grad.chunk(2, 0)[rank])
                torch.testing.assert_close(m.bias.grad, br.grad.chunk(2, 0)[rank])
                torch.testing.assert_close(inp.grad, xr.grad.chunk(2, 0)[rank] if sp else xr.grad)
            else:
                torch.testing.assert_close(m.weight.grad, wr.grad.chunk(2, 1)[rank])
                torch.testing.assert_close(inp.grad, xr.grad.chunk(2, 1)[rank])
                # Bias after the reduction: the full gradient, or this rank's rows under SP.
                want_db = dy.chunk(2, 0)[rank].sum(0) if sp else br.grad
                torch.testing.assert_close(m.bias.grad, want_db)
                assert m.bias.sequence_parallel is sp
    # LayerNormMLP with set_parallel_mode: the same numbers as a TP=1 module with full weights.
    torch.manual_seed(1)
    full = te.LayerNormMLP(6, 8, params_dtype=torch.float64)
    tp = te.LayerNormMLP(6, 8, set_parallel_mode=True, tp_group=group, params_dtype=torch.float64)
    with torch.no_grad():
        full.fc1_bias.normal_()
        full.fc2_bias.normal_()
        tp.fc1_weight.copy_(full.fc1_weight.chunk(2, 0)[rank])
        tp.fc1_bias.copy_(full.fc1_bias.chunk(2, 0)[rank])
        tp.fc2_weight.copy_(full.fc2_weight.chunk(2, 1)[rank])
        tp.fc2_bias.copy_(full.fc2_bias)
    torch.testing.assert_close(tp(x), full(x), rtol=1e-12, atol=1e-12)
    return "ok"


@pytest.mark.multirank
def test_linear_tensor_parallel_two_ranks():
    assert run_distributed(2, _tp_cases, timeout=120) == ["ok", "ok"]
