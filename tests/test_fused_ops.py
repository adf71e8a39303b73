"""Fused ops: the fusion happens, equals the unfused basic ops and a float64 reference, explains rejections."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

import tp_fuse as te
from tolerances import assert_close
from tp_fuse.ops.basic import (
    GELU,
    AddExtraInput,
    BasicLinear,
    Bias,
    LayerNorm,
    MakeExtraOutput,
    Quantize,
    ReLU,
    SwiGLU,
)
from tp_fuse.recipe import Float8CurrentScaling
from tp_fuse.ops.fused import (
    BackwardActivationBias,
    BackwardLinearAdd,
    ForwardLinearBiasActivation,
    ForwardLinearBiasAdd,
)
from tp_fuse.ops.linear import Linear
from tp_fuse.ops.sequential import Sequential

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
IN, OUT = 7, 6
LEAD = (3, 5)


def _randn(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _make_ops(kinds: Sequence[str], dtype: torch.dtype, seed: int = 0) -> list:
    """Basic ops from short names; parameters randomized (a zero bias would hide bias bugs)."""
    torch.manual_seed(seed)
    factories: dict[str, Callable] = {
        "linear": lambda: BasicLinear(IN, OUT, dtype=dtype),
        "bias": lambda: Bias(OUT, dtype=dtype),
        "gelu": GELU,
        "relu": ReLU,
        "swiglu": SwiGLU,
        "add": AddExtraInput,
        "extra_out": MakeExtraOutput,
    }
    ops = [factories[k]() for k in kinds]
    with torch.no_grad():
        for op in ops:
            for p in op.parameters():
                p.copy_(torch.randn(p.shape, dtype=torch.float64).to(dtype) / math.sqrt(p.shape[-1]))
    return ops


def _unfused(ops: Sequence) -> Callable:
    """Each basic op on its own (a one-op fuser each): nothing can fuse."""

    def run(x, *extras):
        pending, side = list(extras), []
        for op in ops:
            if op.num_extra_inputs:
                x = op(x, pending.pop(0))
            elif op.num_extra_outputs:
                x, extra = op(x)
                side.append(extra)
            else:
                x = op(x)
        return (x, *side) if side else x

    return run


def _run(fn: Callable, params: Sequence[torch.Tensor], inputs, grads):
    """Forward + backward; returns (outputs, input grads, param grads)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    for p in params:
        p.grad = None
    outs = fn(*leaves)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.backward(outs, list(grads))
    return [o.detach() for o in outs], [t.grad for t in leaves], [p.grad.detach().clone() for p in params]


def _reference(kinds: Sequence[str], ops: Sequence, inputs, grads):
    """The same graph in float64 with plain torch math."""
    params = [p for op in ops for p in op.parameters()]
    leaves = [t.detach().double().requires_grad_() for t in (*inputs, *params)]
    x, extras = leaves[0], list(leaves[1 : len(inputs)])
    ps = iter(leaves[len(inputs) :])
    side = []
    for k in kinds:
        if k == "linear":
            x = x @ next(ps).t()
        elif k == "bias":
            x = x + next(ps)
        elif k == "gelu":
            x = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        elif k == "relu":
            x = torch.relu(x)
        elif k == "swiglu":
            a, b = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(a) * b
        elif k == "add":
            x = x + extras.pop(0)
        elif k == "extra_out":
            side.append(x)
            x = x * 1
    outs = (x, *side)
    torch.autograd.backward(outs, [g.double() for g in grads])
    return outs, [t.grad for t in leaves[: len(inputs)]], [t.grad for t in leaves[len(inputs) :]]


def _op_types(runs) -> list[type]:
    return [type(op) for op, _ in runs]


def _check_case(kinds, dtype, extra_shapes=(), out_dim=OUT, extra_out=False):
    """Run fused (Sequential), unfused (op by op) and float64; compare everything; return the fuser."""
    ops = _make_ops(kinds, dtype)
    params = [p for op in ops for p in op.parameters()]
    x = _randn((*LEAD, IN), dtype, seed=10)
    inputs = [x] + [_randn(s, dtype, seed=20 + i) for i, s in enumerate(extra_shapes)]
    out_shapes = [(*LEAD, out_dim)] + ([(*LEAD, IN)] if extra_out else [])
    grads = [_randn(s, dtype, seed=30 + i) for i, s in enumerate(out_shapes)]

    seq = Sequential(*ops)
    fused = _run(seq, params, inputs, grads)
    unfused = _run(_unfused(ops), params, inputs, grads)
    ref = _reference(kinds, ops, inputs, grads)
    for got, base, exp in zip(fused, unfused, ref):
        assert len(got) == len(base) == len(exp)
        for g, b, e in zip(got, base, exp):
            assert g is not None and g.dtype == dtype and g.shape == e.shape
            assert_close(g, b)  # interchangeable with the basic ops
            assert_close(g, e)  # and right
    (fuser,) = seq.fusers()
    explanation = fuser.explain()
    assert all(r.reason for r in explanation.rejected), str(explanation)
    return fuser, explanation


# ---- each fusion happens and is interchangeable --------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_linear_bias_activation(dtype, act):
    fuser, exp = _check_case(["linear", "bias", act], dtype)
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasActivation]
    # Transformer Engine's condition: dact+dbias fuses only for an FP8 consumer (see
    # test_backward_activation_bias_is_bit_identical for the FP8 case).
    assert _op_types(fuser.backward_ops) == [BasicLinear, Bias, {"gelu": GELU, "relu": ReLU}[act]]
    assert any("no FP8 recipe" in r.reason for r in exp.rejected if r.direction == "backward"), str(exp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bias_alone(dtype):
    fuser, exp = _check_case(["linear", "bias"], dtype)
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasActivation]
    assert len(fuser.forward_ops[0][0].basic_ops) == 2
    # In backward the Bias has no activation to fuse with, and says so.
    assert _op_types(fuser.backward_ops) == [BasicLinear, Bias]
    assert any("Bias is the last op" in r.reason for r in exp.rejected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "residual_shape", [(*LEAD, OUT), (OUT,), (LEAD[1], 1)], ids=["full", "bcast-vector", "bcast-ones"]
)
def test_linear_bias_add(dtype, residual_shape):
    fuser, _ = _check_case(["linear", "bias", "add"], dtype, extra_shapes=[residual_shape])
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasAdd]
    # Forward fused, backward basic: the fused forward filled the basic ops' contexts.
    assert _op_types(fuser.backward_ops) == [BasicLinear, Bias, AddExtraInput]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_add_without_bias(dtype):
    fuser, _ = _check_case(["linear", "add"], dtype, extra_shapes=[(*LEAD, OUT)])
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasAdd]
    assert len(fuser.forward_ops[0][0].basic_ops) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_linear_add(dtype):
    fuser, _ = _check_case(["extra_out", "linear", "bias", "gelu"], dtype, extra_out=True)
    assert _op_types(fuser.forward_ops) == [MakeExtraOutput, ForwardLinearBiasActivation]
    assert _op_types(fuser.backward_ops) == [BackwardLinearAdd, Bias, GELU]


@pytest.mark.parametrize("in_place", [False, True])
def test_backward_linear_add_in_place_make_extra_output(in_place):
    ops = [MakeExtraOutput(in_place=in_place), BasicLinear(IN, OUT)]
    seq = Sequential(*ops)
    x = _randn((*LEAD, IN), torch.float32, 1).requires_grad_()
    y, residual = seq(x)
    dy, dres = _randn(y.shape, torch.float32, 2), _randn(residual.shape, torch.float32, 3)
    torch.autograd.backward([y, residual], [dy, dres])
    assert _op_types(seq.fusers()[0].backward_ops) == [BackwardLinearAdd]
    assert_close(x.grad, dy.double() @ ops[1].weight.double() + dres.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_activation_bias_is_bit_identical(dtype):
    # [Quantize(backward), Bias, GELU] under FP8 (Transformer Engine's conditions): the
    # forward is basic in both runs, so the backward fusion must reproduce the basic
    # ops' dx and dbias bit for bit. Without FP8, or without an FP8 consumer, no fusion.
    from tp_fuse.quantization import autocast
    from tp_fuse.recipe import Float8CurrentScaling

    for act in (GELU, ReLU):
        quantize, bias, activation = Quantize(forward=False, backward=True), Bias(IN, dtype=dtype), act()
        with torch.no_grad():
            bias.bias.copy_(_randn(IN, dtype, 4))
        x = _randn((*LEAD, IN), dtype, 5)
        dy = _randn((*LEAD, IN), dtype, 6)

        def under_fp8(fn):
            def run(*args):
                with autocast(recipe=Float8CurrentScaling()):
                    return fn(*args)

            return run

        seq = Sequential(quantize, bias, activation)
        fused = _run(under_fp8(seq), [bias.bias], [x], [dy])
        assert _op_types(seq.fusers()[0].backward_ops) == [Quantize, BackwardActivationBias]
        basic = _run(under_fp8(_unfused([quantize, bias, activation])), [bias.bias], [x], [dy])
        for a, b in zip(fused[1] + fused[2], basic[1] + basic[2]):
            assert torch.equal(a, b)
        hp = Sequential(Quantize(forward=False, backward=True), Bias(IN, dtype=dtype), act())
        _run(hp, list(hp.parameters()), [x], [dy])
        assert _op_types(hp.fusers()[0].backward_ops) == [Quantize, Bias, act]
        alone = Sequential(Bias(IN, dtype=dtype), act())
        _run(under_fp8(alone), list(alone.parameters()), [x], [dy])
        assert _op_types(alone.fusers()[0].backward_ops) == [Bias, act]
        with autocast(recipe=Float8CurrentScaling()):
            reasons = [r.reason for r in alone.explain().records if not r.fused]
        assert any("preceded by nothing" in r and "grad-output quantizer" in r for r in reasons), reasons


def test_backward_activation_bias_conditions_are_te_s():
    """Old: ``[Bias, GELU]`` fused in every case; Transformer Engine fuses it only under an
    FP8 recipe and when the op before Bias quantizes its grad_output (its
    test_backward_activation_bias expects 3 basic backward ops in high precision)."""
    x = torch.randn(*LEAD, IN, requires_grad=True)

    def backward_ops(ops, fp8):
        seq = Sequential(*ops)
        with te.autocast(enabled=fp8, recipe=Float8CurrentScaling() if fp8 else None):
            seq(x).sum().backward()
        return _op_types(seq.fusers()[0].backward_ops), seq.fusers()[0].explain()

    got, exp = backward_ops([Quantize(forward=False, backward=True), Bias(IN), GELU()], fp8=False)
    assert got == [Quantize, Bias, GELU]
    assert any("no FP8 recipe" in r.reason for r in exp.rejected), str(exp)
    got, exp = backward_ops([Bias(IN), GELU()], fp8=True)  # nothing before Bias
    assert got == [Bias, GELU]
    got, exp = backward_ops([Quantize(forward=True, backward=False), Bias(IN), GELU()], fp8=True)
    assert got == [Quantize, Bias, GELU]
    assert any("has no grad-output quantizer" in r.reason for r in exp.rejected), str(exp)
    got, _ = backward_ops([BasicLinear(IN, IN), Bias(IN), ReLU()], fp8=True)
    assert got == [BasicLinear, BackwardActivationBias]


def test_linear_container_fuses_like_its_basic_ops():
    torch.manual_seed(0)
    seq = Sequential(Linear(IN, OUT), ReLU(), Linear(OUT, IN), AddExtraInput())
    x = torch.randn(*LEAD, IN, requires_grad=True)
    residual = torch.randn(*LEAD, IN)
    y = seq(x, residual)
    y.sum().backward()
    (fuser,) = seq.fusers()
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasActivation, ForwardLinearBiasAdd]
    l1, _, l2, _ = list(seq)
    ref = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, l1.weight, l1.bias)), l2.weight, l2.bias)
    assert_close(y, ref + residual)


# ---- rejections carry reasons ----------------------------------------------


def test_swiglu_window_is_rejected_with_reason():
    fuser, exp = _check_case(["linear", "bias", "swiglu"], torch.float32, out_dim=OUT // 2)
    # The bias still goes into the GEMM epilogue; the activation does not fuse.
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasActivation, SwiGLU]
    assert _op_types(fuser.backward_ops) == [BasicLinear, Bias, SwiGLU]
    forward = [r for r in exp.rejected if r.direction == "forward" and "SwiGLU" in r.window]
    backward = [r for r in exp.rejected if r.direction == "backward" and "SwiGLU" in r.window]
    assert any("only GELU/ReLU fuse" in r.reason and "BasicLinear" in r.window for r in forward), str(exp)
    assert any(r.reason == "Bias followed by SwiGLU: only GELU/ReLU fuse" for r in backward), str(exp)


def test_reasons_for_linear_without_bias_and_extra_output_without_linear():
    seq = Sequential(BasicLinear(IN, IN), GELU(), MakeExtraOutput(), LayerNorm(IN))
    exp = seq.explain()
    assert str(exp)
    reasons = [r.reason for r in exp.records if not r.fused]
    assert any("BasicLinear has no Bias after it (followed by GELU)" in r for r in reasons), reasons
    assert any("not AddExtraInput" in r for r in reasons), reasons
    assert any("MakeExtraOutput is followed by LayerNorm, not BasicLinear" in r for r in reasons), reasons
    assert not any(r.fused for r in exp.records)


def test_mismatched_bias_is_rejected_and_the_basic_op_reports_it():
    seq = Sequential(BasicLinear(IN, OUT), Bias(OUT + 1), GELU())
    exp = seq.explain()
    rejected = [r for r in exp.records if not r.fused]
    assert any("out_features=6 does not match Bias size 7" in r.reason for r in rejected), str(exp)
    with pytest.raises(ValueError, match=r"Bias: expected last dimension 7, got input of shape \(3, 5, 6\)"):
        seq(torch.randn(*LEAD, IN))


@pytest.mark.parametrize("bias", [True, False])
def test_in_place_add_fuses_into_the_residual_buffer(bias):
    """Old: ``AddExtraInput(in_place=True)`` was rejected, the one case Transformer
    Engine fuses (TE's test_forward_linear_bias_add). Now the GEMM accumulates into the
    residual's buffer; the output aliases it, as the unfused in-place add's does."""
    ops = [BasicLinear(IN, OUT, dtype=torch.float64)] + ([Bias(OUT, dtype=torch.float64)] if bias else [])
    seq = Sequential(*ops, AddExtraInput(in_place=True))
    x = _randn((*LEAD, IN), torch.float64, 1).requires_grad_()
    residual = _randn((*LEAD, OUT), torch.float64, 2)
    buf = residual.clone().requires_grad_()
    y = seq(x, buf)
    (fuser,) = seq.fusers()
    assert _op_types(fuser.forward_ops) == [ForwardLinearBiasAdd]
    assert "in place" in str(fuser.explain())
    expected = torch.nn.functional.linear(x, ops[0].weight, ops[1].bias if bias else None) + residual
    assert_close(y, expected)
    assert y.data_ptr() == buf.data_ptr()
    y.backward(torch.ones_like(y))
    assert_close(buf.grad, torch.ones_like(residual))
    assert_close(x.grad, torch.ones(*LEAD, OUT, dtype=torch.float64) @ ops[0].weight.detach())


# ---- fused ops raise what the basic ops raise ----------------------------


def test_fused_forward_errors_name_the_basic_op():
    seq = Sequential(BasicLinear(IN, OUT), Bias(OUT), GELU())
    with pytest.raises(ValueError, match="BasicLinear: expected input with last dimension in_features=7"):
        seq(torch.randn(4, IN + 1))
    add = Sequential(BasicLinear(IN, OUT), Bias(OUT), AddExtraInput())
    with pytest.raises(ValueError, match=r"AddExtraInput: extra input of shape \(4, 5\) does not broadcast"):
        add(torch.randn(4, IN), torch.randn(4, 5))
    with pytest.raises(ValueError, match="AddExtraInput: extra input dtype torch.float64 does not match"):
        add(torch.randn(4, IN), torch.randn(4, OUT, dtype=torch.float64))
    assert _op_types(add.fusers()[0].forward_ops) == [ForwardLinearBiasAdd]


# ---- FP8 ---------------------------------------------------------------------


def test_fusions_under_fp8_current_scaling_match_unfused():
    from tp_fuse.quantization import autocast
    from tp_fuse.recipe import Float8CurrentScaling

    recipe = Float8CurrentScaling()
    kinds = ["extra_out", "linear", "bias", "gelu", "add"]
    ops = _make_ops(kinds, torch.float32)
    params = [p for op in ops for p in op.parameters()]
    x = _randn((*LEAD, IN), torch.float32, 1)
    residual = _randn((*LEAD, OUT), torch.float32, 2)
    grads = [_randn((*LEAD, OUT), torch.float32, 3), _randn((*LEAD, IN), torch.float32, 4)]
    seq = Sequential(*ops)

    def under_fp8(fn):
        def run(*args):
            with autocast(recipe=recipe):
                return fn(*args)

        return run

    fused = _run(under_fp8(seq), params, [x, residual], grads)
    (fuser,) = seq.fusers()
    assert _op_types(fuser.forward_ops) == [MakeExtraOutput, ForwardLinearBiasActivation, AddExtraInput]
    assert _op_types(fuser.backward_ops) == [BackwardLinearAdd, BackwardActivationBias, AddExtraInput]
    with autocast(recipe=recipe):
        exp = fuser.explain()
    assert any(r.reason.startswith("FP8: residual grad added after") for r in exp.fused), str(exp)
    # Current scaling quantizes the same tensors to the same FP8 values in both runs,
    # so fused and unfused differ only in where the bias/residual adds round.
    unfused = _run(under_fp8(_unfused(ops)), params, [x, residual], grads)
    for got, base in zip(fused, unfused):
        for g, b in zip(got, base):
            assert_close(g, b)
    # And FP8 did happen: the high-precision result differs.
    hp = _run(_unfused(ops), params, [x, residual], grads)
    assert not torch.allclose(fused[0][0], hp[0][0], rtol=1e-5, atol=1e-5)
