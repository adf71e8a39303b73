"""Named extra-tensor channels and joint forward-backward fusions (Transformer Engine's
``set_extra_output_channel`` / ``set_extra_input_channel`` and
``register_forward_backward_fusion``), checked against float64 references."""

import pytest
import torch

from tp_fuse import ops
from tp_fuse.ops import fusion
from tp_fuse.ops.fuser import OperationFuser
from tolerances import assert_close

SIZE = 16


@pytest.fixture
def own_registry(monkeypatch):
    """Fusions registered by a test stay in that test (the registry is process-wide)."""
    for name in ("_FORWARD_BACKWARD_FUSIONS", "_FORWARD_FUSIONS", "_BACKWARD_FUSIONS"):
        monkeypatch.setattr(fusion, name, list(getattr(fusion, name)))


def _x(*shape, dtype=torch.float64):
    return torch.rand(*shape, dtype=dtype, requires_grad=True)


# ---- routing ------------------------------------------------------------------------


@pytest.mark.parametrize("to_caller", [True, False])
def test_internal_residual_matches_reference(to_caller):
    """MakeExtraOutput -> Linear -> AddExtraInput with the residual on a channel:
    y = x W^T + b + x, dx = dy W + dy (+ dr when the residual is also returned)."""
    torch.manual_seed(0)
    lin = ops.Linear(SIZE, SIZE, dtype=torch.float64)
    producer = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=to_caller)
    consumer = ops.AddExtraInput().set_extra_input_channel(0, "res")
    model = ops.Sequential(producer, lin, consumer)
    x = _x(4, SIZE)
    x_ref = x.detach().clone().requires_grad_()
    out = model(x)
    y = out[0] if to_caller else out
    assert isinstance(y, torch.Tensor) and (not to_caller or len(out) == 2)
    w, b = lin.weight, lin.bias
    y_ref = x_ref @ w.detach().T + b.detach() + x_ref
    assert_close(y, y_ref)
    dy = torch.rand_like(y)
    if to_caller:
        assert_close(out[1], x_ref)
        dr = torch.rand_like(y)
        torch.autograd.backward(out, (dy, dr))
        torch.autograd.backward((y_ref, x_ref * 1), (dy, dr))
        expected_dx = x_ref.grad
    else:
        y.backward(dy)
        y_ref.backward(dy)
        expected_dx = x_ref.grad
    assert_close(x.grad, expected_dx)
    assert_close(b.grad, dy.sum(0))
    assert_close(w.grad, dy.T @ x_ref.detach())
    # The caller passes no extra input: the channel feeds AddExtraInput.
    assert model.fusers()[0].num_extra_inputs == 0


def test_builtin_fusions_still_apply_with_channels():
    """The residual-add fusions fuse across channel-bound ops (forward: bias and
    residual in the GEMM; backward: residual gradient accumulated into dgrad)."""
    lin = ops.Linear(SIZE, SIZE, dtype=torch.float64)
    producer = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=False)
    consumer = ops.AddExtraInput().set_extra_input_channel(0, "res")
    model = ops.Sequential(producer, lin, consumer)
    x = _x(3, SIZE)
    y = model(x)
    fuser = model.fusers()[0]
    assert [type(op).__name__ for op, _ in fuser.forward_ops] == ["MakeExtraOutput", "ForwardLinearBiasAdd"]
    assert [type(op).__name__ for op, _ in fuser.backward_ops] == ["BackwardLinearAdd", "Bias", "AddExtraInput"]
    y.backward(torch.ones_like(y))
    w = lin.weight.detach()
    assert_close(x.grad, torch.ones(3, SIZE, dtype=torch.float64) @ w + 1)


def test_fanout_and_hidden_output():
    """One producer, two consumers: y = 3x; dx = 3 dy when the channel is hidden."""
    producer = ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=False)
    c1 = ops.AddExtraInput().set_extra_input_channel(0, "r")
    c2 = ops.AddExtraInput().set_extra_input_channel(0, "r")
    model = ops.Sequential(producer, c1, c2)
    x = _x(SIZE)
    y = model(x)
    assert isinstance(y, torch.Tensor)
    assert_close(y, 3 * x.detach())
    dy = torch.rand_like(y)
    y.backward(dy)
    assert_close(x.grad, 3 * dy)


def test_public_and_external_slots_mix():
    """Unbound slots stay public: the caller passes the second residual."""
    producer = ops.MakeExtraOutput().set_extra_output_channel(0, "r")
    internal = ops.AddExtraInput().set_extra_input_channel(0, "r")
    external = ops.AddExtraInput()
    fuser = OperationFuser([producer, internal, external])
    assert fuser.num_extra_inputs == 1 and fuser.num_extra_outputs == 1
    assert fuser._basic_op_extra_input_sources == [[], [(0, 0)], [None]]
    x, e = _x(SIZE), _x(SIZE)
    y, r = fuser(x, e)
    assert_close(y, 2 * x.detach() + e.detach())
    assert_close(r, x.detach())
    y.backward(torch.ones_like(y))
    assert_close(x.grad, torch.full((SIZE,), 2.0, dtype=torch.float64))
    assert_close(e.grad, torch.ones(SIZE, dtype=torch.float64))


def test_unused_hidden_output_has_zero_gradient():
    """Old: MakeExtraOutput's backward added a None gradient (no consumer, not public)."""
    producer = ops.MakeExtraOutput().set_extra_output_channel(0, "nobody", output_to_caller=False)
    model = ops.Sequential(producer, ops.Bias(SIZE, dtype=torch.float64))
    x = _x(SIZE)
    y = model(x)
    assert isinstance(y, torch.Tensor)
    y.backward(torch.ones_like(y))
    assert_close(x.grad, torch.ones(SIZE, dtype=torch.float64))


def test_fresh_channel_tensor_requires_grad():
    """A tensor made inside the fuser (grad mode is off there) reaches its consumer
    marked as requiring grad, so the consumer returns its gradient to the producer."""

    class MeanSquare(ops.BasicOperation):
        num_extra_outputs = 1

        def fuser_forward(self, ctxs, x, **unused):
            ctxs[0].save_for_backward(x)
            return x, [(x.square().mean(-1),)]

        def fuser_backward(self, ctxs, dy, *, basic_op_grad_extra_outputs, **unused):
            (x,) = ctxs[0].saved_tensors
            (ds,) = basic_op_grad_extra_outputs[0]
            return dy + ds.unsqueeze(-1) * 2 * x / x.size(-1), [()], [()]

    class ScaleBy(ops.BasicOperation):
        num_extra_inputs = 1

        def fuser_forward(self, ctxs, x, *, basic_op_extra_inputs, **unused):
            (s,) = basic_op_extra_inputs[0]
            ctxs[0].scale_needs_grad = s.requires_grad
            ctxs[0].save_for_backward(x, s)
            return x * s.unsqueeze(-1), [()]

        def fuser_backward(self, ctxs, dy, **unused):
            x, s = ctxs[0].saved_tensors
            ds = (dy * x).sum(-1) if ctxs[0].scale_needs_grad else None
            return dy * s.unsqueeze(-1), [()], [(ds,)]

    p = MeanSquare().set_extra_output_channel(0, "s", output_to_caller=False)
    c = ScaleBy().set_extra_input_channel(0, "s")
    x = _x(5, 8)
    x_ref = x.detach().clone().requires_grad_()
    y = ops.Sequential(p, c)(x)
    y_ref = x_ref * x_ref.square().mean(-1, keepdim=True)
    assert_close(y, y_ref)
    dy = torch.rand_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert_close(x.grad, x_ref.grad)


# ---- validation --------------------------------------------------------------------


def test_binding_errors():
    p, c = ops.MakeExtraOutput(), ops.AddExtraInput()
    for bad in (-1, 1, True):
        with pytest.raises(IndexError, match="out of range"):
            p.set_extra_output_channel(bad, "r")
        with pytest.raises(IndexError, match="out of range"):
            c.set_extra_input_channel(bad, "r")
    for bad in ("", 7):
        with pytest.raises(ValueError, match="non-empty string"):
            p.set_extra_output_channel(0, bad)
        with pytest.raises(ValueError, match="non-empty string"):
            c.set_extra_input_channel(0, bad)
    with pytest.raises(TypeError, match="output_to_caller must be a bool"):
        p.set_extra_output_channel(0, "r", output_to_caller=1)
    with pytest.raises(IndexError):  # ops without extra slots have none to bind
        ops.Bias(SIZE).set_extra_output_channel(0, "r")


def test_routing_errors():
    c = ops.AddExtraInput().set_extra_input_channel(0, "missing")
    with pytest.raises(ValueError, match="has no producer"):
        OperationFuser([c])
    c = ops.AddExtraInput().set_extra_input_channel(0, "r")
    p = ops.MakeExtraOutput().set_extra_output_channel(0, "r")
    with pytest.raises(ValueError, match="has no earlier producer"):
        OperationFuser([c, p])
    p1 = ops.MakeExtraOutput().set_extra_output_channel(0, "r")
    p2 = ops.MakeExtraOutput().set_extra_output_channel(0, "r")
    with pytest.raises(ValueError, match="multiple producers"):
        OperationFuser([p1, p2, ops.AddExtraInput().set_extra_input_channel(0, "r")])


def test_channels_across_a_plain_module_are_refused():
    """A torch module splits the fusers, and channels do not cross fusers."""
    p = ops.MakeExtraOutput().set_extra_output_channel(0, "r")
    c = ops.AddExtraInput().set_extra_input_channel(0, "r")
    model = ops.Sequential(p, torch.nn.Identity(), c)
    with pytest.raises(ValueError, match="has no producer"):
        model(torch.rand(SIZE))


def test_bindings_lock_when_captured():
    p = ops.MakeExtraOutput().set_extra_output_channel(0, "r")
    c = ops.AddExtraInput().set_extra_input_channel(0, "r")
    assert not p._extra_tensor_channels_locked
    ops.Sequential(p, c)(torch.rand(SIZE))
    assert p._extra_tensor_channels_locked and c._extra_tensor_channels_locked
    with pytest.raises(RuntimeError, match="already captured its channel routing"):
        p.set_extra_output_channel(0, None)
    with pytest.raises(RuntimeError, match="already captured its channel routing"):
        c.set_extra_input_channel(0, None)


# ---- joint fusions and TE-signature fusion functions --------------------------------


class _ScaleTwice(ops.FusedOperation):
    """Joint fusion of two ConstantScales whose forward saves state only its own
    backward reads (the product of the scales in ctx 0): not interchangeable with the
    basic ops in either pass alone, hence a joint fusion."""

    def fuser_forward(self, ctxs, x, **unused):
        a, b = self.basic_ops
        ctxs[0].product = a.scale * b.scale
        return x * ctxs[0].product, [(), ()]

    def fuser_backward(self, ctxs, dy, **unused):
        return dy * ctxs[0].product, [(), ()], [(), ()]


def _fuse_scales(ops_, *, recipe):  # Transformer Engine's signature: no fusion_log
    if len(ops_) == 2 and all(isinstance(o, ops.ConstantScale) for o in ops_):
        return [_ScaleTwice(ops_)]
    return ops_


def test_joint_fusion_is_one_object_in_both_passes(own_registry):
    ops.register_forward_backward_fusion(_fuse_scales)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.ConstantScale(3.0))
    x = _x(SIZE)
    y = model(x)
    fuser = model._module_groups[0]
    assert len(fuser._forward_ops) == 1 and isinstance(fuser._forward_ops[0][0], _ScaleTwice)
    assert fuser._backward_ops[0][0] is fuser._forward_ops[0][0]
    assert fuser._forward_ops[0][1] == [0, 1]
    assert "both" in str(fuser.explain())
    y.backward(torch.ones_like(y))
    assert_close(y, 6 * x.detach())
    assert_close(x.grad, torch.full((SIZE,), 6.0, dtype=torch.float64))


def test_te_signature_forward_fusion_runs(own_registry):
    """Old: every fusion function got ``fusion_log=``, so ``func(ops, *, recipe)``
    (Transformer Engine's documented signature) raised TypeError."""
    ops.register_forward_fusion(_fuse_scales, prepend=True)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.ConstantScale(3.0))
    model(_x(SIZE))
    fuser = model._module_groups[0]
    assert isinstance(fuser._forward_ops[0][0], _ScaleTwice)
    assert [type(o) for o, _ in fuser._backward_ops] == [ops.ConstantScale, ops.ConstantScale]


@pytest.mark.parametrize("to_caller", [True, False])
def test_fused_op_must_produce_needed_outputs(own_registry, to_caller):
    class DropsOutput(ops.FusedOperation):
        def fuser_forward(self, ctxs, x, **unused):
            return x, [(None,)]

    def fuse(ops_, **unused):
        if isinstance(ops_[0], ops.MakeExtraOutput) and not isinstance(ops_[0], DropsOutput):
            return [DropsOutput([ops_[0]]), *ops_[1:]]
        return ops_

    ops.register_forward_fusion(fuse, prepend=True)
    p = ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=to_caller)
    c = ops.AddExtraInput().set_extra_input_channel(0, "r")
    with pytest.raises(RuntimeError, match="is public" if to_caller else "outside its forward fusion"):
        ops.Sequential(p, c)(torch.rand(SIZE))
