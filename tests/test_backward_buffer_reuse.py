"""GELU's backward writes into the gradient buffer it owns, and only into that one.

The fuser's backward hands an op the gradient the previous op's backward just allocated;
``BasicLinear`` vouches for its dgrad (``OperationContext.grad_input_fresh``), and GELU
then computes ``dx`` in that buffer instead of a new one (issue 20: on CPU the fresh
buffer cost ~0.4 ms of page faults per step at hidden 256 x 512 tokens, the gap to plain
torch in ``examples/bench_fuser_overhead.py``). These tests pin both halves: the reuse
happens where it is safe (so a refactor cannot silently lose it), and the caller's
gradient, a gradient some other op may still hold, a retained graph and a graph being
recorded (``create_graph``) are never written into.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tp_fuse as te
from tolerances import assert_close
from tp_fuse import kernels
from tp_fuse.kernels._common import DGELU_ATEN_MIN_X
from tp_fuse.ops.basic import GELU, BasicLinear, Bias

H, TOKENS = 16, 12
GELU_INTO_BUFFER = torch.ops.aten.gelu_backward.grad_input
GELU_NEW_BUFFER = torch.ops.aten.gelu_backward.default


class _OpLog(TorchDispatchMode):
    """The ATen overloads that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _linear_gelu_linear() -> te.ops.Sequential:
    torch.manual_seed(0)
    model = te.ops.Sequential(BasicLinear(H, 4 * H), Bias(4 * H), GELU(), BasicLinear(4 * H, H))
    with torch.no_grad():
        model[0].weight.mul_(8.0)  # pre-activations well below DGELU_ATEN_MIN_X: the tail path runs too
    return model


def _reference_grads(model: te.ops.Sequential, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """dx and every parameter's gradient in float64 through torch's own ops."""
    w1, b1, w2 = (p.detach().double().requires_grad_() for p in model.parameters())
    x64 = x.detach().double().requires_grad_()
    y = F.linear(F.gelu(F.linear(x64, w1, b1), approximate="tanh"), w2)
    y.backward(dy.double())
    return [x64.grad, w1.grad, b1.grad, w2.grad]


def _x_dy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(TOKENS, H, requires_grad=True), torch.randn(TOKENS, H)


def _grads(model: te.ops.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in model.parameters())]


def test_gelu_backward_writes_into_the_dgrad_it_owns() -> None:
    model = _linear_gelu_linear()
    x, dy = _x_dy()
    pre = F.linear(x.detach(), model[0].weight, model[1].bias)
    assert (pre < DGELU_ATEN_MIN_X).any() and (pre >= DGELU_ATEN_MIN_X).any()
    y = model(x)
    with _OpLog() as log:
        y.backward(dy)
    assert GELU_INTO_BUFFER in log.ops and GELU_NEW_BUFFER not in log.ops
    for got, want in zip(_grads(model, x), _reference_grads(model, x, dy)):
        assert_close(got, want)


@pytest.mark.parametrize(
    "ops",
    [
        pytest.param(lambda: [GELU()], id="gelu-receives-the-callers-dy"),
        pytest.param(lambda: [GELU(), Bias(H)], id="bias-passes-the-callers-dy-through"),
        pytest.param(lambda: [BasicLinear(H, H), GELU(), Bias(H), BasicLinear(H, H)], id="bias-between"),
    ],
)
def test_gradients_gelu_does_not_own_are_not_written(ops) -> None:
    """The caller's dy, and a gradient a non-vouching op (Bias returns its dy itself)
    passed on, are read only: the result goes to a new buffer."""
    model = te.ops.Sequential(*ops())
    x, dy = _x_dy()
    dy_before = dy.clone()
    y = model(x)
    with _OpLog() as log:
        y.backward(dy)
    assert GELU_INTO_BUFFER not in log.ops and GELU_NEW_BUFFER in log.ops
    assert torch.equal(dy, dy_before)


def test_retained_graph_gives_the_same_gradients_twice() -> None:
    model = _linear_gelu_linear()
    x, dy = _x_dy()
    y = model(x)
    y.backward(dy, retain_graph=True)
    first = [g.clone() for g in _grads(model, x)]
    for g in _grads(model, x):
        g.zero_()
    y.backward(dy)
    for got, want in zip(_grads(model, x), first):
        assert torch.equal(got, want)


def test_create_graph_records_no_write() -> None:
    """Under ``create_graph`` the dgrad may be part of the graph being recorded."""
    model = _linear_gelu_linear()
    x, dy = _x_dy()
    y = model(x)
    with _OpLog() as log:
        grads = torch.autograd.grad(y, [x, *model.parameters()], dy, create_graph=True)
    assert GELU_INTO_BUFFER not in log.ops and GELU_NEW_BUFFER in log.ops
    for got, want in zip(grads, _reference_grads(model, x, dy)):
        assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dgelu_overwrite_is_bit_identical_and_reuses_the_buffer(dtype: torch.dtype) -> None:
    x = torch.cat([torch.linspace(-12.0, 4.0, 40), torch.tensor([float("nan"), -3.0, -2.99])]).to(dtype).reshape(-1, 43)
    grad = torch.randn(x.shape, dtype=dtype)
    want, _, _ = kernels.dgelu_dbias(grad, x, with_amax=False, with_dbias=False)
    buffer = grad.clone()
    with torch.no_grad():
        got, _, _ = kernels.dgelu_dbias(buffer, x, with_amax=False, with_dbias=False, overwrite_grad=True)
    assert got.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_dgelu_overwrite_declines_a_grad_that_is_x() -> None:
    x = torch.linspace(-6.0, 3.0, 32).reshape(4, 8)
    x_before = x.clone()
    want, _, _ = kernels.dgelu_dbias(x_before, x_before.clone(), with_dbias=False)
    with torch.no_grad():
        got, _, _ = kernels.dgelu_dbias(x, x, with_dbias=False, overwrite_grad=True)
    assert torch.equal(x, x_before)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
