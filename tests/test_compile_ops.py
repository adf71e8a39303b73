"""The pieces ``torch.compile`` uses to see through the fuser, one by one.

* ``torch.library.opcheck`` of the custom op ``tp_fuse::fp8_cast``
  (fake implementation == real one on shape, dtype and strides; schema; autograd
  registration; AOT dispatch with dynamic shapes) -- ``fp8_cast`` under delayed and current
  scaling, its gradient role from inside a backward pass (where delayed scaling queues its
  amax reduction);
* the recipe mirror (``compile_state``) and the ``OpQuantizers`` handles;
* traced groups vs the eager fuser: channels and output copies, and groups the traced path
  does not take (they run eagerly behind a graph break, with the same results).

Compiles use ``backend="aot_eager"`` (the graph dynamo and AOTAutograd produce, run by aten):
this file checks what is traced, not inductor's code generation (``test_compile_layer.py``).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo

import tp_fuse
from tp_fuse import ops
from tp_fuse.quantization.compile_ref import NO_REF, CompileRef
from tp_fuse.quantization.compile_state import CompileKey, traced_key
from tp_fuse.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

import tp_fuse.ops.compiled.fp8_linear  # noqa: F401  (registers the custom ops)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK_RECIPES = ["Float8BlockScaling", "MXFP8BlockScaling", "Float8RowwiseScaling", "NVFP4BlockScaling"]
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _ok(result: dict[str, str]) -> None:
    assert result and all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_opcheck_fp8_cast_forward_roles(recipe) -> None:
    op = ops.BasicLinear(32, 8)
    name = type(recipe).__name__
    with tp_fuse.autocast(recipe=recipe):
        for role, x, transpose in (("input", torch.randn(4, 6, 32), True), ("weight", op.weight.detach(), False)):
            _ok(torch.library.opcheck(torch.ops.tp_fuse.fp8_cast.default, (x, op._quantizers.compile_ref, role, name, E4M3, transpose, NO_REF)))
            data, data_t, scale_inv = torch.ops.tp_fuse.fp8_cast(x, op._quantizers.compile_ref, role, name, E4M3, transpose, NO_REF)
            ref = op._quantizers.get(recipe)[role].quantize(x)
            assert torch.equal(data.view(torch.uint8), ref._data.view(torch.uint8))
            assert torch.equal(scale_inv, ref._sinv)
            if transpose:
                assert torch.equal(data_t.view(torch.uint8), ref.transpose_data().view(torch.uint8))


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_opcheck_fp8_cast_grad_role_inside_backward(recipe) -> None:
    """The gradient cast runs in a backward pass (delayed scaling queues its end-of-pass
    amax reduction there); its quantizers come from the op's last forward cast."""
    op = ops.BasicLinear(32, 8)
    name = type(recipe).__name__
    with tp_fuse.autocast(recipe=recipe):
        torch.ops.tp_fuse.fp8_cast(torch.randn(4, 32), op._quantizers.compile_ref, "input", name, E4M3, False, NO_REF)
    results = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            args = (g.detach(), op._quantizers.compile_ref, "grad_output", name, E5M2, True, NO_REF)
            results.append(torch.library.opcheck(torch.ops.tp_fuse.fp8_cast.default, args))
            return g

    Probe.apply(torch.randn(4, 8, requires_grad=True)).sum().backward()
    _ok(results[0])
    if isinstance(recipe, DelayedScaling):
        history = op._quantizers.quantizers["grad_output"].amax_history
        assert history[-1] == 1.0 and history[0] == 0.0  # amax of ones, reduced and rolled at the pass's end


def test_fp8_cast_outside_autocast_raises() -> None:
    op = ops.BasicLinear(32, 8)
    with pytest.raises(RuntimeError, match="traced for FP8 DelayedScaling"):
        torch.ops.tp_fuse.fp8_cast(torch.randn(4, 32), op._quantizers.compile_ref, "input", "DelayedScaling", E4M3, False, NO_REF)
    with pytest.raises(RuntimeError, match="no forward FP8 cast"):
        torch.ops.tp_fuse.fp8_cast(torch.randn(4, 8), op._quantizers.compile_ref, "grad_output", "DelayedScaling", E5M2, False, NO_REF)


def _block_cast_args(op, name: str, role: str, x: torch.Tensor, transpose: bool) -> tuple:
    layout = traced_key().layout(role)
    return (x, op._quantizers.compile_ref, role, name, *layout[:5], transpose, NO_REF)


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_opcheck_block_cast_and_gemm(name: str) -> None:
    """Fake == real (shapes, dtypes, strides) for every payload of every block format --
    FP4 data packed two per byte, E8M0 / E4M3 / fp32 block scales, NVFP4's amaxes -- and the
    op's bytes are the eager quantizer's; the GEMM of the payloads is eager's block GEMM."""
    recipe = getattr(tp_fuse.recipe, name)()
    op = ops.BasicLinear(64, 48)
    # test_schema compares inputs before/after with ops CPU has no FP8/FP4 kernels for.
    checks = ALL_CHECKS[1:]
    with tp_fuse.autocast(recipe=recipe):
        x = torch.randn(2, 16, 64)
        for role, t, transpose in (("input", x, True), ("input", x, False), ("weight", op.weight.detach(), True)):
            args = _block_cast_args(op, name, role, t, transpose)
            _ok(torch.library.opcheck(torch.ops.tp_fuse.block_cast.default, args, test_utils=checks))
        xs = torch.ops.tp_fuse.block_cast(*_block_cast_args(op, name, "input", x, True))
        ws = torch.ops.tp_fuse.block_cast(*_block_cast_args(op, name, "weight", op.weight.detach(), False))
        lx, lw = traced_key().layout("input"), traced_key().layout("weight")
    if name != "NVFP4BlockScaling":  # stochastic rounding / RHT draw: a second cast differs
        ref = op._quantizers.get(recipe)["input"].quantize(x, transpose=True)
        for got, want in zip(xs, (ref._rowwise.data, ref._rowwise.scale_inv, None,
                                  ref._columnwise.data, ref._columnwise.scale_inv, None)):
            if want is not None:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    args = (*xs[:3], *ws[:3], lx.recipe_name, [lx.block_rows, lx.block_cols], [lw.block_rows, lw.block_cols],
            lx.e4m3_max, lw.e4m3_max, torch.float32)
    _ok(torch.library.opcheck(torch.ops.tp_fuse.block_gemm.default, args, test_utils=checks))
    y = torch.ops.tp_fuse.block_gemm(*args)
    assert y.shape == (32, 48)
    from tp_fuse.quantization.block.gemm import emulated_block_gemm
    from tp_fuse.quantization.block.scaling import BlockSpec
    from tp_fuse.quantization.block.tensor import BlockPayload

    def payload(t, layout):
        amax = t[2] if layout.data_dtype == tp_fuse.recipe.FP4_DTYPE else None
        return BlockPayload(t[0], t[1], BlockSpec(layout.block_rows, layout.block_cols or None), amax, layout.e4m3_max)

    # The emulation (the CPU kernel of every format but row-wise's _scaled_mm): same fp32 sums.
    torch.testing.assert_close(y, emulated_block_gemm(payload(xs, lx), payload(ws, lw), torch.float32),
                               rtol=1e-6, atol=1e-6)


def test_autocast_mirrors_the_recipe_for_compiled_code() -> None:
    assert traced_key() is None
    with tp_fuse.autocast(recipe=DelayedScaling()):
        assert traced_key()[:3] == ("DelayedScaling", E4M3, E5M2)
        with tp_fuse.autocast(enabled=False):
            assert traced_key() is None
        with pytest.raises(KeyError):
            with tp_fuse.autocast(recipe=Float8CurrentScaling()):
                assert traced_key()[:3] == ("Float8CurrentScaling", E4M3, E5M2)
                raise KeyError
        assert traced_key()[:3] == ("DelayedScaling", E4M3, E5M2)
        with tp_fuse.autocast(recipe=Float8BlockScaling()):
            key = traced_key()
            assert not key.per_tensor and key.block_scaled and key.traced
            assert key.layout("weight")[1:3] == (128, 128) and key.layout("input")[1:3] == (1, 128)
        # A block recipe's layouts depend on its fields, not only its class: another graph.
        with tp_fuse.autocast(recipe=Float8BlockScaling(w_block_scaling_dim=1)):
            assert traced_key().layout("weight")[1:3] == (1, 128)
    assert traced_key() is None


def test_compile_refs_are_per_object_and_weak() -> None:
    op = ops.BasicLinear(4, 4)
    clone = copy.deepcopy(op)
    assert clone._quantizers.compile_ref is not op._quantizers.compile_ref
    assert clone._quantizers.compile_ref.target() is clone._quantizers
    ref = CompileRef(ops.BasicLinear(4, 4)._quantizers)
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        ref.target()


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "hp"])
def test_layers_share_one_graph(fp8: bool) -> None:
    """The quantizers are graph inputs (CompileRef), not constants, and groups without a
    comm/GEMM overlap window do not ask for the window plan (which takes the ops' ids):
    no recompile per layer (high precision recompiled per layer before)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layers = [ops.Sequential(ops.Linear(16, 16), ops.GELU()) for _ in range(3)]
    for layer in layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16, requires_grad=True)
    with tp_fuse.autocast(enabled=fp8, recipe=DelayedScaling()):
        for layer in layers:
            x = layer(x)
    x.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    if not fp8:
        return
    for layer in layers:  # each layer's own quantizers ran (and joined the reductions)
        history = layer[0].basic_op_list[0]._quantizers.quantizers["grad_output"].amax_history
        assert history[-1] > 0 and history[0] == 0


def _compiled_equals_eager(model: torch.nn.Module, *inputs: torch.Tensor, recipe=None, breaks: int = 0) -> None:
    """Forward + backward of a compiled copy equal eager's; ``breaks`` graph breaks."""
    torch._dynamo.reset()
    twin = copy.deepcopy(model)
    ctx = (lambda: tp_fuse.autocast(recipe=recipe)) if recipe is not None else torch.enable_grad
    with ctx():
        # On a third copy: running it updates delayed-scaling state.
        explanation = torch._dynamo.explain(copy.deepcopy(model))(*[t.detach() for t in inputs])
    assert explanation.graph_break_count == breaks, explanation.break_reasons
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=breaks == 0)
    outs = []
    for fn in (model, compiled):
        torch.manual_seed(0)  # NVFP4's stochastic rounding draws its seeds from the default generator
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        with ctx():
            y = fn(*xs)
        ys = list(y) if isinstance(y, tuple) else [y]
        sum((t.float() ** 2).sum() for t in ys).backward()
        outs.append((ys, [x.grad for x in xs], [p.grad for p in fn.parameters()]))
    (ya, ga, pa), (yb, gb, pb) = outs
    for a, b in zip([*ya, *ga, *pa], [*yb, *gb, *pb]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_channels_and_extra_outputs_trace() -> None:
    body = ops.Sequential(
        ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=True),
        ops.RMSNorm(16), ops.Linear(16, 32), ops.SwiGLU(), ops.Linear(16, 16),
        ops.AddExtraInput().set_extra_input_channel(0, "r"), ops.MakeExtraOutput(),
    )
    _compiled_equals_eager(body, torch.randn(3, 16))
    twin = torch.compile(copy.deepcopy(body), backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 16)
    y, residual, extra = twin(x)
    assert residual is not x and extra is not y  # independent tensors, as the eager fuser returns


class _Around(torch.nn.Module):
    """Tensor ops before and after ``inner``: a graph on each side of a graph break."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x * 1.5))


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["fp32", "delayed"])
def test_groups_without_a_traced_path_run_eagerly(recipe) -> None:
    """A Quantize op has no traced forward: its group is a graph break, results unchanged."""
    model = _Around(ops.Sequential(ops.LayerNorm(16), ops.Quantize(), ops.Linear(16, 16)))
    _compiled_equals_eager(model, torch.randn(4, 16), recipe=recipe, breaks=1)


@pytest.mark.parametrize("name", BLOCK_RECIPES)
def test_block_recipes_trace(name: str) -> None:
    """Block-scaled recipes: one graph (tp_fuse::block_cast / block_gemm), eager's numbers."""
    model = _Around(ops.Sequential(ops.Linear(32, 32), ops.GELU()))
    _compiled_equals_eager(model, torch.randn(32, 32), recipe=getattr(tp_fuse.recipe, name)())


def test_explain_says_what_compile_does_with_each_group() -> None:
    model = ops.Sequential(ops.LayerNorm(16), ops.Linear(16, 16), ops.GELU())
    assert "compile:  traced into the caller's graph" in str(ops.explain(model))
    with tp_fuse.autocast(recipe=DelayedScaling()):
        assert "compile:  traced into the caller's graph" in str(ops.explain(model))
    with tp_fuse.autocast(recipe=Float8BlockScaling()):
        assert "compile:  traced into the caller's graph" in str(ops.explain(model))


def test_compiled_forward_is_a_method_of_the_op_class() -> None:
    """An op traces by its own class's ``compiled_forward``; a subclass that may change the
    math (without one of its own) runs through the eager fuser, as before the methods."""
    from tp_fuse.ops.compiled.basic import unsupported_reason

    class ShiftedGELU(ops.GELU):
        def _activation_forward(self, x):
            y, saved = super()._activation_forward(x)
            return y + 1, saved

    assert unsupported_reason(ops.GELU(), None) is None
    assert unsupported_reason(ops.SiLU(), None) is None and unsupported_reason(ops.GEGLU(), None) is None
    assert unsupported_reason(ShiftedGELU(), None) == "ShiftedGELU has no traced forward"
    assert "cache_quantized_input" in unsupported_reason(ops.GELU(cache_quantized_input=True), None)
    assert unsupported_reason(ops.Reshape((-1,)), None) == "Reshape has no traced forward"
