"""Transformer Engine's fusions ForwardLinearScaleAdd, BackwardLinearScale and
BackwardAddRMSNorm: each fires under TE's conditions (and not otherwise, with the reason
in ``explain``), equals the unfused basic ops and a float64 reference, in high precision
and FP8 (delayed and current scaling)."""

from __future__ import annotations

import pytest
import torch

from tolerances import FP8_UNIT_ROUNDOFF, assert_close, assert_fp8_matmul_close
from tp_fuse.ops.basic import AddExtraInput, BasicLinear, ConstantScale, LayerNorm, MakeExtraOutput, RMSNorm
from tp_fuse.ops.fused import BackwardAddRMSNorm, BackwardLinearScale, ForwardLinearScaleAdd
from tp_fuse.ops.sequential import Sequential
from tp_fuse.quantization import autocast
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

IN, OUT = 32, 16  # multiples of 16: the FP8 GEMMs are valid on CUDA too
LEAD = (4, 8)
RECIPES = {"none": None, "delayed": DelayedScaling, "current": Float8CurrentScaling}


def _randn(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _types(runs) -> list[type]:
    return [type(op) for op, _ in runs]


def _run(model, recipe_name, *inputs):
    recipe = RECIPES[recipe_name]
    with autocast(enabled=recipe is not None, recipe=recipe() if recipe else None):
        return model(*inputs)


def _check_fp8_linear(y_minus_residual, dx, dw, x, w, dy, scale):
    """The three FP8 GEMMs of ``y = scale x W^T`` within their elementwise rounding bound
    (HYBRID: E4M3 x and W, E5M2 dy), against float64 math of the same inputs."""
    e4, e5 = FP8_UNIT_ROUNDOFF["e4m3"], FP8_UNIT_ROUNDOFF["e5m2"]
    x2d, dy2d = x.detach().reshape(-1, IN).double(), dy.reshape(-1, OUT).double()
    # bf16 outputs add their own rounding (2^-9 relative) on top of the FP8 bound.
    slack = 1e-2 if x.dtype == torch.bfloat16 else 1e-3
    if y_minus_residual is not None:
        assert_fp8_matmul_close(y_minus_residual.reshape(-1, OUT), scale * x2d, w.detach().double(), e4, e4, underflow_atol=slack * 8)
    assert_fp8_matmul_close(dx.reshape(-1, IN), scale * dy2d, w.detach().double().t(), e5, e4, underflow_atol=slack * 8)
    assert_fp8_matmul_close(dw, scale * dy2d.t(), x2d.t(), e5, e4, underflow_atol=slack * 8)


# ---- ForwardLinearScaleAdd + BackwardLinearScale ---------------------------------


# FP8 GEMMs write fp32/bf16/fp16 (no float64 FP8 cases).
CASES = [(r, d) for r in RECIPES for d in (torch.float32, torch.bfloat16, torch.float64) if r == "none" or d != torch.float64]


@pytest.mark.parametrize("recipe_name,dtype", CASES)
@pytest.mark.parametrize("scale", [1.0, 0.0, -2.5, 3.5])
def test_linear_scale_add_fuses_forward_and_backward(recipe_name, dtype, scale):
    torch.manual_seed(0)
    linear = BasicLinear(IN, OUT, dtype=dtype)
    model = Sequential(linear, ConstantScale(scale), AddExtraInput(in_place=True))
    x = _randn((*LEAD, IN), dtype, 1).requires_grad_()
    residual = _randn((*LEAD, OUT), dtype, 2)
    buf = residual.clone().requires_grad_()
    dy = _randn((*LEAD, OUT), dtype, 3)
    y = _run(model, recipe_name, x, buf * 1)  # a non-leaf buffer: in-place writes are allowed
    y.backward(dy)
    (fuser,) = model.fusers()
    assert _types(fuser.forward_ops) == [ForwardLinearScaleAdd]
    assert _types(fuser.backward_ops) == [BackwardLinearScale, AddExtraInput]

    # float64 reference
    x64, w64, r64 = x.detach().double().requires_grad_(), linear.weight.detach().double().requires_grad_(), residual.double().requires_grad_()
    y64 = scale * (x64 @ w64.t()) + r64
    y64.backward(dy.double())
    assert_close(buf.grad, r64.grad)
    if recipe_name == "none":
        assert_close(y, y64)
        assert_close(x.grad, x64.grad)
        assert_close(linear.weight.grad, w64.grad)
    else:
        _check_fp8_linear(y - residual, x.grad, linear.weight.grad, x, linear.weight, dy, scale)

    if recipe_name != "none" or dtype == torch.bfloat16:
        # FP8: the fused backward quantizes dy, the unfused one scale * dy; bf16: the unfused
        # rounds scale * dy to bf16 before its GEMMs. Both are checked against float64 above.
        return
    # the unfused basic ops (one fuser each) give the same
    linear2 = BasicLinear(IN, OUT, dtype=dtype)
    with torch.no_grad():
        linear2.weight.copy_(linear.weight)
    ops = [linear2, ConstantScale(scale), AddExtraInput(in_place=True)]
    x2 = x.detach().clone().requires_grad_()
    y2 = ops[2](ops[1](ops[0](x2)), residual.clone())
    y2.backward(dy)
    for got, want in ((y, y2), (x.grad, x2.grad), (linear.weight.grad, linear2.weight.grad)):
        assert_close(got, want)


def test_linear_scale_add_writes_into_the_residual_buffer():
    linear = BasicLinear(IN, OUT)
    model = Sequential(linear, ConstantScale(-2.0), AddExtraInput(in_place=True))
    x, residual = torch.randn(*LEAD, IN), torch.randn(*LEAD, OUT)
    buf = residual.clone()
    y = model(x, buf)
    assert y.data_ptr() == buf.data_ptr()
    assert_close(buf, -2.0 * (x.double() @ linear.weight.double().t()) + residual.double())
    with autocast(recipe=Float8CurrentScaling()):
        reasons = [r.reason for r in model.fusers()[0].explain().fused]
    assert any("FP8: scaled GEMM, then alpha * y added into the residual's buffer" in r for r in reasons), reasons


def test_linear_scale_add_not_fused_without_in_place():
    model = Sequential(BasicLinear(IN, OUT), ConstantScale(0.5), AddExtraInput())
    x, residual = torch.randn(*LEAD, IN), torch.randn(*LEAD, OUT)
    y = model(x, residual)
    (fuser,) = model.fusers()
    assert ForwardLinearScaleAdd not in _types(fuser.forward_ops)
    # The backward still fuses the scale into the linear's GEMMs.
    assert _types(fuser.backward_ops) == [BackwardLinearScale, AddExtraInput]
    reasons = [r.reason for r in fuser.explain().rejected if r.fusion == "fuse_forward_linear_scale_add"]
    assert any("AddExtraInput(in_place=False)" in r for r in reasons), reasons
    assert_close(y, 0.5 * (x.double() @ model[0].weight.double().t()) + residual.double())


def test_linear_scale_add_not_fused_with_another_op_between():
    model = Sequential(BasicLinear(IN, OUT), ConstantScale(0.5), MakeExtraOutput(), AddExtraInput(in_place=True))
    model(torch.randn(*LEAD, IN), torch.randn(*LEAD, OUT))
    (fuser,) = model.fusers()
    assert ForwardLinearScaleAdd not in _types(fuser.forward_ops)
    reasons = [r.reason for r in fuser.explain().rejected if r.fusion == "fuse_forward_linear_scale_add"]
    assert any("followed by MakeExtraOutput, not AddExtraInput" in r for r in reasons), reasons


def test_row_parallel_linear_does_not_fuse_scale_add():
    # TP size 1 (no process group): the row-parallel op still stands for its AllReduce,
    # which sits between the GEMM and the scale, as TE's condition requires.
    model = Sequential(BasicLinear(IN, OUT, tensor_parallel_mode="row"), ConstantScale(0.5), AddExtraInput(in_place=True))
    model(torch.randn(*LEAD, IN), torch.randn(*LEAD, OUT))
    (fuser,) = model.fusers()
    assert ForwardLinearScaleAdd not in _types(fuser.forward_ops)
    assert BackwardLinearScale not in _types(fuser.backward_ops)


def test_column_parallel_linear_does_not_fuse_backward_scale():
    linear = BasicLinear(IN, OUT, tensor_parallel_mode="column")
    model = Sequential(linear, ConstantScale(3.0))
    x = torch.randn(*LEAD, IN, requires_grad=True)
    model(x).sum().backward()
    (fuser,) = model.fusers()
    assert _types(fuser.backward_ops) == [BasicLinear, ConstantScale]
    reasons = [r.reason for r in fuser.explain().rejected if r.fusion == "fuse_backward_linear_scale"]
    assert any("column tensor-parallel" in r for r in reasons), reasons
    assert_close(x.grad, 3.0 * linear.weight.double().sum(0).expand(*LEAD, IN))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_linear_scale_alone(recipe_name, dtype):
    torch.manual_seed(0)
    linear = BasicLinear(IN, OUT, dtype=dtype)
    model = Sequential(linear, ConstantScale(-2.5))
    x = _randn((*LEAD, IN), dtype, 1).requires_grad_()
    dy = _randn((*LEAD, OUT), dtype, 3)
    y = _run(model, recipe_name, x)
    (y * dy).sum().backward()
    (fuser,) = model.fusers()
    assert _types(fuser.backward_ops) == [BackwardLinearScale]
    x64, w64 = x.detach().double().requires_grad_(), linear.weight.detach().double().requires_grad_()
    (((x64 @ w64.t()) * -2.5) * dy.double()).sum().backward()
    if recipe_name == "none":
        assert_close(x.grad, x64.grad)
        assert_close(linear.weight.grad, w64.grad)
    else:
        _check_fp8_linear(None, x.grad, linear.weight.grad, x, linear.weight, dy, -2.5)


# ---- BackwardAddRMSNorm ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("with_extra_grad", [True, False])
@pytest.mark.parametrize("shape", [(19,), (4, 16)], ids=["h19", "h4x16"])
def test_backward_add_rmsnorm(dtype, zero_centered_gamma, with_extra_grad, shape):
    eps = 0.3
    norm = RMSNorm(shape, eps=eps, dtype=dtype, zero_centered_gamma=zero_centered_gamma)
    with torch.no_grad():
        norm.weight.copy_(_randn(shape, dtype, 4))
    model = Sequential(MakeExtraOutput(), norm)
    x = _randn((6, *shape), dtype, 1).requires_grad_()
    dy1, dy2 = _randn(x.shape, dtype, 2), _randn(x.shape, dtype, 3)
    y1, y2 = model(x)
    ((y1 * dy1).sum() + ((y2 * dy2).sum() if with_extra_grad else 0)).backward()
    (fuser,) = model.fusers()
    assert _types(fuser.backward_ops) == [BackwardAddRMSNorm]

    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    dims = tuple(range(1, x.dim()))
    g = 1 + w64 if zero_centered_gamma else w64
    y64 = x64 / torch.sqrt(x64.square().mean(dim=dims, keepdim=True) + eps) * g
    ((y64 * dy1.double()).sum() + ((x64 * dy2.double()).sum() if with_extra_grad else 0)).backward()
    assert_close(y1, y64)
    assert_close(y2, x64)
    assert_close(x.grad, x64.grad)
    assert_close(norm.weight.grad, w64.grad)


def test_backward_add_rmsnorm_equals_the_unfused_ops():
    norm = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(_randn(24, torch.float32, 4))
    x = _randn((5, 24), torch.float32, 1)
    dy1, dy2 = _randn(x.shape, torch.float32, 2), _randn(x.shape, torch.float32, 3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = Sequential(MakeExtraOutput(), norm)(xa)
    torch.autograd.backward([y1, y2], [dy1, dy2])
    dw_fused = norm.weight.grad.clone()
    norm.weight.grad = None
    r, h = MakeExtraOutput()(xb)
    torch.autograd.backward([norm(h), r], [dy1, dy2])
    # The fused add happens in the norm's fp32 math before the one rounding: equal here
    # (fp32 in, fp32 math) up to the order of two additions.
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(dw_fused, norm.weight.grad)


def test_backward_add_rmsnorm_not_fused_under_other_conditions():
    # in_place=True MakeExtraOutput (TE's condition is in_place=False), and a LayerNorm.
    for ops, reason in (
        ([MakeExtraOutput(in_place=True), RMSNorm(16)], "MakeExtraOutput(in_place=True)"),
        ([MakeExtraOutput(), LayerNorm(16)], None),
    ):
        model = Sequential(*ops)
        x = torch.randn(3, 16, requires_grad=True)
        y1, y2 = model(x)
        (y1.sum() + y2.sum()).backward()
        (fuser,) = model.fusers()
        assert BackwardAddRMSNorm not in _types(fuser.backward_ops)
        if reason:
            rejected = [r.reason for r in fuser.explain().rejected if r.fusion == "fuse_backward_add_rmsnorm"]
            assert any(reason in r for r in rejected), rejected


def test_norm_writes_fp8_for_the_scale_add_gemm():
    # Under FP8 the norm before a ForwardLinearScaleAdd writes the GEMM's FP8 input.
    from tp_fuse.ops.fused import ForwardNormQuantizeLinear

    norm, linear = RMSNorm(IN), BasicLinear(IN, OUT)
    model = Sequential(norm, linear, ConstantScale(0.5), AddExtraInput(in_place=True))
    x, residual = _randn((*LEAD, IN), torch.float32, 1), _randn((*LEAD, OUT), torch.float32, 2)
    with autocast(recipe=Float8CurrentScaling()):
        y = model(x, residual.clone())
    (fuser,) = model.fusers()
    assert _types(fuser.forward_ops) == [ForwardNormQuantizeLinear]
    assert isinstance(fuser.forward_ops[0][0].linear_op, ForwardLinearScaleAdd)
    h = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + norm.eps)
    e4 = FP8_UNIT_ROUNDOFF["e4m3"]
    assert_fp8_matmul_close((y - residual).reshape(-1, OUT), 0.5 * h.reshape(-1, IN), linear.weight.double(), e4, e4, underflow_atol=8e-3)
