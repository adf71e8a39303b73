"""GroupedLinear (Transformer Engine's grouped GEMM op for MoE): per-group linears over
row splits given at call time, against float64 math; under FP8 (delayed and current
scaling) bit-identical to one BasicLinear per group; scale_bias, main_grad, state dict,
quantizer numbering, the grouped MLP with ScaledSwiGLU, and the user errors."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tp_fuse as te
from tolerances import FP8_UNIT_ROUNDOFF, assert_close
from tp_fuse.ops.basic import GELU, BasicLinear, Bias, GroupedLinear, ScaledSwiGLU
from tp_fuse.ops.basic.grouped_linear import GRAD_INPUT_BUFFER_KEY, OUTPUT_BUFFER_KEY
from tp_fuse.ops.fused import BackwardActivationBias
from tp_fuse.ops.sequential import Sequential
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

G, IN, OUT = 4, 32, 16
SIZES = [16, 0, 32, 16]  # an empty group included, as Transformer Engine's tests do
M = sum(SIZES)


def _randn(shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


def _randomize_biases(op, seed=5):
    with torch.no_grad():
        for i in range(op.num_groups):
            b = getattr(op, f"bias{i}")
            if b is not None:
                b.copy_(_randn(b.shape, b.dtype, seed + i))


def _reference(op, x, sizes, dy, scales=None):
    """float64 per-group linears; returns (y, dx, dws, dbs, dscales)."""
    x64 = x.detach().double().requires_grad_()
    ws = [getattr(op, f"weight{i}").detach().double().requires_grad_() for i in range(op.num_groups)]
    bs = [None if getattr(op, f"bias{i}") is None else getattr(op, f"bias{i}").detach().double().requires_grad_() for i in range(op.num_groups)]
    s64 = None if scales is None else scales.detach().double().requires_grad_()
    ys, start = [], 0
    for i, m in enumerate(sizes):
        y = x64[start : start + m] @ ws[i].t()
        if bs[i] is not None:
            y = y + (s64[start : start + m, None] * bs[i] if s64 is not None else bs[i])
        ys.append(y)
        start += m
    y = torch.cat(ys)
    y.backward(dy.double())
    return y, x64.grad, [w.grad for w in ws], [None if b is None else b.grad for b in bs], None if s64 is None else s64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("requires_grad", ["both", "input", "weight"])
def test_grouped_linear_matches_float64(dtype, bias, requires_grad):
    torch.manual_seed(0)
    op = GroupedLinear(G, IN, OUT, bias=bias, dtype=dtype)
    _randomize_biases(op)
    for p in op.parameters():
        p.requires_grad_(requires_grad in ("both", "weight"))
    x = _randn((M, IN), dtype, 1).requires_grad_(requires_grad in ("both", "input"))
    dy = _randn((M, OUT), dtype, 2)
    y = op(x, torch.tensor(SIZES, dtype=torch.int32))
    y.backward(dy)
    y64, dx64, dws, dbs, _ = _reference(op, x, SIZES, dy)
    assert y.dtype == dtype
    assert_close(y, y64)
    if x.requires_grad:
        assert_close(x.grad, dx64)
    else:
        assert x.grad is None
    for i in range(G):
        w, b = getattr(op, f"weight{i}"), getattr(op, f"bias{i}")
        if requires_grad == "input":
            assert w.grad is None
            continue
        assert_close(w.grad, dws[i])  # zero for the empty group
        if bias:
            assert_close(b.grad, dbs[i])


def test_leading_dims_and_split_sizes_as_a_list():
    op = GroupedLinear(2, IN, OUT, dtype=torch.float64)
    x = _randn((2, 3, IN), torch.float64, 1)
    y = op(x, torch.tensor([4, 2]))
    x2 = x.reshape(6, IN)
    ref = torch.cat([x2[:4] @ op.weight0.t() + op.bias0, x2[4:] @ op.weight1.t() + op.bias1])
    assert y.shape == (2, 3, OUT)
    assert_close(y.reshape(6, OUT), ref)


@pytest.mark.parametrize("recipe", [DelayedScaling, Float8CurrentScaling], ids=["delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_equals_one_basic_linear_per_group(recipe, dtype):
    # Per-group quantizers: group i's GEMMs are exactly a BasicLinear's on its rows.
    torch.manual_seed(0)
    op = GroupedLinear(G, IN, OUT, bias=True, dtype=dtype)
    _randomize_biases(op)
    linears = [BasicLinear(IN, OUT, dtype=dtype) for _ in range(G)]
    biases = [Bias(OUT, dtype=dtype) for _ in range(G)]
    with torch.no_grad():
        for i in range(G):
            linears[i].weight.copy_(getattr(op, f"weight{i}"))
            biases[i].bias.copy_(getattr(op, f"bias{i}"))
    x = _randn((M, IN), dtype, 1)
    dy = _randn((M, OUT), dtype, 2)
    for step in range(2):  # the second step uses the delayed scales the first one set
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        for p in [*op.parameters(), *(p for m in linears + biases for p in m.parameters())]:
            p.grad = None
        with te.autocast(recipe=recipe()):
            y = op(xa, torch.tensor(SIZES))
        y.backward(dy)
        ys, start = [], 0
        with te.autocast(recipe=recipe()):
            for i, m in enumerate(SIZES):
                if m:
                    ys.append(Sequential(linears[i], biases[i])(xb[start : start + m]))
                start += m
        torch.cat(ys).backward(torch.cat([dy[s : s + m] for s, m in zip([0, 16, 16, 48], SIZES) if m]))
        assert torch.equal(y, torch.cat(ys)), step
        assert torch.equal(xa.grad, xb.grad), step
        for i, m in enumerate(SIZES):
            if m:
                assert torch.equal(getattr(op, f"weight{i}").grad, linears[i].weight.grad), (step, i)
                assert torch.equal(getattr(op, f"bias{i}").grad, biases[i].bias.grad), (step, i)
            else:
                assert not getattr(op, f"weight{i}").grad.any()
    # And within FP8 rounding of float64 math.
    y64, dx64, dws, _, _ = _reference(op, x, SIZES, dy)
    assert_close(y, y64, "fp8_hybrid")
    assert_close(xa.grad, dx64, "fp8_hybrid")


def test_quantizers_are_numbered_as_in_transformer_engine():
    op = GroupedLinear(G, IN, OUT)
    assert op.num_quantizers("forward") == 2 * G and op.num_quantizers("backward") == G
    assert op.get_quantizer("forward", 3) is None  # built at the first FP8 forward
    with te.autocast(recipe=DelayedScaling()):
        op(_randn((M, IN)), torch.tensor(SIZES))
    groups = op._quantizers.groups
    assert op.get_quantizer("forward", 2 * 2) is groups[2].quantizers["input"]
    assert op.get_quantizer("forward", 2 * 2 + 1) is groups[2].quantizers["weight"]
    assert op.get_quantizer("backward", 3) is groups[3].quantizers["grad_output"]


def test_state_dict_names_and_fp8_state_round_trip():
    op = GroupedLinear(2, IN, OUT)
    with te.autocast(recipe=DelayedScaling()):
        op(_randn((8, IN)), torch.tensor([5, 3])).sum().backward()
    sd = op.state_dict()
    assert {"weight0", "weight1", "bias0", "bias1", "_extra_state"} <= set(sd)
    fresh = GroupedLinear(2, IN, OUT)
    fresh.load_state_dict(sd)
    with te.autocast(recipe=DelayedScaling()):
        fresh(_randn((8, IN)), torch.tensor([5, 3]))
    for i in range(2):
        for role in ("input", "weight", "grad_output"):
            a, b = op._quantizers.groups[i].quantizers[role], fresh._quantizers.groups[i].quantizers[role]
            assert torch.equal(a.scale, b.scale), (i, role)


def test_quantized_model_init_weights_are_fp8():
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        op = GroupedLinear(2, IN, OUT, bias=False)
    assert all(te.quantization.is_fp8_parameter(getattr(op, f"weight{i}")) for i in range(2))
    x = _randn((8, IN), seed=1).requires_grad_()
    with te.autocast(recipe=Float8CurrentScaling()):
        y = op(x, torch.tensor([3, 5]))
    y.sum().backward()
    ref = torch.cat([x[:3].double() @ op.weight0.dequantize().double().t(), x[3:].double() @ op.weight1.dequantize().double().t()])
    assert_close(y, ref, "fp8_e4m3")
    assert op.weight0.grad is not None and op.weight0.grad.shape == (OUT, IN)


@pytest.mark.parametrize("scales_requires_grad", [False, True])
def test_scale_bias(scales_requires_grad):
    op = GroupedLinear(G, IN, OUT, bias=True, scale_bias=True, dtype=torch.float64)
    assert op.num_extra_inputs == 2
    _randomize_biases(op)
    x = _randn((M, IN), torch.float64, 1).requires_grad_()
    s = _randn((M,), torch.float64, 3).requires_grad_(scales_requires_grad)
    dy = _randn((M, OUT), torch.float64, 2)
    y = op(x, torch.tensor(SIZES), s)
    y.backward(dy)
    y64, dx64, dws, dbs, ds64 = _reference(op, x, SIZES, dy, scales=s)
    assert_close(y, y64)
    assert_close(x.grad, dx64)
    for i in range(G):
        assert_close(getattr(op, f"bias{i}").grad, dbs[i])
    if scales_requires_grad:
        assert_close(s.grad, ds64)
    # Without a bias there is nothing to scale: one extra input, as in Transformer Engine.
    assert GroupedLinear(G, IN, OUT, bias=False, scale_bias=True).num_extra_inputs == 1


def test_accumulate_into_main_grad():
    op = GroupedLinear(2, IN, OUT, bias=False, accumulate_into_main_grad=True, dtype=torch.float64)
    for i in range(2):
        getattr(op, f"weight{i}").main_grad = torch.ones(OUT, IN, dtype=torch.float64)
    x, dy = _randn((8, IN), torch.float64, 1), _randn((8, OUT), torch.float64, 2)
    op(x, torch.tensor([5, 3])).backward(dy)
    _, _, dws, _, _ = _reference(op, x, [5, 3], dy)
    for i in range(2):
        w = getattr(op, f"weight{i}")
        assert w.grad is None
        assert_close(w.main_grad - 1, dws[i])


def test_sequential_of_two_grouped_linears_takes_one_split_per_op():
    fc1, fc2 = GroupedLinear(2, IN, 48, dtype=torch.float64), GroupedLinear(2, 48, OUT, dtype=torch.float64)
    seq = Sequential(fc1, fc2)
    x = _randn((8, IN), torch.float64, 1)
    sizes = torch.tensor([6, 2])
    y = seq(x, sizes, sizes)
    assert_close(y, fc2(fc1(x, sizes), sizes))


@pytest.mark.parametrize("recipe", [None, DelayedScaling, Float8CurrentScaling], ids=["hp", "delayed", "current"])
def test_grouped_mlp_with_scaled_swiglu(recipe):
    # Transformer Engine's grouped MLP: GroupedLinear, ScaledSwiGLU(probs), GroupedLinear
    # with scale_bias (bias * probs); no fused op (TE's needs CUDA cuDNN kernels).
    torch.manual_seed(0)
    h = 16
    dtype = torch.float64 if recipe is None else torch.float32  # FP8 GEMMs write fp32
    fc1 = GroupedLinear(G, h, 2 * h, dtype=dtype)
    fc2 = GroupedLinear(G, h, h, scale_bias=True, dtype=dtype)
    _randomize_biases(fc1)
    _randomize_biases(fc2, seed=9)
    seq = Sequential(fc1, ScaledSwiGLU(), fc2)
    x = _randn((M, h), dtype, 1).requires_grad_()
    probs = _randn((M,), dtype, 2).abs().requires_grad_()
    sizes = torch.tensor(SIZES)
    with te.autocast(enabled=recipe is not None, recipe=recipe() if recipe else None):
        y = seq(x, sizes, probs, sizes, probs)
    y.sum().backward()
    fc1, fc2 = _as_float64(fc1), _as_float64(fc2)
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    ys, start = [], 0
    for i, m in enumerate(SIZES):
        xi, pi = x64[start : start + m], p64[start : start + m, None]
        a, b = (xi @ getattr(fc1, f"weight{i}").detach().t() + getattr(fc1, f"bias{i}").detach()).chunk(2, -1)
        hid = torch.nn.functional.silu(a) * b * pi
        ys.append(hid @ getattr(fc2, f"weight{i}").detach().t() + getattr(fc2, f"bias{i}").detach() * pi)
        start += m
    torch.cat(ys).sum().backward()
    if recipe is None:
        assert_close(y, torch.cat(ys))
        assert_close(x.grad, x64.grad)
        assert_close(probs.grad, p64.grad)
    else:
        # FP8 errors compound over two GEMMs: compare in norm, within the unit roundoffs of
        # the two operand formats of a gradient GEMM (E5M2 dy, E4M3 W; measured 2-9 %). Each
        # GEMM is checked elementwise above (bit-identical to a BasicLinear per group).
        bound = FP8_UNIT_ROUNDOFF["e5m2"] + FP8_UNIT_ROUNDOFF["e4m3"]
        for got, want in ((y, torch.cat(ys)), (x.grad, x64.grad), (probs.grad, p64.grad)):
            rel = ((got.double() - want).norm() / want.norm()).item()
            assert rel < bound, rel
    (fuser,) = seq.fusers()
    assert [type(op) for op, _ in fuser.forward_ops] == [GroupedLinear, ScaledSwiGLU, GroupedLinear]
    reasons = [r.reason for r in fuser.explain().rejected if r.fusion == "fuse_grouped_mlp"]
    assert len(reasons) == 2 and all("CUDA sm100 only" in r for r in reasons), reasons


def _as_float64(op):
    """A float64 copy of a GroupedLinear's parameters as a plain namespace for references."""
    copy = GroupedLinear(op.num_groups, op.in_features, op.out_features, bias=op.use_bias, dtype=torch.float64)
    with torch.no_grad():
        for a, b in zip(copy.parameters(), op.parameters()):
            a.copy_(b)
    return copy


def test_rng_state_tracker_forks_each_group_init():
    # Megatron-style model-parallel init: every group's weight is drawn inside the
    # tracker's fork(), from the tracker's stream, not the default one.
    class Tracker:
        def __init__(self):
            self.forks = 0
            self.gen_state = torch.Generator().manual_seed(123).get_state()

        @contextlib.contextmanager
        def fork(self):
            self.forks += 1
            outer = torch.get_rng_state()
            torch.set_rng_state(self.gen_state)
            try:
                yield
            finally:
                self.gen_state = torch.get_rng_state()
                torch.set_rng_state(outer)

    tracker = Tracker()
    torch.manual_seed(0)
    a = GroupedLinear(2, IN, OUT, rng_state_tracker_function=lambda: tracker)
    torch.manual_seed(1)  # a different default stream: the weights must not change
    tracker2 = Tracker()
    b = GroupedLinear(2, IN, OUT, rng_state_tracker_function=lambda: tracker2)
    assert tracker.forks == 2
    assert torch.equal(a.weight0, b.weight0) and torch.equal(a.weight1, b.weight1)
    assert not torch.equal(a.weight0, a.weight1)


def test_backward_activation_bias_after_a_grouped_linear_under_fp8():
    # GroupedLinear quantizes its incoming gradient: Transformer Engine fuses dact+dbias for it.
    seq = Sequential(GroupedLinear(2, IN, OUT, bias=False), Bias(OUT), GELU())
    x = _randn((8, IN), seed=1).requires_grad_()
    with te.autocast(recipe=Float8CurrentScaling()):
        seq(x, torch.tensor([4, 4])).sum().backward()
    (fuser,) = seq.fusers()
    assert [type(op) for op, _ in fuser.backward_ops] == [GroupedLinear, BackwardActivationBias]


def test_user_errors():
    op = GroupedLinear(2, IN, OUT)
    with pytest.raises(ValueError, match=r"GroupedLinear: expected 2 non-negative integer split sizes, got \[8\]"):
        op(torch.randn(8, IN), torch.tensor([8]))
    with pytest.raises(ValueError, match=r"GroupedLinear: split sizes \[4, 3\] sum to 7, but the input has 8 rows"):
        op(torch.randn(8, IN), torch.tensor([4, 3]))
    with pytest.raises(ValueError, match="GroupedLinear: expected input with last dimension in_features=32"):
        op(torch.randn(8, IN + 1), torch.tensor([4, 4]))
    for flag in ("single_grouped_weight", "single_grouped_bias"):
        with pytest.raises(ValueError, match=f"GroupedLinear: {flag}=True is not supported"):
            GroupedLinear(2, IN, OUT, **{flag: True})
    with pytest.raises(ValueError, match="GroupedLinear: num_groups must be a positive int, got 0"):
        GroupedLinear(0, IN, OUT)


@pytest.mark.parametrize("recipe", ["Float8BlockScaling", "MXFP8BlockScaling", "Float8RowwiseScaling"])
def test_block_recipes_equal_one_basic_linear_per_group(recipe):
    # Block-scaled recipes (block sizes 128 / 32): groups of 128 rows, K = N = 128.
    make = getattr(te.recipe, recipe)
    torch.manual_seed(0)
    op = GroupedLinear(2, 128, 128, bias=False)
    linears = [BasicLinear(128, 128) for _ in range(2)]
    with torch.no_grad():
        for i in range(2):
            linears[i].weight.copy_(getattr(op, f"weight{i}"))
    x, dy = _randn((256, 128), seed=1), _randn((256, 128), seed=2)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.autocast(recipe=make()):
        y = op(xa, torch.tensor([128, 128]))
    y.backward(dy)
    with te.autocast(recipe=make()):
        yb = torch.cat([linears[0](xb[:128]), linears[1](xb[128:])])
    yb.backward(dy)
    assert torch.equal(y, yb) and torch.equal(xa.grad, xb.grad)
    for i in range(2):
        assert torch.equal(getattr(op, f"weight{i}").grad, linears[i].weight.grad)


def test_caller_buffers_receive_the_output_and_the_input_gradient():
    """Transformer Engine's ``op_kwargs`` caller buffers: the last op's output is the
    caller's buffer (no copy) and the first op's dgrad is written into the caller's
    buffer; both bit-identical to the internally allocated run. Used to raise TypeError
    (``Sequential.forward() got an unexpected keyword argument 'op_kwargs'``)."""
    torch.manual_seed(0)
    sizes = torch.tensor([5, 0, 11])
    x = torch.randn(16, 8, dtype=torch.float64)
    dy = torch.randn(16, 4, dtype=torch.float64)

    def build():
        torch.manual_seed(1)
        return Sequential(GroupedLinear(3, 8, 12, dtype=torch.float64), GroupedLinear(3, 12, 4, dtype=torch.float64))

    ref = build()
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref, sizes, sizes)
    y_ref.backward(dy)
    model = build()
    out = torch.full((16, 4), 7.0, dtype=torch.float64)
    dgrad = torch.full((16, 8), 7.0, dtype=torch.float64)
    x_t = x.clone().requires_grad_()
    y = model(x_t, sizes, sizes, op_kwargs={model[0]: {GRAD_INPUT_BUFFER_KEY: dgrad}, model[1]: {OUTPUT_BUFFER_KEY: out}})
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, y_ref)
    y.backward(dy)
    assert torch.equal(dgrad, x_ref.grad) and torch.equal(x_t.grad, x_ref.grad)

    bad = build()
    with pytest.raises(ValueError, match=r"output_buffer: expected a contiguous tensor of shape \(16, 4\)"):
        bad(x, sizes, sizes, op_kwargs={bad[1]: {OUTPUT_BUFFER_KEY: torch.empty(17, 4, dtype=torch.float64)}})
    with pytest.raises(ValueError, match="unknown op_kwargs"):
        bad(x, sizes, sizes, op_kwargs={bad[1]: {"outptu": out}})
    with pytest.raises(ValueError, match="keys must be basic ops of this Sequential"):
        bad(x, sizes, sizes, op_kwargs={GroupedLinear(3, 8, 12): {}})
