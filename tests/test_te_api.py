"""Transformer Engine names: quantizers, DType, QuantizedTensor, availability, Format
values, op.get_quantizer."""

import pytest
import torch

import tp_fuse as te
from tp_fuse import ops
from tp_fuse.recipe import DelayedScaling, Format
from tolerances import FP8_UNIT_ROUNDOFF, assert_close


def test_format_values_carry_max_fwd_and_bwd():
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    assert Format.E4M3.value == (448, 448) and Format.E5M2.value == (57344, 57344)
    assert Format["HYBRID"] is Format.HYBRID  # configs name formats
    for f in Format:
        assert (f.fwd_max, f.bwd_max) == tuple(f.value)


def test_availability_functions():
    ok, reason = te.is_fp8_available(return_reason=True)
    assert ok is True and reason == ""  # torch._scaled_mm runs on CPU (torch >= 2.13)
    assert te.is_fp8_available() is True
    # The block recipes run as an exact emulation on CPU (this test runs without a GPU in
    # CI); they used to answer "not implemented" after MXFP8 and block scaling existed.
    for fn in (te.is_mxfp8_available, te.is_fp8_block_scaling_available, te.is_nvfp4_available):
        assert fn(return_reason=True) == (True, "") or torch.cuda.is_available()
        assert fn() is True or torch.cuda.is_available()
    assert te.is_bf16_available() is True


def test_float8_quantizer_uses_given_scale_and_folds_amax():
    scale = torch.full((), 4.0)
    amax = torch.zeros(1)
    q = te.Float8Quantizer(scale=scale, amax=amax, fp8_dtype=te.DType.kFloat8E4M3)
    x = torch.tensor([[1.0, -3.0], [0.5, 2.0]])
    y = q(x)
    assert isinstance(y, te.QuantizedTensor) and isinstance(y, te.Float8Tensor)
    assert y.fp8_dtype == torch.float8_e4m3fn and float(y._scale_inv) == 0.25
    assert torch.equal(y.dequantize(), x)  # all exactly representable at scale 4
    assert float(amax) == 3.0
    q(torch.full((2, 2), 0.5))
    assert float(amax) == 3.0  # running max
    scale.fill_(2.0)  # held by reference
    assert float(q(x)._scale_inv) == 0.5
    with pytest.raises(ValueError, match="fp8 dtype: expected one of"):
        te.Float8Quantizer(scale=scale, amax=amax, fp8_dtype=torch.float16)


def test_float8_current_scaling_quantizer():
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E5M2, device="cpu")
    x = torch.randn(8, 8)
    y = q(x)
    assert y.fp8_dtype == torch.float8_e5m2
    assert float(y._scale_inv) == pytest.approx(float(x.abs().max()) / Format.E5M2.fwd_max)
    u = FP8_UNIT_ROUNDOFF["e5m2"]
    assert ((y.dequantize() - x).abs() <= x.abs() * u + 1e-6).all()
    eps = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, amax_epsilon=10.0)
    assert float(eps(x)._scale_inv) == pytest.approx(10.0 / 448)
    pow2 = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, force_pow_2_scales=True)
    s = 1.0 / float(pow2(x)._scale_inv)
    assert s == 2.0 ** round(torch.log2(torch.tensor(s)).item())
    with pytest.raises(ValueError, match="with_amax_reduction=True needs amax_reduction_group"):
        te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, with_amax_reduction=True)


def test_quantized_input_feeds_basic_linear():
    """A user-quantized input (TE's quantized_input) is used by the GEMM as it is."""
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3)
    x8 = q(torch.rand(16, 16))
    lin = ops.BasicLinear(16, 16)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = lin(x8)
    ref = x8.dequantize().double() @ lin.weight.detach().double().t()
    torch.testing.assert_close(y.double(), ref, rtol=0.125, atol=0.0625)


def test_get_quantizer():
    lin = ops.BasicLinear(16, 16)
    assert lin.get_quantizer("forward", 0) is None  # no FP8 step yet
    recipe = DelayedScaling()
    with te.autocast(recipe=recipe):
        lin(torch.randn(16, 16))
    assert lin.get_quantizer("forward", 0).role == "input"
    assert lin.get_quantizer("forward", 1).role == "weight"
    assert lin.get_quantizer("backward", 0).role == "grad_output"
    with pytest.raises(ValueError, match=r"backward index must be in \[0, 1\), got 1"):
        lin.get_quantizer("backward", 1)
    with pytest.raises(ValueError, match="mode: expected 'forward' or 'backward'"):
        lin.get_quantizer("fwd", 0)
    assert ops.GELU().get_quantizer("forward", 0) is None


def test_sequential_pop():
    a, b, c = ops.Identity(), ops.GELU(), ops.ReLU()
    seq = ops.Sequential(a, b, c)
    assert seq.pop(1) is b and list(seq) == [a, c]
    assert seq.pop() is c and list(seq) == [a]
    seq = ops.Sequential(a, b, c)
    popped = seq.pop(slice(0, 2))
    assert isinstance(popped, ops.Sequential) and list(popped) == [a, b] and list(seq) == [c]
    x = torch.randn(3)
    assert torch.equal(seq(x), torch.relu(x))  # fusers rebuilt after the change


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("overwrite", [False, True])
def test_accumulate_into_main_grad(fused, overwrite):
    """Megatron's wgrad fusion: dW goes into weight.main_grad (fp32), weight.grad stays None."""
    torch.manual_seed(0)
    lin = ops.Linear(8, 4, accumulate_into_main_grad=True, dtype=torch.bfloat16)
    seq = ops.Sequential(lin, ops.GELU()) if fused else ops.Sequential(lin)
    lin.weight.main_grad = torch.full((4, 8), 0.5)
    if overwrite:
        lin.weight.overwrite_main_grad = True
    x = torch.randn(6, 8, dtype=torch.float64)
    dy = torch.randn(6, 4, dtype=torch.float64)
    seq(x.to(torch.bfloat16)).backward(dy.to(torch.bfloat16))
    # TE's semantics: the flag is set (and a zero dummy returned) only where Megatron's DDP
    # created it; here nobody did, so no wgrad at all.
    assert lin.weight.grad is None and not hasattr(lin.weight, "grad_added_to_main_grad")
    xr = x.to(torch.bfloat16).double()
    w = lin.weight.detach().double().requires_grad_()
    z = xr @ w.t() + lin.bias.detach().double()
    (torch.nn.functional.gelu(z, approximate="tanh") if fused else z).backward(dy.to(torch.bfloat16).double())
    expected = w.grad + (0 if overwrite else 0.5)
    assert_close(lin.weight.main_grad, expected, torch.bfloat16)  # dW rounded to bf16 once
    if fused:
        assert "ForwardLinearBiasActivation" in str(seq.explain())
    lin.weight.main_grad = None
    with pytest.raises(ValueError, match="weight.main_grad must be a tensor of shape"):
        seq(x.to(torch.bfloat16)).backward(dy.to(torch.bfloat16))
