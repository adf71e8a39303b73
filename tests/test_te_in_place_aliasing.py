"""Transformer Engine's in-place aliasing: ``AddExtraInput(in_place=True)`` returns the
caller's residual itself (written in place), and a fusion group holding an ``in_place=True``
op returns the caller's tensors rather than copies, while autograd stays correct: the
written residual is marked dirty, so later uses of it are differentiated through the
fuser, and a saved copy of its old values is caught by autograd's version check.

Groups without such an op keep copying (``tests/test_fuser_inplace.py``).
"""

from __future__ import annotations

import pytest
import torch

import tp_fuse as te
from tp_fuse import ops
from tp_fuse.ops.fused import ForwardLinearBiasAdd

H = 16


def test_extra_tensors_alias_as_in_transformer_engine() -> None:
    """The pattern of TE's ``test_extra_tensors``: outputs are the caller's buffers."""
    torch.manual_seed(0)
    bias = ops.Bias(H)
    with torch.no_grad():
        bias.bias.copy_(torch.rand(H))
    model = ops.Sequential(
        torch.nn.Identity(),
        ops.MakeExtraOutput(in_place=True),  # x1 [x1]
        bias,  # h1 = x1 + b
        ops.MakeExtraOutput(in_place=True),  # h1 [h1]
        ops.AddExtraInput(in_place=True),  # x2 += h1
        ops.MakeExtraOutput(in_place=True),  # x2 [x2]
        torch.nn.Identity(),
        bias,  # h2 = x2 + b
        ops.AddExtraInput(in_place=True),  # x3 += h2
        ops.MakeExtraOutput(in_place=True),  # x3 [x3]
        ops.AddExtraInput(in_place=True),  # x4 += x3
        torch.nn.Identity(),
        ops.Identity(),
        ops.MakeExtraOutput(in_place=True),  # x4 [x4]
        ops.Identity(),
    )
    x1, x2, x3, x4 = (torch.rand(H) for _ in range(4))
    orig = [t.clone() for t in (x1, x2, x3, x4)]
    ys = model(x1, x2, x3, x4)
    assert len(ys) == 6
    ptr = [y.data_ptr() for y in ys]
    assert ptr[0] == x4.data_ptr() and ptr[5] == x4.data_ptr()
    assert ptr[1] == x1.data_ptr() and ptr[3] == x2.data_ptr() and ptr[4] == x3.data_ptr()
    assert ptr[2] not in [t.data_ptr() for t in (x1, x2, x3, x4)]
    b, h1 = bias.bias.detach(), ys[2].detach()
    torch.testing.assert_close(x1, orig[0])
    torch.testing.assert_close(h1, orig[0] + b)
    torch.testing.assert_close(x2.detach(), orig[1] + h1)
    torch.testing.assert_close(x3.detach(), orig[2] + x2.detach() + b)
    torch.testing.assert_close(x4.detach(), orig[3] + x3.detach())


def test_add_extra_input_in_place_returns_the_residual_and_records_the_write() -> None:
    x = torch.randn(4, H, requires_grad=True)
    residual = torch.randn(4, H)
    r0 = residual.clone()
    y = ops.AddExtraInput(in_place=True)(x, residual)
    assert y is residual  # TE: the residual's own buffer, here the tensor itself
    torch.testing.assert_close(residual.detach(), r0 + x.detach())
    assert residual.grad_fn is not None  # autograd knows residual now depends on x
    # A later use of the residual is differentiated through the add: d/dx = 1 + 3.
    (y.sum() + (residual * 3).sum()).backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 4.0))


def test_add_extra_input_in_place_over_saved_values_raises() -> None:
    """Writing into a tensor autograd saved is an error at backward, never silent."""
    a = torch.randn(4, H, requires_grad=True)
    residual = a.exp()  # exp saves its output
    x = torch.randn(4, H, requires_grad=True)
    y = ops.AddExtraInput(in_place=True)(x, residual)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_add_extra_input_in_place_into_a_leaf_that_requires_grad() -> None:
    """TE's ``test_add_extra_input[in_place=True]``: both inputs are leaves with grads.
    Autograd cannot record a write into such a leaf; its buffer is written through an
    alias (same storage) and both gradients are dy, as in TE."""
    x1 = torch.randn(4, H, requires_grad=True)
    x2 = torch.randn(4, H, requires_grad=True)
    expected = (x1 + x2).detach()
    y = ops.AddExtraInput(in_place=True)(x1, x2)
    assert y.data_ptr() == x2.data_ptr()
    torch.testing.assert_close(y.detach(), expected)
    dy = torch.randn(4, H)
    y.backward(dy)
    torch.testing.assert_close(x1.grad, dy, rtol=0, atol=0)
    torch.testing.assert_close(x2.grad, dy, rtol=0, atol=0)


def _linear_bias_add(in_place: bool, fp8: bool) -> dict:
    torch.manual_seed(1)
    model = ops.Sequential(ops.BasicLinear(H, H), ops.Bias(H), ops.AddExtraInput(in_place=in_place))
    with torch.no_grad():
        model[1].bias.copy_(torch.randn(H))
    x = torch.randn(8, H, requires_grad=True)
    residual = torch.randn(8, H)
    dy = torch.randn(8, H)
    with te.autocast(enabled=fp8):
        y = model(x, residual)
    (y * dy).sum().backward()
    fuser = model.fusers()[0]
    return {"y": y.detach().clone(), "is_residual": y is residual, "dx": x.grad,
            "dw": model[0].weight.grad, "db": model[1].bias.grad,
            "fwd": [type(op) for op, _ in fuser.forward_ops]}


@pytest.mark.parametrize("fp8", (False, True), ids=("fp32", "fp8"))
def test_fused_linear_bias_add_in_place_returns_the_residual(fp8: bool) -> None:
    """``[BasicLinear, Bias, AddExtraInput(in_place=True)]``: the GEMM accumulates into
    the residual, which comes back as itself, with the values and gradients of
    ``in_place=False`` (the same fused op writing a new buffer)."""
    got, ref = _linear_bias_add(True, fp8), _linear_bias_add(False, fp8)
    assert got["fwd"] == ref["fwd"] == [ForwardLinearBiasAdd]
    assert got["is_residual"] and not ref["is_residual"]
    for key in ("y", "dx", "dw", "db"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=1e-6)


def test_groups_without_in_place_ops_still_copy() -> None:
    """The default policy: an input passed through is a copy the caller may modify."""
    x = torch.randn(4, H, requires_grad=True)
    y = ops.Sequential(ops.Identity())(x)
    assert y.data_ptr() != x.data_ptr()
    y.mul_(2)  # allowed, and the caller's x is untouched
    assert not torch.equal(y.detach(), x.detach())
