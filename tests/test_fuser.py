"""The fuser engine: grouping, fusion bookkeeping, caching, explain, errors."""

import pytest
import torch

import tp_fuse as te
from tp_fuse.ops import fusion as fusion_registry
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling


def _mlp(hidden=32, ffn=64):
    return te.ops.Sequential(
        te.ops.LayerNorm(hidden),
        te.ops.Linear(hidden, ffn),
        te.ops.GELU(),
        te.ops.Linear(ffn, hidden),
    )


def test_sequential_groups_and_non_fusible_modules_split():
    seq = te.ops.Sequential(
        te.ops.Linear(8, 8), te.ops.GELU(), torch.nn.Tanh(), te.ops.Linear(8, 8), te.ops.ReLU()
    )
    fusers = seq.fusers()
    assert len(fusers) == 2
    assert [type(op).__name__ for op in fusers[0].basic_ops] == ["BasicLinear", "Bias", "GELU"]
    x = torch.randn(3, 8)
    l1, act, tanh, l2, relu = list(seq)
    ref = torch.relu(l2(tanh(act(l1(x)))))
    torch.testing.assert_close(seq(x), ref)


def test_forward_and_backward_fuse_independently():
    seq = _mlp()
    x = torch.randn(16, 32, requires_grad=True)
    # Under FP8: BackwardActivationBias fuses only for an FP8 consumer (TE's condition).
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        seq(x).sum().backward()
    fuser = seq.fusers()[0]
    fwd = [type(op).__name__ for op, _ in fuser.forward_ops]
    bwd = [type(op).__name__ for op, _ in fuser.backward_ops]
    assert "ForwardLinearBiasActivation" in fwd
    assert "BackwardActivationBias" in bwd
    assert fwd != bwd
    # Every basic op is covered exactly once, in order, in both directions.
    for runs in (fuser.forward_ops, fuser.backward_ops):
        assert [i for _, idxs in runs for i in idxs] == list(range(len(fuser.basic_ops)))


def test_high_precision_backward_of_bias_gelu_stays_basic():
    # Transformer Engine's condition: dact+dbias fuse only under an FP8 recipe.
    seq = _mlp()
    seq(torch.randn(16, 32, requires_grad=True)).sum().backward()
    bwd = [type(op).__name__ for op, _ in seq.fusers()[0].backward_ops]
    assert "BackwardActivationBias" not in bwd and "Bias" in bwd


def test_fused_equals_unfused():
    torch.manual_seed(0)
    seq = _mlp()
    x = torch.randn(16, 32, requires_grad=True)
    y = seq(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in seq.parameters()]
    xg = x.grad.clone()
    # Same ops, each in its own fuser: nothing can fuse.
    for p in seq.parameters():
        p.grad = None
    x.grad = None
    y2 = x
    for op in seq:
        for basic in op.basic_op_list:
            y2 = basic(y2)
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, xg)
    for p, g in zip(seq.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def test_bad_fusion_function_is_caught():
    def drop_identity(ops, **unused):
        return [op for op in ops if not isinstance(op, te.ops.Identity)]

    te.ops.register_forward_fusion(drop_identity)
    try:
        seq = te.ops.Sequential(te.ops.Identity(), te.ops.ReLU())
        with pytest.raises(RuntimeError, match="drop_identity must cover the basic ops exactly"):
            seq(torch.randn(2, 2))
    finally:
        fusion_registry._FORWARD_FUSIONS.remove(drop_identity)


def test_recipe_change_refuses():
    calls = []

    def spy(ops, recipe=None, **unused):
        calls.append(recipe)
        return ops

    te.ops.register_forward_fusion(spy)
    try:
        seq = te.ops.Sequential(te.ops.Linear(16, 16), te.ops.ReLU())
        x = torch.randn(16, 16)
        seq(x)
        seq(x)
        assert calls == [None]  # decided once, then cached
        delayed = DelayedScaling()
        with te.autocast(recipe=delayed):
            seq(x)
            seq(x)
        assert len(calls) == 2 and calls[1] is delayed
        with te.autocast(recipe=Float8CurrentScaling()):
            seq(x)
        assert len(calls) == 3 and isinstance(calls[2], Float8CurrentScaling)
        delayed.margin = 1  # mutated in place: a different recipe
        with te.autocast(recipe=delayed):
            seq(x)
        assert len(calls) == 4
        seq(x)  # back to high precision
        assert len(calls) == 5 and calls[4] is None
    finally:
        fusion_registry._FORWARD_FUSIONS.remove(spy)


def test_explain_lists_fusions_and_reasons():
    seq = te.ops.Sequential(
        te.ops.Linear(16, 32), te.ops.GELU(), te.ops.Linear(32, 32), te.ops.SwiGLU()
    )
    exp = seq.explain()
    text = str(exp)
    assert "ForwardLinearBiasActivation" in text
    fused = [r for r in exp.records if r.fused]
    rejected = [r for r in exp.records if not r.fused]
    assert any(r.direction == "forward" and "GELU" in r.window for r in fused)
    # [BasicLinear, Bias, SwiGLU] is rejected with a reason naming SwiGLU.
    assert any("SwiGLU" in r.reason for r in rejected), text
    assert all(r.reason for r in rejected)
    assert isinstance(te.explain(seq), te.ops.Explanation)


def test_extra_input_count_is_checked():
    seq = te.ops.Sequential(te.ops.Linear(4, 4), te.ops.AddExtraInput())
    with pytest.raises(ValueError, match="expects 1 extra input"):
        seq(torch.randn(2, 4))


def test_linear_in_features_mismatch_names_op():
    seq = _mlp()
    with pytest.raises(ValueError, match=r"BasicLinear: expected input with last dimension in_features=32"):
        te.ops.Linear(32, 8)(torch.randn(4, 31))
    with pytest.raises(ValueError, match="LayerNorm"):
        seq(torch.randn(4, 31))


def test_sequential_container_api():
    seq = te.ops.Sequential(te.ops.ReLU())
    seq.append(te.ops.Identity())
    seq.insert(0, te.ops.ConstantScale(2.0))
    assert [type(m).__name__ for m in seq] == ["ConstantScale", "ReLU", "Identity"]
    assert len(seq) == 3 and isinstance(seq[0], te.ops.ConstantScale)
    assert isinstance(seq[1:], te.ops.Sequential) and len(seq[1:]) == 2
    x = torch.randn(3, 3)
    torch.testing.assert_close(seq(x), torch.relu(2 * x))
    del seq[0]
    torch.testing.assert_close(seq(x), torch.relu(x))  # regrouped after the change


def test_standalone_op_call_and_no_grad():
    lin = te.ops.Linear(6, 3)
    x = torch.randn(2, 5, 6)
    with torch.no_grad():
        y = lin(x)
    assert y.shape == (2, 5, 3) and not y.requires_grad
    torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_fused_op_rejects_non_ops():
    with pytest.raises(ValueError, match="expects FusibleOperations"):
        te.ops.FusedOperation([torch.nn.ReLU()])  # type: ignore[list-item]
