"""FP8 GEMMs in BasicLinear/Linear: forward, dgrad, wgrad against float64."""

import pytest
import torch

import tp_fuse as te
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Format
from tolerances import FP8_UNIT_ROUNDOFF, assert_close, assert_fp8_matmul_close

RECIPES = {
    "delayed-hybrid": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "delayed-e4m3": lambda: DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4),
    "current-hybrid": lambda: Float8CurrentScaling(fp8_format=Format.HYBRID),
}


def _reference(x, w, b, dy):
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_()
    y = torch.nn.functional.linear(xd, wd, bd)
    y.backward(dy.double())
    return y, xd.grad, wd.grad, bd.grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_linear_matches_float64(name):
    torch.manual_seed(0)
    recipe = RECIPES[name]()
    lin = te.ops.Linear(64, 48)
    x = torch.randn(2, 40, 64, requires_grad=True)
    dy = torch.randn(2, 40, 48)
    # Delayed scaling quantizes with last step's scale: run a few steps so the
    # scales have adapted to the data before checking accuracy.
    for _ in range(3):
        x.grad = None
        lin.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe):
            y = lin(x)
        y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = _reference(x, lin.weight, lin.bias, dy)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, y_ref) < 0.05
    assert rel(x.grad, dx_ref) < 0.15
    assert rel(lin.weight.grad, dw_ref) < 0.15
    assert_close(lin.bias.grad, db_ref, torch.float32)  # bias grad stays high precision
    # Elementwise: within the FP8 rounding bound of each GEMM.
    u_fwd = FP8_UNIT_ROUNDOFF["e4m3"]
    u_bwd = FP8_UNIT_ROUNDOFF["e4m3" if recipe.fp8_format == Format.E4M3 else "e5m2"]
    x2d, dy2d, w = x.detach().reshape(-1, 64), dy.reshape(-1, 48), lin.weight.detach()
    assert_fp8_matmul_close(y, x2d, w, u_fwd, u_fwd, bias=lin.bias)
    assert_fp8_matmul_close(x.grad, dy2d, w.t(), u_bwd, u_fwd)
    assert_fp8_matmul_close(lin.weight.grad, dy2d.t(), x2d.t(), u_bwd, u_fwd)
    # FP8 actually happened: the result is not the high-precision one.
    y_hp = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert (y - y_hp).abs().max() > 0


def test_delayed_scales_follow_amax():
    torch.manual_seed(1)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8, margin=1)
    lin = te.ops.BasicLinear(32, 16)
    x = 3.0 * torch.randn(16, 32, requires_grad=True)  # 16 tokens: wgrad's K, % 16 as on CUDA
    with te.autocast(recipe=recipe):
        y = lin(x)
    y.backward(torch.ones_like(y))
    qs = lin._quantizers.get(recipe, None)
    expected_in = (448.0 / x.detach().abs().max()) / 2
    expected_w = (448.0 / lin.weight.detach().abs().max()) / 2
    expected_dy = torch.tensor(57344.0 / 1.0 / 2)
    torch.testing.assert_close(qs["input"].scale, expected_in.float())
    torch.testing.assert_close(qs["weight"].scale, expected_w.float())
    torch.testing.assert_close(qs["grad_output"].scale, expected_dy.float())


def test_fusions_apply_under_fp8():
    seq = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.GELU(), te.ops.Linear(64, 32))
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        y = seq(x)
        exp = seq.explain()
    y.sum().backward()
    assert exp.recipe is not None and "DelayedScaling" in exp.recipe
    assert any("ForwardLinearBiasActivation" in op for op in exp.forward_ops), str(exp)
    assert x.grad is not None and torch.isfinite(x.grad).all()
