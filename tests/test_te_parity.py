"""Regression tests for the Transformer Engine parity bugs of issue 11.

Each test names the old failure it guards against; every one failed before its fix.
"""

import pytest
import torch

import tp_fuse as te
from tp_fuse import ops
from tp_fuse.quantization import Float8Tensor, make_quantizer
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Format
from tolerances import FP8_UNIT_ROUNDOFF, assert_close, assert_fp8_matmul_close, tols

RECIPES = {
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": lambda: Float8CurrentScaling(),
}


# ---- loading weights into quantized_model_init parameters ------------------------


@pytest.mark.parametrize("load", ["copy_", "fill_", "load_state_dict"])
def test_loading_fp8_weights_rederives_scale(load):
    """Old: under delayed scaling, copy_/fill_ re-quantized with the scale fixed at
    init, so U[0,1) weights came back clipped to ~0.18 and fill_(2) to ~1."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=DelayedScaling()):
        lin = ops.BasicLinear(32, 32)  # kaiming init: |w| <= 1/sqrt(32) ~ 0.18
    w = lin.weight
    if load == "copy_":
        new = torch.rand(32, 32) * 4
        with torch.no_grad():
            w.copy_(new)
    elif load == "fill_":
        new = torch.full((32, 32), 2.0)
        with torch.no_grad():
            w.fill_(2.0)
    else:
        new = torch.randn(32, 32) * 3
        lin.load_state_dict({"weight": new}, strict=False)
    assert isinstance(lin.weight, Float8Tensor)
    assert torch.equal(w.master, new)  # the master is exact
    # The FP8 bytes are within E4M3 rounding of the new values: no clipping.
    got = w.dequantize()
    u = FP8_UNIT_ROUNDOFF["e4m3"]
    assert ((got - new).abs() <= new.abs() * u + 1e-6).all(), (got - new).abs().max()
    # The weight's quantizer scale was derived from the new amax (rounded down to a
    # power of two, see the next test).
    fp8_max = Format.HYBRID.fwd_max
    want = 2.0 ** torch.floor(torch.log2(fp8_max / new.abs().max().double()))
    assert_close(w.quantizer.scale, want.float(), torch.float32)


def test_loading_fp8_grid_values_is_exact():
    """Old: the re-derived scale was fp8_max / amax (not a power of two), so weights
    already on the E4M3 grid at scale 1 -- Transformer Engine's FP8 weights, its
    test_dtype_cast / test_linear with quantized weights -- were rounded again on load
    (up to 4.8 % off). A power-of-two scale keeps them exact."""
    from tp_fuse import DType, Float8Quantizer

    torch.manual_seed(0)
    q = Float8Quantizer(scale=torch.ones(()), amax=torch.zeros(1), fp8_dtype=DType.kFloat8E4M3)
    on_grid = q(torch.rand(32, 32)).dequantize()  # E4M3 values at scale 1, in [0, 1)
    with te.quantized_model_init(recipe=DelayedScaling()):
        lin = ops.BasicLinear(32, 32)  # init amax ~0.18: the new values would clip
    with torch.no_grad():
        lin.weight.copy_(on_grid)
    assert torch.equal(lin.weight.dequantize(), on_grid)


def test_fp8_weight_copy_then_train_step():
    """Loaded weights keep training through the master (optimizer in-place ops)."""
    with te.quantized_model_init(recipe=DelayedScaling()):
        lin = ops.BasicLinear(16, 16)
    with torch.no_grad():
        lin.weight.copy_(torch.full((16, 16), 3.0))
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    lin.weight.grad = torch.full((16, 16), -1.0)
    opt.step()
    assert torch.equal(lin.weight.master, torch.full((16, 16), 4.0))


# ---- torch.inference_mode ------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_inference_mode_then_training(name):
    """Old: Float8Tensor.detach()/views inside inference_mode raised 'Cannot set
    version_counter for inference tensor'; quantizer state created under
    inference_mode made the next training step fail (in-place update of an inference
    tensor)."""
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        fp8_weights = ops.Sequential(ops.Linear(32, 32))
    hp_weights = ops.Sequential(ops.Linear(32, 32))
    for model in (fp8_weights, hp_weights):
        with torch.inference_mode():
            w = model[0].weight
            assert w.detach().shape == w.shape
            with te.autocast(recipe=recipe):
                y_inf = model(torch.randn(32, 32))
        assert y_inf.is_inference()
        x = torch.randn(32, 32, requires_grad=True)
        with te.autocast(recipe=recipe):
            y = model(x)
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_model_built_in_inference_mode_runs_outside():
    """A module created (and loaded) under inference_mode, used afterwards with an input
    that requires grad (TE's inference-loop test): inference tensors cannot be saved
    for backward, so the fuser saves normal copies."""
    with torch.inference_mode():
        with te.quantized_model_init(recipe=DelayedScaling()):
            lin = ops.Linear(32, 32)
        for p in lin.parameters():
            p.copy_(torch.empty_like(p).uniform_())
    x = torch.randn(32, 32, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        y = lin(x)
    u = FP8_UNIT_ROUNDOFF["e4m3"]
    assert_fp8_matmul_close(y.detach(), x.detach(), lin.weight.dequantize(), u, u, bias=lin.bias.detach())
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_a_matrix_in_inference_mode(dtype):
    """Old: ``Float8Quantizer(...)(x)`` on a 2-D tensor inside ``torch.inference_mode``
    raised 'Inference tensors do not track version counter' (the FP8 transpose cache
    read ``_data._version``; TE's inference-loop test quantizes its inputs this way)."""
    from tp_fuse import DType, Float8Quantizer

    x = torch.rand(32, 16, dtype=torch.float64)
    with torch.inference_mode():
        q = Float8Quantizer(scale=torch.ones(()), amax=torch.zeros(1), fp8_dtype=DType.kFloat8E4M3)
        x8 = q(x.to(dtype))
        assert x8.is_inference()
        data_t = x8.transpose_data()
    assert torch.equal(data_t.float(), x8._fp8.float().t())
    assert_close(x8.dequantize().double(), x, "fp8_e4m3")


# ---- torch.autocast and mixed dtypes --------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("model_dtype", DTYPES)
@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_torch_autocast_is_honoured(model_dtype, autocast_dtype, fp8):
    """Old: the output dtype followed torch.autocast only by accident (aten's matmul),
    and backward crashed with 'expected m1 and m2 to have the same dtype'."""
    torch.manual_seed(0)
    seq = ops.Sequential(ops.LayerNorm(32, dtype=model_dtype), ops.Linear(32, 32, dtype=model_dtype), ops.GELU())
    x = torch.randn(32, 32, dtype=model_dtype, requires_grad=True)
    with te.autocast(enabled=fp8, recipe=Float8CurrentScaling()):
        with torch.autocast("cpu", dtype=autocast_dtype):
            y = seq(x)
    assert y.dtype == autocast_dtype
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == model_dtype
    for p in seq.parameters():
        assert p.grad is not None and p.grad.dtype == model_dtype
    # Values: the reference computes in float64 from the autocast-rounded operands.
    if not fp8:
        ln, lin = seq[0], seq[1]
        xr = x.detach().to(autocast_dtype).double()
        h = torch.nn.functional.layer_norm(xr, (32,), ln.weight.double(), ln.bias.double(), ln.eps)
        h = h.to(autocast_dtype).double()
        z = h @ lin.weight.detach().to(autocast_dtype).double().t() + lin.bias.detach().to(autocast_dtype).double()
        ref = torch.nn.functional.gelu(z.to(autocast_dtype).double(), approximate="tanh")
        assert_close(y, ref, autocast_dtype, rtol=4 * tols(autocast_dtype)["rtol"], atol=4 * tols(autocast_dtype)["atol"])


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("op_dtype", DTYPES)
def test_mixed_dtype_inputs_are_cast(in_dtype, op_dtype):
    """Old: an input whose dtype differed from the parameters raised ValueError; TE
    casts the input to the op's dtype and the input gradient back."""
    torch.manual_seed(0)
    seq = ops.Sequential(ops.Linear(16, 16, dtype=op_dtype), ops.RMSNorm(16, dtype=op_dtype), ops.Bias(16, dtype=op_dtype))
    x = torch.randn(8, 16, dtype=in_dtype, requires_grad=True)
    y = seq(x)
    assert y.dtype == op_dtype
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == in_dtype
    assert all(p.grad.dtype == op_dtype for p in seq.parameters())
    lin = seq[0]
    ref = x.detach().to(op_dtype).double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    ref = torch.nn.functional.rms_norm(ref.to(op_dtype).double(), (16,), seq[1].weight.double(), seq[1].eps)
    assert_close(y, ref, op_dtype, rtol=4 * tols(op_dtype)["rtol"], atol=4 * tols(op_dtype)["atol"])


def test_ctx_dtype_is_autocast_dtype():
    """A basic op's context carries torch.autocast's dtype (TE's ctx.dtype)."""
    seen = []

    class Probe(ops.BasicOperation):
        def op_forward(self, ctx, input_, **unused):
            seen.append(ctx.dtype)
            return input_

        def op_backward(self, ctx, grad_output):
            return grad_output, ()

    probe = Probe()
    probe(torch.randn(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe(torch.randn(2))
    assert seen == [None, torch.bfloat16]


# ---- LayerNorm weight gradient accumulation -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layernorm_param_grads_accumulate_in_fp32(dtype):
    """Old: aten's CPU native_layer_norm_backward summed dweight/dbias over rows in
    half precision: with 4096 rows, errors of the order of the sum itself."""
    torch.manual_seed(0)
    rows, hidden = 4096, 64
    x = torch.rand(rows, hidden, dtype=torch.float64).to(dtype).requires_grad_()
    dy = torch.rand(rows, hidden, dtype=torch.float64).to(dtype)
    op = ops.LayerNorm(hidden, dtype=dtype)
    with torch.no_grad():
        op.weight.copy_(torch.rand(hidden) + 0.5)
    op(x).backward(dy)
    xr = x.detach().double().requires_grad_()
    wr = op.weight.detach().double().requires_grad_()
    br = torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.layer_norm(xr, (hidden,), wr, br, op.eps).backward(dy.double())
    # One rounding of the fp32 sum to the parameter dtype.
    assert_close(op.weight.grad, wr.grad, dtype)
    assert_close(op.bias.grad, br.grad, dtype)
    assert_close(x.grad, xr.grad, dtype, atol=4 * tols(dtype)["atol"], rtol=4 * tols(dtype)["rtol"])


# ---- FP8 incoming gradients -----------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_basic_linear_backward_takes_fp8_grad(name):
    """Old: BasicLinear's FP8 backward raised 'input is already a Float8Tensor' when
    the gradient arriving from the next op was FP8."""
    torch.manual_seed(0)
    recipe = RECIPES[name]()
    lin = ops.BasicLinear(32, 32)
    x = torch.randn(32, 32, requires_grad=True)
    dy = make_quantizer(Float8CurrentScaling(), "grad_output").quantize(torch.randn(32, 32))
    with te.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    dy_hp = dy.dequantize().double()
    u = FP8_UNIT_ROUNDOFF["e4m3"]
    # dx = dy W: dy is exact FP8 (used as is), W rounded to E4M3.
    ref_dx = dy_hp @ lin.weight.detach().double()
    bound = (dy_hp.abs() @ lin.weight.detach().double().abs()) * (2 * u) + 1e-3
    assert ((x.grad.double() - ref_dx).abs() <= bound).all()


@pytest.mark.parametrize("name", list(RECIPES))
def test_quantize_backward_returns_fp8_gradient(name):
    """Old: Quantize(backward=True) handed back a dequantized (high-precision) gradient;
    TE hands back a QuantizedTensor, which a preceding BasicLinear consumes as is."""
    recipe = RECIPES[name]()
    q = ops.Quantize(forward=False, backward=True)
    x = torch.randn(16, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = q(x)
    dy = torch.randn(16, 16)
    y.backward(dy)
    assert isinstance(x.grad, Float8Tensor)
    assert x.grad.fp8_dtype == torch.float8_e5m2  # HYBRID: gradients in E5M2
    u = FP8_UNIT_ROUNDOFF["e5m2"]
    assert ((x.grad.dequantize() - dy).abs() <= dy.abs() * u + 1e-6).all()
    # Linear -> Quantize(backward) in one Sequential: the GEMMs read the FP8 gradient.
    seq = ops.Sequential(ops.BasicLinear(16, 16), ops.Quantize(forward=False, backward=True))
    x2 = torch.randn(16, 16, requires_grad=True)
    with te.autocast(recipe=recipe):
        seq(x2).backward(dy)
    assert torch.isfinite(x2.grad).all() and seq[0].weight.grad is not None


# ---- state_dict carries the FP8 state -------------------------------------------


def _train_step(model, opt, recipe, x, dy):
    opt.zero_grad()
    with te.autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    opt.step()
    return y.detach()


@pytest.mark.parametrize("quantized_weight", [False, True])
def test_state_dict_round_trip_resumes_exactly(quantized_weight):
    """Old: state_dict() had no amax histories/scales and saved FP8 weights as
    Float8Tensor objects (torch.load(weights_only=True) refused them); a model loaded
    from it diverged from the original. TE keeps that state in ``_extra_state``."""
    import io

    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=8)
    with te.quantized_model_init(enabled=quantized_weight, recipe=recipe):
        model = ops.Sequential(ops.Linear(32, 32), ops.GELU(), ops.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    for _ in range(2):
        _train_step(model, opt, recipe, torch.randn(32, 32), torch.randn(32, 32))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    xs = [torch.randn(32, 32, requires_grad=True) for _ in range(2)]
    dys = [torch.randn(32, 32) for _ in range(2)]
    ys = [_train_step(model, opt, recipe, x, dy) for x, dy in zip(xs, dys)]

    with te.quantized_model_init(enabled=quantized_weight, recipe=recipe):
        loaded = ops.Sequential(ops.Linear(32, 32), ops.GELU(), ops.Linear(32, 32))
    opt2 = torch.optim.SGD(loaded.parameters(), lr=0.25)
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # plain tensors only
    extra = [k for k in ckpt["model"] if k.endswith("_extra_state")]
    assert len(extra) == 2 and all(ckpt["model"][k].dtype == torch.uint8 for k in extra)
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())
    loaded.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    ys2 = [_train_step(loaded, opt2, recipe, x.detach().clone(), dy) for x, dy in zip(xs, dys)]
    for a, b in zip(ys, ys2):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(p.detach().double(), q.detach().double())
        if quantized_weight and isinstance(p, Float8Tensor):
            assert torch.equal(p.master, q.master) and torch.equal(p._data, q._data)
            assert torch.equal(p.quantizer.amax_history, q.quantizer.amax_history)


def test_extra_state_rejects_pickle_and_malformed_payloads():
    """The payload is parsed as JSON: a pickle (TE's format, which can run code) and
    malformed documents are refused with a ValueError naming the op."""
    import pickle

    lin = ops.BasicLinear(8, 8)

    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled!",))

    evil = torch.frombuffer(bytearray(pickle.dumps({"x": Boom()})), dtype=torch.uint8)
    with pytest.raises(ValueError, match="BasicLinear _extra_state: not UTF-8 JSON"):
        lin.set_extra_state(evil)
    bad = torch.frombuffer(bytearray(b'{"format": "other", "version": 1}'), dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected format 'tp_fuse.op_fp8_state'"):
        lin.set_extra_state(bad)
    with pytest.raises(ValueError, match="expected a 1-D uint8 tensor"):
        lin.set_extra_state({"scale": 1.0})
    deep = torch.frombuffer(bytearray(b"[" * 50_000 + b"]" * 50_000), dtype=torch.uint8)
    with pytest.raises(ValueError, match="BasicLinear _extra_state: JSON nested too deeply"):
        lin.set_extra_state(deep)  # was RecursionError
    # A history of another length is refused rather than truncated.
    recipe = DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        lin(torch.randn(8, 8))
    state = lin.get_extra_state()
    other = ops.BasicLinear(8, 8)
    with te.autocast(recipe=DelayedScaling(amax_history_len=5)):
        other(torch.randn(8, 8))
    with pytest.raises(ValueError, match="amax_history: shape \\(4,\\) in the checkpoint, \\(5,\\) here"):
        other.set_extra_state(state)
    # A fresh op rebuilds its quantizers from the stored recipe.
    fresh = ops.BasicLinear(8, 8)
    fresh.set_extra_state(state)
    q = fresh._quantizers.quantizers["input"]
    assert torch.equal(q.amax_history, lin._quantizers.quantizers["input"].amax_history)
    # Current scaling keeps no state across steps: nothing is stored.
    cur = ops.BasicLinear(8, 8)
    with te.autocast(recipe=Float8CurrentScaling()):
        cur(torch.randn(8, 8))
    assert cur.get_extra_state().numel() == 0


def test_fill_that_fits_keeps_delayed_scale():
    """An overwrite the current scale can represent leaves the scale to the end-of-step
    update (TE's delayed scaling): scales follow max(history) / 2**margin."""
    margin, size = 2, 16
    recipe = DelayedScaling(margin=margin, fp8_format=Format.HYBRID, amax_history_len=8)
    with te.quantized_model_init(recipe=recipe):
        lin = ops.BasicLinear(size, size)
    w_vals, x_vals, dy_vals = [2, 5, 3, 11], [7, 3, 5], [1, 2, 1]
    with torch.no_grad():
        lin.weight.fill_(w_vals[0])  # clips at the init scale: re-derived
    for step in range(3):
        x = torch.full((size, size), float(x_vals[step]), requires_grad=True)
        with te.autocast(recipe=recipe):
            y = lin(x)
        y.backward(torch.full((size, size), float(dy_vals[step])))
        with torch.no_grad():
            lin.weight.fill_(w_vals[step + 1])
        assert_close(y.detach(), torch.full_like(y, w_vals[step] * x_vals[step] * size).double(), "fp8_e4m3")
        qs = lin._quantizers.quantizers
        w_scale = Format.HYBRID.fwd_max / max(w_vals[: step + 1]) / 2**margin
        if w_vals[step + 1] * w_scale > Format.HYBRID.fwd_max:  # the fill clipped: re-derived
            w_scale = Format.HYBRID.fwd_max / max(w_vals[: step + 2]) / 2**margin
        assert float(lin.weight.quantizer.scale) == pytest.approx(w_scale, rel=1e-6)
        assert float(qs["input"].scale) == pytest.approx(Format.HYBRID.fwd_max / max(x_vals[: step + 1]) / 4, rel=1e-6)
        assert float(qs["grad_output"].scale) == pytest.approx(Format.HYBRID.bwd_max / max(dy_vals[: step + 1]) / 4, rel=1e-6)
