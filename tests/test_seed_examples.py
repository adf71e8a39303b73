"""The code examples of the op-fuser API document, run against tp_fuse.

Sizes are scaled down from the document's (4096/28672/16384) to keep the
suite fast on a CPU; device "cuda" is replaced by the available device.
"""

from collections.abc import Iterable
from typing import Optional

import pytest
import torch

import tp_fuse as te
from tp_fuse.ops import fusion as fusion_registry
from tp_fuse.quantization import Float8Tensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, FFN, TOKENS = 64, 192, 48


def test_basic_usage_mlp():
    mlp = te.ops.Sequential(
        te.ops.LayerNorm(HIDDEN, device=DEVICE),
        te.ops.Linear(HIDDEN, FFN, device=DEVICE),
        te.ops.SwiGLU(),
        te.ops.Linear(FFN // 2, HIDDEN, device=DEVICE),
    )
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE)
    y = mlp(x)
    assert y.shape == (TOKENS, HIDDEN)
    # Same math in plain torch.
    ln, fc1, _, fc2 = list(mlp)
    h = torch.nn.functional.layer_norm(x, (HIDDEN,), ln.weight, ln.bias, ln.eps)
    h = torch.nn.functional.linear(h, fc1.weight, fc1.bias)
    a, b = h.chunk(2, dim=-1)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(a) * b, fc2.weight, fc2.bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_quantization_example():
    with te.quantized_model_init():
        fc1 = te.ops.Sequential(
            te.ops.LayerNorm(HIDDEN, device=DEVICE),
            te.ops.Linear(HIDDEN, FFN, device=DEVICE),
        )
    assert isinstance(fc1[1].weight, Float8Tensor)
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE)
    with te.autocast():
        y = fc1(x)
    y.sum().backward()
    assert fc1[1].weight.grad is not None and torch.isfinite(fc1[1].weight.grad).all()
    assert fc1[0].weight.grad is not None


def test_branching_residual_example():
    fc1 = te.ops.Sequential(
        te.ops.LayerNorm(HIDDEN, device=DEVICE),
        te.ops.MakeExtraOutput(),  # Output residual
        te.ops.Linear(HIDDEN, FFN, device=DEVICE),
        te.ops.SwiGLU(),
    )
    fc2 = te.ops.Sequential(
        te.ops.Linear(FFN // 2, HIDDEN, device=DEVICE),
        te.ops.AddExtraInput(),  # Add residual
    )
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, requires_grad=True)
    y, residual = fc1(x)
    y = fc2(y, residual)
    y.square().sum().backward()

    # Reference in float64 with the same parameters.
    xd = x.detach().double().requires_grad_()
    ln, _, l1, _ = list(fc1)
    l2 = fc2[0]
    h = torch.nn.functional.layer_norm(xd, (HIDDEN,), ln.weight.double(), ln.bias.double(), ln.eps)
    r = h
    h = torch.nn.functional.linear(h, l1.weight.double(), l1.bias.double())
    a, b = h.chunk(2, dim=-1)
    h = torch.nn.functional.linear(torch.nn.functional.silu(a) * b, l2.weight.double(), l2.bias.double())
    ref = h + r
    ref.square().sum().backward()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-4)


def test_quantize_split_example():
    with te.quantized_model_init():
        norm = te.ops.Sequential(
            te.ops.LayerNorm(HIDDEN, device=DEVICE),
            te.ops.Quantize(),
        )
        fc1 = te.ops.Sequential(
            te.ops.Linear(HIDDEN, FFN, device=DEVICE),
        )
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, requires_grad=True)
    with te.autocast():
        y = norm(x)  # y is a QuantizedTensor
        assert isinstance(y, Float8Tensor)
        z = fc1(y)
    z.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # The FP8 input was consumed as is: result equals the GEMM of y's FP8 data.
    lin = fc1[0]
    ref = y.dequantize().double() @ lin.weight.dequantize().double().t() + lin.bias.double()
    torch.testing.assert_close(z.detach().double(), ref, rtol=1e-2, atol=1e-2)


class LearnableScale(te.ops.BasicOperation):
    def __init__(self) -> None:
        super().__init__()
        scale = torch.ones((), dtype=torch.float32, device=DEVICE)
        self.register_parameter("scale", torch.nn.Parameter(scale))

    def op_forward(self, ctx, input_: torch.Tensor, **unused) -> torch.Tensor:
        out = self.scale * input_
        ctx.save_for_backward(self.scale, input_)
        return out

    def op_backward(
        self,
        ctx,
        grad_output: torch.Tensor,
    ) -> tuple[torch.Tensor, Iterable[Optional[torch.Tensor]]]:
        scale, input_ = ctx.saved_tensors
        grad_scale = torch.inner(input_.reshape(-1), grad_output.reshape(-1)).reshape(())
        grad_input = scale * grad_output
        return (
            grad_input,  # Input gradient
            (grad_scale,),  # Param gradients
        )


def test_custom_basic_op_learnable_scale():
    op = LearnableScale()
    with torch.no_grad():
        op.scale.fill_(1.5)
    seq = te.ops.Sequential(op, te.ops.Identity())
    x = torch.randn(5, 7, device=DEVICE, requires_grad=True)
    y = seq(x)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(y, 1.5 * x)
    torch.testing.assert_close(x.grad, torch.full_like(x, 1.5))
    torch.testing.assert_close(op.scale.grad, x.detach().sum())


class ForwardAxpy(te.ops.FusedOperation):
    def __init__(self, scale: te.ops.ConstantScale, add: te.ops.AddExtraInput) -> None:
        super().__init__((scale, add))  # Equivalent basic ops

    def fuser_forward(
        self,
        basic_op_ctxs: list,
        input_: torch.Tensor,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        **unused,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        scale_op, add_op = self.basic_ops
        extra_input = basic_op_extra_inputs[1][0]  # Extra input to add op
        out = scale_op.scale * input_ + extra_input
        scale_ctx, add_ctx = basic_op_ctxs  # No state needed for backward
        return (
            out,  # Output
            [(), ()],  # Extra outputs for each basic op
        )


def fuse_axpy_ops(
    ops: list[te.ops.FusibleOperation],
    **unused,
) -> list[te.ops.FusibleOperation]:
    """Sliding window scan to perform ForwardAxpy fusion"""
    out = []
    window, ops = ops[:2], ops[2:]
    while len(window) == 2:
        if isinstance(window[0], te.ops.ConstantScale) and isinstance(window[1], te.ops.AddExtraInput):
            window = [ForwardAxpy(window[0], window[1])]
        else:
            out.append(window[0])
            window = window[1:]
        window, ops = window + ops[:1], ops[1:]
    out.extend(window + ops)
    return out


@pytest.fixture
def axpy_registered():
    te.ops.register_forward_fusion(fuse_axpy_ops)
    yield
    fusion_registry._FORWARD_FUSIONS.remove(fuse_axpy_ops)


def test_custom_fused_op_forward_axpy(axpy_registered):
    seq = te.ops.Sequential(te.ops.ConstantScale(2.5), te.ops.AddExtraInput(), te.ops.Identity())
    x = torch.randn(4, 6, device=DEVICE, requires_grad=True)
    r = torch.randn(4, 6, device=DEVICE, requires_grad=True)
    y = seq(x, r)
    fuser = seq.fusers()[0]
    assert any(isinstance(op, ForwardAxpy) for op, _ in fuser.forward_ops)
    # No backward fusion for it: backward runs the basic ops.
    assert not any(isinstance(op, ForwardAxpy) for op, _ in fuser.backward_ops)
    torch.testing.assert_close(y, 2.5 * x + r)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.5))
    torch.testing.assert_close(r.grad, torch.ones_like(r))
