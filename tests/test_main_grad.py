"""``BasicLinear(accumulate_into_main_grad=True)`` (Megatron's gradient_accumulation_fusion):
the wgrad lands in ``weight.main_grad`` whichever (fused) backward computed it."""

from __future__ import annotations

import pytest
import torch

import tp_fuse as te
from tolerances import assert_close
from tp_fuse.ops.basic import GELU, BasicLinear, Bias, ConstantScale, MakeExtraOutput
from tp_fuse.ops.fused import BackwardActivationBias, BackwardLinearAdd, BackwardLinearScale
from tp_fuse.ops.sequential import Sequential
from tp_fuse.recipe import Float8CurrentScaling


def _ops(fused_backward: str) -> list:
    torch.manual_seed(0)
    if fused_backward == "linear_add":
        return [MakeExtraOutput(), BasicLinear(8, 8, accumulate_into_main_grad=True), Bias(8)]
    if fused_backward == "activation_bias":
        return [BasicLinear(8, 6, accumulate_into_main_grad=True), Bias(6), GELU()]
    # BackwardLinearScale computes the wgrad itself (alpha in the GEMM).
    return [BasicLinear(8, 6, accumulate_into_main_grad=True), ConstantScale(-1.5)]


FUSED = {"linear_add": BackwardLinearAdd, "activation_bias": BackwardActivationBias, "linear_scale": BackwardLinearScale}


@pytest.mark.parametrize("fused_backward", sorted(FUSED))
@pytest.mark.parametrize("megatron_flag", [False, True])
def test_wgrad_goes_to_main_grad(fused_backward: str, megatron_flag: bool) -> None:
    seq = Sequential(*_ops(fused_backward))
    linear = seq[1] if fused_backward == "linear_add" else seq[0]
    ref = Sequential(*_ops(fused_backward))
    for op in ref:
        if isinstance(op, BasicLinear):
            op.accumulate_into_main_grad = False
    w = linear.weight
    w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float64)
    if megatron_flag:
        w.grad_added_to_main_grad = False
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    # BackwardActivationBias fuses under an FP8 recipe only (as in Transformer Engine).
    recipe = Float8CurrentScaling() if fused_backward == "activation_bias" else None
    for model in (seq, ref):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x.clone().requires_grad_())
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.square().sum() for o in outs).backward()
    ref_w = [op for op in ref if isinstance(op, BasicLinear)][0].weight
    assert_close((w.main_grad - 0.5).float(), ref_w.grad)
    (fuser,) = seq.fusers()
    want = FUSED[fused_backward]
    assert want in [type(op) for op, _ in fuser.backward_ops]
    if megatron_flag:  # a zero dummy keeps Megatron DDP's grad hooks firing; they skip their add
        assert w.grad_added_to_main_grad and w.grad is not None and float(w.grad.abs().sum()) == 0.0
    else:
        assert w.grad is None


def test_missing_main_grad_is_a_value_error() -> None:
    seq = Sequential(BasicLinear(4, 4, accumulate_into_main_grad=True))
    y = seq(torch.randn(2, 4, requires_grad=True))
    with pytest.raises(ValueError, match="weight.main_grad is not set"):
        y.sum().backward()
