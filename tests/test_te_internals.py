"""Transformer Engine names that users and TE's tests reach for beyond the op list:
``QuantizerRole``, ``get_quantizer_roles``, ``Sequential._module_groups``, a fuser's
``_forward_ops``/``_backward_ops``, ``Sequential`` ``+``/``+=``."""

import dataclasses

import pytest
import torch

import tp_fuse as te
from tp_fuse import ops
from tp_fuse.ops.fuser import OperationFuser
from tp_fuse.quantization import BlockScalingQuantizer, QuantizerRole, make_quantizer
from tp_fuse.recipe import DelayedScaling, Float8BlockScaling
from tolerances import assert_close


def test_quantizer_role_fields_and_str():
    role = QuantizerRole(tensor_type="weight")
    assert (role.module_type, role.tensor_type, role.name) == ("", "weight", "")
    assert str(role) == "tensor_type=weight"
    assert str(QuantizerRole()) == "QuantizerRole()"
    assert str(QuantizerRole("linear", "input", "fc1")) == "module_type=linear|tensor_type=input|name=fc1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.name = "x"
    assert {role: 1}[QuantizerRole(tensor_type="weight")] == 1  # hashable, by value
    with pytest.raises(ValueError, match="QuantizerRole.name: expected a string"):
        QuantizerRole(name=3)
    assert te.QuantizerRole is te.quantization.QuantizerRole is QuantizerRole


def test_make_quantizer_takes_a_role():
    """The role's tensor_type picks the quantizer: 128x128 blocks for weights,
    1x128 otherwise (Float8BlockScaling's defaults)."""
    recipe = Float8BlockScaling()
    w = make_quantizer(recipe, QuantizerRole(module_type="linear", tensor_type="weight"))
    x = make_quantizer(recipe, QuantizerRole(tensor_type="input"))
    assert isinstance(w, BlockScalingQuantizer) and isinstance(x, BlockScalingQuantizer)
    assert w.role == "weight" and x.role == "input"
    assert w.spec != x.spec
    with pytest.raises(ValueError, match="tensor_type is empty"):
        make_quantizer(recipe, QuantizerRole(name="fc1"))


def test_get_quantizer_roles_follow_get_quantizer_order():
    lin = ops.BasicLinear(16, 16)
    lin.name = "fc1"
    assert lin.num_quantizers("forward") == 2 and lin.num_quantizers("backward") == 1
    assert lin.get_quantizer_roles("forward") == [
        QuantizerRole("linear", "input", "fc1"),
        QuantizerRole("linear", "weight", "fc1"),
    ]
    assert lin.get_quantizer_roles("backward") == [QuantizerRole("linear", "grad_output", "fc1")]
    with te.autocast(recipe=DelayedScaling()):
        lin(torch.rand(16, 16))
    for mode in ("forward", "backward"):
        for i, role in enumerate(lin.get_quantizer_roles(mode)):
            assert lin.get_quantizer(mode, i).role == role.tensor_type
    assert ops.Bias(4).get_quantizer_roles("forward") is None
    assert ops.Bias(4).num_quantizers("backward") == 0
    with pytest.raises(ValueError, match="'forward' or 'backward'"):
        lin.get_quantizer_roles("sideways")


def test_grouped_linear_roles_repeat_the_linear_pattern_per_group():
    # Our per-group quantizer names carry the group ("input:1"); TE's roles do not (this
    # gave tensor_type="input:0" after the QuantizerRole and GroupedLinear work met).
    g = ops.GroupedLinear(2, 16, 16)
    g.name = "experts"
    assert g.num_quantizers("forward") == 4 and g.num_quantizers("backward") == 2
    assert g.get_quantizer_roles("forward") == [
        QuantizerRole("linear", "input", "experts"), QuantizerRole("linear", "weight", "experts"),
    ] * 2
    assert g.get_quantizer_roles("backward") == [QuantizerRole("linear", "grad_output", "experts")] * 2


def test_module_groups_are_the_real_groups():
    model = ops.Sequential(
        ops.Identity(), ops.Identity(), torch.nn.Identity(), torch.nn.Identity(),
        ops.Identity(), torch.nn.Identity(), ops.Identity(), ops.Identity(),
    )
    model(torch.zeros(1))
    groups = model._module_groups
    assert [type(g).__name__ for g in groups] == [
        "OperationFuser", "Identity", "Identity", "OperationFuser", "Identity", "OperationFuser",
    ]
    assert groups is model._module_groups  # cached, not rebuilt per access
    assert model.fusers() == [g for g in groups if isinstance(g, OperationFuser)]
    model.append(ops.Identity())
    assert model._module_groups is not groups  # the container changed


def test_fuser_op_lists_are_the_ones_that_run():
    lin = ops.Linear(16, 16)
    model = ops.Sequential(lin, ops.GELU())
    model(torch.rand(4, 16))
    fuser = model._module_groups[0]
    assert fuser._forward_ops is fuser.forward_ops and fuser._backward_ops is fuser.backward_ops
    assert fuser._basic_ops is fuser.basic_ops
    assert [type(op).__name__ for op, _ in fuser._forward_ops] == ["ForwardLinearBiasActivation"]
    assert fuser._forward_ops[0][1] == [0, 1, 2]
    assert [(type(op).__name__, idxs) for op, idxs in fuser._backward_ops] == [
        ("BasicLinear", [0]),
        ("Bias", [1]),
        ("GELU", [2]),
    ]


def test_sequential_add_and_iadd_keep_module_objects():
    a, b, c = ops.Identity(), torch.nn.Identity(), ops.Identity()
    model = ops.Sequential(a)
    added = model + ops.Sequential(b, c)
    assert list(added) == [a, b, c] and list(model) == [a]
    model += [b, c]
    assert list(model) == [a, b, c]
    assert len(model._module_groups) == 3


def test_custom_forward_fusion_with_te_style_linear_context(monkeypatch):
    """Old: a custom fused forward that fills BasicLinear's context the way Transformer
    Engine's does (``save_for_backward(x, w)``, ``with_quantized_compute=False``, ``dtype``)
    crashed the basic backward (``'OperationContext' object has no attribute 'fp8'``)."""
    from tp_fuse.ops import fusion

    monkeypatch.setattr(fusion, "_FORWARD_FUSIONS", list(fusion._FORWARD_FUSIONS))

    class LinearSiLU(ops.FusedOperation):
        def fuser_forward(self, ctxs, x, **unused):
            w = self.basic_ops[0].weight
            y = x @ w.T
            ctxs[0].save_for_backward(x, w)
            ctxs[0].with_quantized_compute = False
            ctxs[0].dtype = w.dtype
            ctxs[1].save_for_backward(y)
            return torch.nn.functional.silu(y), [(), ()]

    def fuse(ops_, **unused):
        if len(ops_) == 2 and isinstance(ops_[0], ops.BasicLinear) and isinstance(ops_[1], ops.SiLU):
            return [LinearSiLU(ops_)]
        return ops_

    ops.register_forward_fusion(fuse, prepend=True)
    lin = ops.BasicLinear(11, 11, dtype=torch.float64)
    model = ops.Sequential(lin, ops.SiLU())
    x = torch.rand(2, 7, 11, dtype=torch.float64, requires_grad=True)
    y = model(x)
    assert isinstance(model._module_groups[0]._forward_ops[0][0], LinearSiLU)
    dy = torch.rand_like(y)
    y.backward(dy)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = lin.weight.detach().clone().requires_grad_()
    torch.nn.functional.silu(x_ref @ w_ref.T).backward(dy)
    assert_close(x.grad, x_ref.grad)
    assert_close(lin.weight.grad, w_ref.grad)
    assert x.grad.shape == x.shape


def test_basic_linear_context_has_te_dtype_and_quantized_flag(monkeypatch):
    """A custom fused op that runs BasicLinear's GEMM reads TE's context fields back:
    ``ctx.dtype`` (the GEMM's compute dtype) and ``ctx.with_quantized_compute``."""
    from tp_fuse.ops import fusion

    monkeypatch.setattr(fusion, "_FORWARD_FUSIONS", list(fusion._FORWARD_FUSIONS))
    seen = []

    class LinearThenSiLU(ops.FusedOperation):
        def fuser_forward(self, ctxs, x, **unused):
            y = self.basic_ops[0].forward_gemm(ctxs[0], x)
            seen.append((ctxs[0].dtype, ctxs[0].with_quantized_compute))
            return self.basic_ops[1].op_forward(ctxs[1], y), [(), ()]

    def fuse(ops_, **unused):
        if len(ops_) == 2 and isinstance(ops_[0], ops.BasicLinear) and isinstance(ops_[1], ops.SiLU):
            return [LinearThenSiLU(ops_)]
        return ops_

    ops.register_forward_fusion(fuse, prepend=True)
    model = ops.Sequential(ops.BasicLinear(32, 32), ops.SiLU())
    x = torch.rand(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    with te.autocast(recipe=DelayedScaling()):
        model(x)
    assert seen == [(torch.bfloat16, False), (torch.float32, True)]
