"""In-place ops on the fuser's outputs: after every basic op and every single-process fusion.

Regression for issue 10.1: ``BasicLinear`` returned ``y2d.reshape(...)``, a view created
inside the fuser's autograd Function, so ``relu_()`` after a converted linear (or
Megatron's in-place cross-entropy on logits) raised ``... is a view and is being modified
inplace``. Every case checks that ``out.mul_(c).add_(1)`` on each output gives the same
outputs and gradients as the out-of-place ``out * c + 1``, and that the caller's input is
not modified. The overlap fusions are covered in ``tests/test_wrap_models.py`` (2 ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tp_fuse as te
from tolerances import assert_close
from tp_fuse.ops.basic import (
    GELU,
    AddExtraInput,
    AllGather,
    AllReduce,
    BasicLinear,
    Bias,
    ConstantScale,
    Dropout,
    Identity,
    LayerNorm,
    MakeExtraOutput,
    Quantize,
    ReduceScatter,
    Reshape,
    ReLU,
    RMSNorm,
    ScaledSwiGLU,
    SwiGLU,
)
from tp_fuse.ops.fused import (
    BackwardActivationBias,
    BackwardAddRMSNorm,
    BackwardLinearAdd,
    BackwardLinearScale,
    ForwardLinearBiasActivation,
    ForwardLinearBiasAdd,
    ForwardNormQuantizeLinear,
)
from tp_fuse.ops.sequential import Sequential
from tp_fuse.recipe import DelayedScaling

H = 8
LEAD = (4, 3)

# name -> (ops factory, extra input shapes, expected fused forward/backward op types or None)
CASES: dict[str, tuple[Callable[[], list], list[tuple[int, ...]], object, object]] = {
    "BasicLinear": (lambda: [BasicLinear(H, H)], [], None, None),
    "Bias": (lambda: [Bias(H)], [], None, None),
    "LayerNorm": (lambda: [LayerNorm(H)], [], None, None),
    "RMSNorm": (lambda: [RMSNorm(H)], [], None, None),
    "GELU": (lambda: [GELU()], [], None, None),
    "ReLU": (lambda: [ReLU()], [], None, None),
    "SwiGLU": (lambda: [BasicLinear(H, 2 * H), SwiGLU()], [], None, None),
    "ConstantScale": (lambda: [ConstantScale(0.5)], [], None, None),
    "Dropout(p=0)": (lambda: [Dropout(0.0)], [], None, None),
    "Identity": (lambda: [Identity()], [], None, None),
    "Reshape": (lambda: [Reshape((LEAD[0], LEAD[1] * H)), Reshape((*LEAD, H))], [], None, None),
    "AddExtraInput": (lambda: [AddExtraInput()], [(*LEAD, H)], None, None),
    "MakeExtraOutput": (lambda: [MakeExtraOutput()], [], None, None),
    "AllGather(tp=1)": (lambda: [AllGather()], [], None, None),
    "ReduceScatter(tp=1)": (lambda: [ReduceScatter()], [], None, None),
    "AllReduce(tp=1)": (lambda: [AllReduce()], [], None, None),
    # High precision: Bias+GELU's backward stays basic (fused only under FP8, as in TE).
    "ForwardLinearBiasActivation": (
        lambda: [BasicLinear(H, H), Bias(H), GELU()], [],
        [ForwardLinearBiasActivation], [BasicLinear, Bias, GELU]),
    "BackwardLinearScale": (
        lambda: [BasicLinear(H, H), ConstantScale(-1.5)], [], None, [BackwardLinearScale]),
    "BackwardAddRMSNorm": (
        lambda: [MakeExtraOutput(), RMSNorm(H)], [], None, [BackwardAddRMSNorm]),
    "ScaledSwiGLU": (lambda: [BasicLinear(H, 2 * H), ScaledSwiGLU()], [LEAD], None, None),
    "ForwardLinearBiasAdd": (
        lambda: [BasicLinear(H, H), Bias(H), AddExtraInput()], [(*LEAD, H)],
        [ForwardLinearBiasAdd], None),
    "BackwardLinearAdd": (
        lambda: [MakeExtraOutput(), BasicLinear(H, H), Bias(H)], [],
        None, [BackwardLinearAdd, Bias]),
}
FP8_CASES = {
    "ForwardLinearBiasActivation+BackwardActivationBias (FP8)": (
        lambda: [BasicLinear(H, H), Bias(H), GELU()], [],
        [ForwardLinearBiasActivation], [BasicLinear, BackwardActivationBias]),
    "ForwardNormQuantizeLinear (FP8)": (lambda: [LayerNorm(H), BasicLinear(H, H)], [],
                                        [ForwardNormQuantizeLinear], None),
    "Quantize+BasicLinear (FP8)": (lambda: [Quantize(), BasicLinear(H, H)], [], None, None),
}


def _run(make: Callable[[], list], extra_shapes, in_place: bool, fp8: bool):
    torch.manual_seed(0)
    seq = Sequential(*make())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*LEAD, H, generator=gen, dtype=torch.float64).float().requires_grad_()
    extras = [torch.randn(s, generator=gen).requires_grad_() for s in extra_shapes]
    x_before = x.detach().clone()
    with te.autocast(recipe=DelayedScaling()) if fp8 else torch.autocast("cpu", enabled=False):
        outs = seq(x, *extras)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for k, o in enumerate(outs):
        if in_place:
            o.mul_(1.5 + k).add_(1.0)
        else:
            outs[k] = o * (1.5 + k) + 1.0
    grads = [torch.randn(o.shape, generator=gen) for o in outs]
    torch.autograd.backward(outs, grads)
    assert torch.equal(x.detach(), x_before), "an in-place op on an output changed the caller's input"
    params = [p.grad for p in seq.parameters()]
    return seq, [o.detach() for o in outs], [x.grad, *[e.grad for e in extras], *params]


@pytest.mark.parametrize("name", [*CASES, *FP8_CASES])
def test_in_place_after_op(name: str) -> None:
    fp8 = name in FP8_CASES
    make, extra_shapes, fwd, bwd = {**CASES, **FP8_CASES}[name]
    seq, outs_ref, grads_ref = _run(make, extra_shapes, in_place=False, fp8=fp8)
    seq_ip, outs, grads = _run(make, extra_shapes, in_place=True, fp8=fp8)
    for a, b in zip(outs, outs_ref):
        assert_close(a, b)
    assert len(grads) == len(grads_ref)
    for a, b in zip(grads, grads_ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close(a, b)
    (fuser,) = seq_ip.fusers()
    if fwd is not None:
        assert [type(op) for op, _ in fuser.forward_ops] == fwd, fuser.explain()
    if bwd is not None:
        assert [type(op) for op, _ in fuser.backward_ops] == bwd, fuser.explain()


def test_output_is_not_a_view_and_needs_no_copy() -> None:
    """The fix costs no copy for a linear: the output shares the GEMM result's storage."""
    seq = Sequential(BasicLinear(H, H))
    y = seq(torch.randn(*LEAD, H, requires_grad=True))
    assert not y._is_view()
    assert y.is_contiguous() and y.shape == (*LEAD, H)
