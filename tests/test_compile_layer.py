"""``torch.compile(fullgraph=True)`` of a ``TransformerLayer``: one graph, compiled == eager.

The fusion groups are traced as basic ops into the layer's graph (``tp_fuse/ops/compiled``);
on CPU the FP8 casts are the custom op ``tp_fuse::fp8_cast``, which runs the eager
quantizers at graph run time, and the GEMMs the traced emulation (the CUDA path:
``test_compile_fp8_cuda_path.py``). Checked here on one process, tiny shapes (each
inductor compile costs tens of seconds on 2 CPU cores):

* inductor, 3 training steps (forward, backward, SGD) under FP8 current scaling: outputs,
  input gradients and parameters match eager (within the recipe's tolerance, in practice
  ~1e-9); FP8 state: equal values up to float32 rounding -- inductor's generated
  LayerNorm/GELU differ from the eager kernels in the last bit, which moves an amax by an
  ulp; no recompilation after the first step. (On CPU a per-tensor recipe's graph is the
  same for delayed and current scaling but for the recipe name the opaque
  ``tp_fuse::fp8_cast`` nodes carry: one inductor case covers both. The layer's
  high-precision graph is this graph's LayerNorm, attention, GELU and bias ops with plain
  GEMMs: fp32 under inductor to 1e-5 is checked on the TP layer, whose graph holds the same
  ops, in ``test_compile_tp_overlap.py`` (``inductor-default``); the high-precision trace here, bf16 under ``aot_eager``.)
* ``aot_eager`` (the same graph, aten kernels): FP8 delayed state and outputs bit-identical
  to eager after 3 steps -- the recipe state is updated by the same code in the same order;
  no recompilation after the first step (delayed scaling rebinds its state buffers there);
* every recipe (fp32, delayed, current, the four block-scaled ones) traces forward and
  backward with ``fullgraph=True``: one graph, no graph break (dynamo raises on one).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import pytest
import torch
import torch._dynamo

import tp_fuse
from tp_fuse.layers import TransformerLayer
from tp_fuse.ops import BasicLinear
from tp_fuse.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from tolerances import NVFP4_REL_NORM, tols

BLOCK_RECIPES = {
    "blockwise": Float8BlockScaling, "mxfp8": MXFP8BlockScaling, "rowwise": Float8RowwiseScaling,
    "nvfp4": NVFP4BlockScaling,
}
SEQ, BATCH, HIDDEN, FFN, HEADS = 8, 2, 32, 64, 2


def _layer(dtype: torch.dtype = torch.float32) -> TransformerLayer:
    return TransformerLayer(HIDDEN, FFN, HEADS, seed=1, dtype=dtype)


def _autocast(recipe: Optional[Recipe]):
    return tp_fuse.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()


def _train(model: torch.nn.Module, recipe: Optional[Recipe], steps: int, *, start: int = 0, dtype=torch.float32):
    """Outputs and input gradients of SGD steps ``start .. start + steps - 1`` (the inputs
    depend only on the step index; plain SGD keeps no state, so runs can be split)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for step in range(start, start + steps):
        # The default generator feeds NVFP4's stochastic-rounding seeds: same draws per step.
        torch.manual_seed(1000 + step)
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype).requires_grad_()
        with _autocast(recipe):
            y = model(x)
        (y.float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        results.append((y.detach(), x.grad))
    return results


def _quantizer_pairs(eager: torch.nn.Module, compiled: torch.nn.Module):
    """(name, eager quantizer, compiled quantizer) for every GEMM role of both copies."""
    pairs = []
    for (name, a), (_, b) in zip(eager.named_modules(), compiled.named_modules()):
        if isinstance(a, BasicLinear):
            qa, qb = a._quantizers.quantizers, b._quantizers.quantizers
            assert qa.keys() == qb.keys() and qa, name
            pairs.extend((f"{name}/{role}", qa[role], qb[role]) for role in qa)
    return pairs


def _check_fp8_state(eager: torch.nn.Module, compiled: torch.nn.Module, *, exact: bool) -> None:
    for role, qa, qb in _quantizer_pairs(eager, compiled):
        if hasattr(qa, "amax_history"):  # delayed scaling
            assert torch.equal(qa.amax_history != 0, qb.amax_history != 0), role
            pairs = ((qb.amax_history, qa.amax_history), (qb.scale, qa.scale))
        else:  # current scaling: the statistics of the last cast
            pairs = ((qb.last_amax, qa.last_amax), (qb.scale, qa.scale))
        for got, want in pairs:
            if exact:
                assert torch.equal(got, want), (role, got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=role)


def test_fullgraph_inductor_matches_eager() -> None:
    recipe = Float8CurrentScaling()
    torch._dynamo.reset()
    eager = _layer()
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, fullgraph=True)
    ref = _train(eager, recipe, 3)
    got = _train(fn, recipe, 1)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got += _train(fn, recipe, 2, start=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "recompiled after the first step"
    for (y_ref, dx_ref), (y, dx) in zip(ref, got):
        torch.testing.assert_close(y, y_ref, **tols("fp8_hybrid"))
        torch.testing.assert_close(dx, dx_ref, **tols("fp8_hybrid"))
    for p_ref, p in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p, p_ref, **tols(torch.float32))
    _check_fp8_state(eager, compiled, exact=False)


def test_fp8_delayed_state_bit_identical_with_aot_eager() -> None:
    """Same graph, aten kernels (no inductor codegen): nothing may differ at all."""
    torch._dynamo.reset()
    eager = _layer()
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    recipe = DelayedScaling()
    ref = _train(eager, recipe, 3)
    got = _train(fn, recipe, 1)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got += _train(fn, recipe, 2, start=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "recompiled after the first step"
    for (y_ref, dx_ref), (y, dx) in zip(ref, got):
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    _check_fp8_state(eager, compiled, exact=True)


def test_bf16_layer_compiles_and_matches_eager() -> None:
    torch._dynamo.reset()
    eager = _layer(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    ref = _train(eager, None, 2, dtype=torch.bfloat16)
    got = _train(fn, None, 2, dtype=torch.bfloat16)
    for (y_ref, dx_ref), (y, dx) in zip(ref, got):
        assert y.dtype == dx.dtype == torch.bfloat16
        torch.testing.assert_close(y, y_ref, **tols(torch.bfloat16))
        torch.testing.assert_close(dx, dx_ref, **tols(torch.bfloat16))


def _block_tolerance_vs_float64(name: str, y: torch.Tensor, y64: torch.Tensor) -> None:
    """A block-scaled layer's output against the float64 layer: E4M3 operands (the FP8
    block recipes quantize forward tensors to E4M3), NVFP4's relative Frobenius bound."""
    if name == "nvfp4":
        rel = (y.double() - y64).norm() / y64.norm()
        assert rel < NVFP4_REL_NORM, rel
    else:
        torch.testing.assert_close(y.double(), y64, **tols("fp8_e4m3"))


@pytest.mark.parametrize("name", list(BLOCK_RECIPES))
def test_block_recipes_fullgraph_aot_eager_matches_eager(name: str) -> None:
    """Float8BlockScaling / MXFP8 / row-wise / NVFP4: ``fullgraph=True`` (tp_fuse::block_cast
    and tp_fuse::block_gemm), 3 SGD steps. The same graph run by aten kernels computes what
    eager computes bit for bit (measured: max difference 0 in outputs, input gradients and
    parameters, NVFP4's stochastic rounding included -- the casts draw their seeds in eager's
    order); the first step's output is within the recipe's tolerance of the float64 layer."""
    recipe = BLOCK_RECIPES[name]()
    torch._dynamo.reset()
    eager = _layer()
    compiled = copy.deepcopy(eager)
    reference = copy.deepcopy(eager).double()
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    ref = _train(eager, recipe, 3)
    got = _train(fn, recipe, 3)
    for (y_ref, dx_ref), (y, dx) in zip(ref, got):
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for p_ref, p in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(p, p_ref)
    (y64, _), = _train(reference, None, 1, dtype=torch.float64)
    _block_tolerance_vs_float64(name, got[0][0], y64)


def test_block_recipe_fullgraph_inductor_matches_eager() -> None:
    """MXFP8 under inductor: 3 steps within the recipe's tolerance of eager, no recompile
    (inductor's LayerNorm/GELU differ from eager's in the last bit, which can move an
    element across an FP8 rounding boundary: not bit-identical)."""
    recipe = MXFP8BlockScaling()
    torch._dynamo.reset()
    eager = _layer()
    compiled = copy.deepcopy(eager)
    fn = torch.compile(compiled, fullgraph=True)
    ref = _train(eager, recipe, 3)
    got = _train(fn, recipe, 1)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got += _train(fn, recipe, 2, start=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "recompiled after the first step"
    for (y_ref, dx_ref), (y, dx) in zip(ref, got):
        torch.testing.assert_close(y, y_ref, **tols("fp8_e4m3"))
        torch.testing.assert_close(dx, dx_ref, **tols("fp8_e4m3"))
    for p_ref, p in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p, p_ref, **tols("fp8_e4m3"))
