"""Basic ops against float64 references: outputs, input grads, param grads; errors; saved state."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from tolerances import assert_close
from tp_fuse.ops.basic import (
    GELU,
    AddExtraInput,
    Bias,
    ConstantScale,
    Dropout,
    Identity,
    LayerNorm,
    MakeExtraOutput,
    Quantize,
    ReLU,
    Reshape,
    RMSNorm,
    SwiGLU,
)
from tp_fuse.ops.op import OperationContext

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
SHAPE = (3, 5, 7)  # odd sizes everywhere


def _randomize_params(op: torch.nn.Module, seed: int = 1) -> None:
    # Non-trivial parameters: ones/zeros would hide weight/bias mix-ups.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


def _run(op: torch.nn.Module, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]):
    """Forward + backward through ``op``; returns (outputs, input grads, param grads)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    for p in op.parameters():
        p.grad = None
    outs = op(*leaves)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.backward(outs, list(grads))
    return outs, [t.grad for t in leaves], [p.grad for p in op.parameters()]


def _reference(fn: Callable, inputs, params, grads):
    """The same math in float64 through autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (*inputs, *params)]
    outs = fn(*leaves)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.backward(outs, [g.double() for g in grads])
    n = len(inputs)
    return outs, [t.grad for t in leaves[:n]], [t.grad for t in leaves[n:]]


def _check(op, ref_fn, inputs, out_shapes=None, seed=0):
    """Run ``op`` and ``ref_fn`` on the same inputs; compare every result with the tolerance table."""
    gen = torch.Generator().manual_seed(seed + 100)
    dtype = inputs[0].dtype
    if out_shapes is None:
        out_shapes = [inputs[0].shape]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64).to(inputs[0].device, dtype) for s in out_shapes]
    outs, in_grads, p_grads = _run(op, inputs, grads)
    r_outs, r_in_grads, r_p_grads = _reference(ref_fn, inputs, list(op.parameters()), grads)
    assert len(outs) == len(r_outs)
    for a, e in zip(outs, r_outs):
        assert a.dtype == dtype and a.shape == e.shape
        assert_close(a, e)
    for a, e in zip(in_grads, r_in_grads):
        assert a is not None and a.dtype == dtype and a.shape == e.shape
        assert_close(a, e)
    for p, a, e in zip(op.parameters(), p_grads, r_p_grads):
        assert a is not None and a.dtype == p.dtype and a.shape == p.shape
        assert_close(a, e)


def _randn(shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


# ---- references (float64, plain torch) ----------------------------------


def _ref_gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _ref_layer_norm(shape, eps, zero_centered):
    def fn(x, w, b):
        g = w + 1 if zero_centered else w
        return torch.nn.functional.layer_norm(x, shape, g, b, eps)

    return fn


def _ref_rms_norm(shape, eps, zero_centered):
    def fn(x, w):
        dims = tuple(range(-len(shape), 0))
        g = w + 1 if zero_centered else w
        return x * torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + eps) * g

    return fn


# ---- numerics -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias(dtype):
    op = Bias(7, dtype=dtype)
    _randomize_params(op)
    _check(op, lambda x, b: x + b, [_randn(SHAPE, dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("normalized_shape", [(7,), (5, 7)])
def test_layer_norm(dtype, zero_centered, normalized_shape):
    op = LayerNorm(normalized_shape, eps=1e-3, dtype=dtype, zero_centered_gamma=zero_centered)
    _randomize_params(op)
    x = _randn(SHAPE, dtype, scale=3.0) + 2.0  # non-zero mean: the mean subtraction matters
    _check(op, _ref_layer_norm(normalized_shape, 1e-3, zero_centered), [x])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("normalized_shape", [(7,), (5, 7)])
def test_rms_norm(dtype, zero_centered, normalized_shape):
    op = RMSNorm(normalized_shape, eps=1e-3, dtype=dtype, zero_centered_gamma=zero_centered)
    _randomize_params(op)
    _check(op, _ref_rms_norm(normalized_shape, 1e-3, zero_centered), [_randn(SHAPE, dtype, scale=2.0)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_norms_on_cuda(norm, dtype):
    # Regression (first GPU run, H200): a bf16 LayerNorm's backward handed CUDA's
    # native_layer_norm_backward fp32 parameters, which only the CPU kernel accepts.
    # Hidden 128 so that the Triton forward kernels (fp32 statistics) are the ones run.
    shape = (3, 5, 128)
    if norm == "LayerNorm":
        op, ref = LayerNorm(128, eps=1e-3, dtype=dtype, device="cuda"), _ref_layer_norm((128,), 1e-3, False)
    else:
        op, ref = RMSNorm(128, eps=1e-3, dtype=dtype, device="cuda"), _ref_rms_norm((128,), 1e-3, False)
    _randomize_params(op)
    _check(op, ref, [(_randn(shape, dtype, scale=3.0) + 2.0).cuda()])


def test_norm_initialization_follows_zero_centered_gamma():
    assert torch.equal(LayerNorm(7).weight, torch.ones(7))
    assert torch.equal(LayerNorm(7).bias, torch.zeros(7))
    assert torch.equal(LayerNorm(7, zero_centered_gamma=True).weight, torch.zeros(7))
    assert torch.equal(RMSNorm(7, zero_centered_gamma=True).weight, torch.zeros(7))
    # Freshly initialized zero-centered and plain norms compute the same function.
    x = _randn(SHAPE, torch.float32)
    torch.testing.assert_close(LayerNorm(7)(x), LayerNorm(7, zero_centered_gamma=True)(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "make_op, ref",
    [(GELU, _ref_gelu_tanh), (ReLU, torch.relu)],
    ids=["GELU", "ReLU"],
)
def test_elementwise_activation(dtype, make_op, ref):
    _check(make_op(), ref, [_randn(SHAPE, dtype, scale=2.0)])


def test_gelu_is_the_tanh_approximation():
    # The exact (erf) GELU differs from the tanh form by up to ~5e-4 here: above fp32 tolerance.
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    y = GELU()(x)
    torch.testing.assert_close(y, _ref_gelu_tanh(x), rtol=1e-12, atol=1e-12)
    assert (y - torch.nn.functional.gelu(x)).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_gates_with_first_half(dtype):
    def ref(x):
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    x = _randn((3, 5, 14), dtype, scale=2.0)
    _check(SwiGLU(), ref, [x], out_shapes=[(3, 5, 7)])
    # Swapping the halves gives a different function: the first half is the gate.
    swapped = torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1)
    assert not torch.allclose(SwiGLU()(x), SwiGLU()(swapped))


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_scale(dtype):
    op = ConstantScale(-0.375)
    assert op.scale == -0.375  # the seed's ForwardAxpy reads it
    _check(op, lambda x: -0.375 * x, [_randn(SHAPE, dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_identity(dtype):
    _check(Identity(), lambda x: x * 1, [_randn(SHAPE, dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape(dtype):
    _check(Reshape((-1, 7)), lambda x: x.reshape(-1, 7), [_randn(SHAPE, dtype)], out_shapes=[(15, 7)])
    _check(Reshape((5, 3, 7)), lambda x: x.reshape(5, 3, 7), [_randn(SHAPE, dtype)], out_shapes=[(5, 3, 7)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra_shape", [SHAPE, (5, 7), (1, 5, 1)], ids=["same", "bcast-lead", "bcast-ones"])
def test_add_extra_input(dtype, extra_shape):
    # A broadcast extra input gets dy summed over its broadcast dims.
    _check(AddExtraInput(), lambda x, e: x + e, [_randn(SHAPE, dtype), _randn(extra_shape, dtype, seed=3)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_make_extra_output(dtype):
    # Two outputs, two upstream grads: dx = dy + dextra.
    _check(MakeExtraOutput(), lambda x: (x * 1, x * 1), [_randn(SHAPE, dtype)], out_shapes=[SHAPE, SHAPE])


def test_in_place_variants_match_out_of_place():
    x = _randn(SHAPE, torch.float32)
    extra = _randn(SHAPE, torch.float32, seed=2)
    buf = extra.clone()
    y = AddExtraInput(in_place=True)(x, buf)
    torch.testing.assert_close(y, x + extra, rtol=0, atol=0)
    assert y.data_ptr() == buf.data_ptr()  # written into the extra input's storage
    torch.testing.assert_close(buf, x + extra, rtol=0, atol=0)

    dy, dextra = _randn(SHAPE, torch.float32, seed=4), _randn(SHAPE, torch.float32, seed=5)
    leaf = x.clone().requires_grad_()
    out, extra_out = MakeExtraOutput(in_place=True)(leaf)
    torch.autograd.backward([out, extra_out], [dy, dextra.clone()])
    torch.testing.assert_close(leaf.grad, dy + dextra, rtol=0, atol=0)
    # A broadcast (stride-0) gradient cannot be written in place and still works.
    leaf.grad = None
    out, extra_out = MakeExtraOutput(in_place=True)(leaf)
    (out.sum() + extra_out.sum()).backward()
    torch.testing.assert_close(leaf.grad, torch.full(SHAPE, 2.0))


# ---- dropout ---------------------------------------------------------------


def test_dropout_p0_and_eval_are_identity():
    x = _randn(SHAPE, torch.float32)
    dy = _randn(SHAPE, torch.float32, seed=1)
    for op in (Dropout(0.0), Dropout(0.7).eval()):
        (y,), (dx,), _ = _run(op, [x], [dy])
        assert torch.equal(y, x) and torch.equal(dx, dy)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_train_mask_and_rate(p):
    torch.manual_seed(1234)
    n = 40_000
    x = _randn((8, n // 8), torch.float32) + 5.0  # never zero, so zeros in y are drops
    dy = _randn((8, n // 8), torch.float32, seed=1) + 5.0
    op = Dropout(p)
    (y,), (dx,), _ = _run(op, [x], [dy])
    kept = y != 0
    scale = 1.0 / (1.0 - p)
    # Output and gradient use the same mask and the same scaling, exactly.
    assert torch.equal(dx != 0, kept)
    assert torch.equal(y, torch.where(kept, x * scale, torch.zeros(())))
    assert torch.equal(dx, torch.where(kept, dy * scale, torch.zeros(())))
    # Keep rate within 5 standard deviations of 1 - p.
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    # Seeded: same seed, same mask.
    torch.manual_seed(1234)
    assert torch.equal(op(x) != 0, kept)


def test_dropout_saves_only_a_bool_mask():
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = _randn(SHAPE, torch.bfloat16).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        Dropout(0.3)(x)
    assert [t.dtype for t in saved] == [torch.bool]


# ---- what is saved for backward ------------------------------------------


def _single_input_ops():
    return [
        Bias(7),
        LayerNorm(7),
        RMSNorm(7),
        GELU(),
        ReLU(),
        SwiGLU(),
        ConstantScale(2.0),
        Dropout(0.5),
        Identity(),
        Reshape((-1,)),
    ]


@pytest.mark.parametrize("op", _single_input_ops(), ids=lambda op: type(op).__name__)
def test_nothing_saved_without_grad(op):
    ctx = OperationContext()
    ctx.requires_grad = False
    x = _randn((3, 5, 14 if isinstance(op, SwiGLU) else 7), torch.float32)
    op.op_forward(ctx, x)
    assert ctx.to_save is None


def test_saved_tensors_are_minimal():
    def saved_by(op, x):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            op(x.detach().requires_grad_())
        return saved

    x = _randn(SHAPE, torch.bfloat16)
    assert [t.dtype for t in saved_by(ReLU(), x)] == [torch.bool]
    assert saved_by(Bias(7, dtype=torch.bfloat16), x) == []
    assert saved_by(ConstantScale(3.0), x) == []
    # LayerNorm: the input in its own dtype plus float32 per-row statistics.
    ln = saved_by(LayerNorm(7, dtype=torch.bfloat16), x)
    assert [(t.dtype, t.numel()) for t in ln] == [(torch.bfloat16, 105), (torch.float32, 15), (torch.float32, 15)]


# ---- FP8 inputs (after a Quantize op) ------------------------------------


def test_float8_input_is_dequantized():
    from tp_fuse.quantization import Float8Tensor, autocast
    from tp_fuse.recipe import Float8CurrentScaling

    x = _randn((4, 14), torch.float32)
    with autocast(recipe=Float8CurrentScaling()):
        q = Quantize()(x)
    assert isinstance(q, Float8Tensor)
    xd = q.dequantize()
    assert not torch.equal(xd, x)  # FP8 rounding happened, so the check below is meaningful
    for op in (GELU(), SwiGLU(), LayerNorm(14), RMSNorm(14), Bias(14), ConstantScale(0.5), Dropout(0.0)):
        out = op(q)
        assert type(out) is torch.Tensor, type(op).__name__
        torch.testing.assert_close(out, op(xd), rtol=0, atol=0)


# ---- user errors -----------------------------------------------------------


def test_errors_name_the_op():
    with pytest.raises(ValueError, match=r"^LayerNorm: expected last dimension 64, got input of shape \(4, 32\)$"):
        LayerNorm(64)(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"LayerNorm: expected trailing dimensions \(5, 7\), got input of shape \(3, 7, 5\)"):
        LayerNorm((5, 7))(torch.randn(3, 7, 5))
    with pytest.raises(ValueError, match=r"RMSNorm: expected last dimension 8, got input of shape \(2, 9\)"):
        RMSNorm(8)(torch.randn(2, 9))
    # A dtype differing from the parameters' is cast (Transformer Engine's semantics):
    # tests/test_te_parity.py::test_mixed_dtype_inputs_are_cast.
    with pytest.raises(ValueError, match=r"Bias: expected last dimension 8, got input of shape \(2, 7\)"):
        Bias(8)(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"SwiGLU: expected a last dimension divisible by 2 .* shape \(4, 7\)"):
        SwiGLU()(torch.randn(4, 7))
    with pytest.raises(ValueError, match="GELU: expected a floating-point input, got dtype torch.int64"):
        GELU()(torch.arange(4))
    with pytest.raises(ValueError, match=r"AddExtraInput: extra input of shape \(3, 7\) does not broadcast"):
        AddExtraInput()(torch.randn(2, 7), torch.randn(3, 7))
    with pytest.raises(ValueError, match="AddExtraInput: extra input dtype torch.float64 does not match"):
        AddExtraInput()(torch.randn(2, 7), torch.randn(2, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"AddExtraInput\(in_place=True\): extra input must have"):
        AddExtraInput(in_place=True)(torch.randn(2, 7), torch.randn(7))
    with pytest.raises(ValueError, match=r"Reshape: cannot reshape input of shape \(3, 5\) to \(4, -1\)"):
        Reshape((4, -1))(torch.randn(3, 5))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Dropout(1.5), "Dropout: p must be a probability"),
        (lambda: ConstantScale(float("nan")), "ConstantScale: scale must be a finite number"),
        (lambda: Bias(0), "Bias: size must be a positive int"),
        (lambda: LayerNorm(0), "LayerNorm: normalized_shape must hold positive ints"),
        (lambda: LayerNorm(8, eps=-1.0), "LayerNorm: eps must be a non-negative float"),
        (lambda: RMSNorm("8"), "RMSNorm: normalized_shape must be an int or a sequence of ints"),
        (lambda: RMSNorm(8, dtype=torch.int32), "RMSNorm: expected a floating-point torch.dtype"),
        (lambda: Reshape((-1, -1)), "Reshape: at most one entry of shape may be -1"),
    ],
)
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()
