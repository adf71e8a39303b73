"""The compiled FP8 Linear on the CUDA path, checked on CPU in strict-CUDA mode.

``TP_FUSE_STRICT_CUDA=1`` makes CPU tensors take the CUDA branches: the traced graph is
the one a GPU compiles. These tests record the ATen graphs AOTAutograd hands the compiler
(a custom backend) and check that

* the GEMMs are ``aten._scaled_mm`` with the bias epilogue cuBLASLt fuses (16-bit outputs),
  in K-major layouts (strict mode checks CUDA's rules while tracing);
* the casts are ATen ops (amax, scale, clamp, ``to(float8)``, the transposed copy): no
  ``tp_fuse::fp8_cast`` / ``fp8_gemm`` node; delayed scaling adds one
  ``tp_fuse::fp8_track`` per cast (joining the step's amax reduction, no tensors out);
* compiled == eager over several steps: outputs, input/parameter gradients and the
  quantizers' state (scale, last amax, counters, histories) -- eager then also runs
  ``torch._scaled_mm`` (``TP_FUSE_CPU_FP8_GEMM=scaled_mm``), so both sides compute with
  the same GEMM kernel.

GPU measurements (inductor's fused casts, speed) are pending a GPU run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import tp_fuse
from tp_fuse import ops
from tp_fuse.debug.fp8_stats import Fp8StatsCollector
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

CURRENT, DELAYED = Float8CurrentScaling(), DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def _strict_cuda(tp_settings):
    tp_settings(TP_FUSE_STRICT_CUDA="1", TP_FUSE_CPU_FP8_GEMM="scaled_mm")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Recorder:
    """A dynamo backend that keeps the forward and backward ATen graphs, then runs them."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

        def keep(gm: torch.fx.GraphModule, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def calls(self, name: str) -> list[torch.fx.Node]:
        return [n for g in self.graphs for n in g.graph.nodes if n.op == "call_function" and name in str(n.target)]


def _mlp(dtype: torch.dtype, norm: bool = True) -> ops.Sequential:
    """[LayerNorm,] Linear+bias, GELU, Linear+bias. ``norm=False`` for bit-exact bf16
    comparisons: eager's fused bf16 LayerNorm rounds differently from the traced
    ``F.layer_norm`` (to rounding, as every compiled norm), and FP8 magnifies that."""
    torch.manual_seed(0)
    body = [ops.Linear(32, 64, bias=True, dtype=dtype), ops.GELU(), ops.Linear(64, 32, bias=True, dtype=dtype)]
    return ops.Sequential(*([ops.LayerNorm(32, dtype=dtype)] if norm else []), *body)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for i, op in enumerate(m for m in model.modules() if isinstance(m, ops.BasicLinear)):
        for role, q in op._quantizers.quantizers.items():
            for name in ("scale", "last_amax", "nonfinite_amax_count", "zero_amax_count", "amax_history"):
                if hasattr(q, name):
                    out[f"{i}.{role}.{name}"] = getattr(q, name).clone()
    return out


def _steps(model: torch.nn.Module, recipe, dtype: torch.dtype, steps: int = 3):
    results = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = (torch.randn(16, 32) * (step + 1)).to(dtype).requires_grad_()
        with tp_fuse.autocast(recipe=recipe):
            y = model(x)
        (y.float() ** 2).sum().backward()
        results.append((y.detach(), x.grad, [p.grad.clone() for p in model.parameters()], _state(model)))
        for p in model.parameters():
            p.grad = None
    return results


def _assert_same(eager, compiled) -> None:
    for step, ((ya, ga, pa, sa), (yb, gb, pb, sb)) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(yb, ya, rtol=0, atol=0, msg=lambda m: f"step {step} output: {m}")
        torch.testing.assert_close(gb, ga, rtol=0, atol=0, msg=lambda m: f"step {step} dx: {m}")
        for a, b in zip(pa, pb):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"step {step} param grad: {m}")
        assert sa.keys() == sb.keys() and sa
        for k in sa:
            torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=0, msg=lambda m: f"step {step} {k}: {m}")


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED], ids=["current", "delayed"])
def test_graph_has_scaled_mm_with_bias(recipe) -> None:
    rec = Recorder()
    model = torch.compile(_mlp(torch.bfloat16), backend=rec.backend, fullgraph=True)
    _steps(model, recipe, torch.bfloat16, steps=1)
    mms = rec.calls("aten._scaled_mm")
    assert len(mms) == 6, [n.format_node() for n in mms]  # 2 Linears x (fprop, dgrad, wgrad)
    with_bias = [n for n in mms if n.kwargs.get("bias", n.args[4] if len(n.args) > 4 else None) is not None]
    assert len(with_bias) == 2, [n.format_node() for n in mms]  # the two fprops: bf16 out, bias fused
    assert not rec.calls("tp_fuse.fp8_gemm")
    casts = rec.calls("tp_fuse.fp8_cast")
    assert not casts, [n.format_node() for n in casts]
    fp8_out = [n for n in rec.calls("prims.convert_element_type") + rec.calls("aten._to_copy")
               if n.meta.get("val") is not None and n.meta["val"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert len(fp8_out) == 6, "the casts to float8 (x, W per Linear forward, dy per backward) are ATen ops"
    assert len(rec.calls("aten.amax")) + len(rec.calls("aten.linalg_vector_norm")) >= 6
    # Delayed scaling joins the step's amax reductions once per cast (Python, no tensors out).
    assert len(rec.calls("tp_fuse.fp8_track")) == (6 if isinstance(recipe, DelayedScaling) else 0)


@pytest.mark.parametrize("recipe", [CURRENT, Float8CurrentScaling(power_2_scale=True), DELAYED],
                         ids=["current", "current-pow2", "delayed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_equals_eager_over_steps(recipe, dtype) -> None:
    """Also: one graph for all steps (the state buffers are graph inputs re-read per call;
    delayed scaling's first update rebinds them to views of shared buffers)."""
    eager = _mlp(dtype, norm=dtype == torch.float32)
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True)
    counters.clear()
    _assert_same(_steps(eager, copy.deepcopy(recipe), dtype), _steps(compiled, copy.deepcopy(recipe), dtype))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_debug_observer_keeps_the_opaque_cast_and_explain_says_so() -> None:
    """``tp_fuse.debug``'s FP8 statistics read each quantized tensor in Python: with an
    observer the casts are ``tp_fuse::fp8_cast`` (the GEMMs stay ``_scaled_mm``), the
    statistics are recorded from the compiled run, and ``explain`` names the opaque op."""
    model = _mlp(torch.bfloat16, norm=False)
    tap = Fp8StatsCollector()
    tap.attach(model)
    tap.active = True
    with tp_fuse.autocast(recipe=CURRENT):
        assert "casts with the opaque tp_fuse::fp8_cast" in str(ops.explain(model))
        assert "casts as ATen ops" in str(ops.explain(_mlp(torch.bfloat16, norm=False)))
    rec = Recorder()
    _steps(torch.compile(model, backend=rec.backend, fullgraph=True), CURRENT, torch.bfloat16, steps=1)
    assert len(rec.calls("tp_fuse.fp8_cast")) == 6 and len(rec.calls("aten._scaled_mm")) == 6
    stats = tap.collect()
    assert any("/grad_output/" in k for k in stats) and any("/input/" in k for k in stats), sorted(stats)


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED], ids=["current", "delayed"])
def test_inductor_equals_eager(recipe) -> None:
    eager = _mlp(torch.bfloat16, norm=False)
    compiled = torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True)
    _assert_same(_steps(eager, copy.deepcopy(recipe), torch.bfloat16, steps=2),
                 _steps(compiled, copy.deepcopy(recipe), torch.bfloat16, steps=2))


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED], ids=["current", "delayed"])
def test_layers_compiled_before_any_eager_step_share_one_graph(recipe) -> None:
    """The graph reads each op's quantizer buffers (graph inputs): the first trace binds the
    quantizers of every op that has none yet, so the other layers' first calls pass the
    guards (one trace per layer would exceed dynamo's recompile limit in a deep model)."""
    torch.manual_seed(0)
    layers = [ops.Sequential(ops.Linear(32, 32, dtype=torch.bfloat16), ops.GELU()) for _ in range(3)]
    for layer in layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    counters.clear()
    for step in range(2):
        h = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        with tp_fuse.autocast(recipe=recipe):
            for layer in layers:
                h = layer(h)
        h.float().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    for layer in layers:  # every layer's own quantizers ran (delayed: reduced and rolled)
        q = layer[0].basic_op_list[0]._quantizers.quantizers["grad_output"]
        assert (q.amax_history[-1] if isinstance(recipe, DelayedScaling) else q.last_amax) > 0


def test_opcheck_fp8_track() -> None:
    """Fake == real for ``tp_fuse::fp8_track`` (a copy of the scale); a forward role joins the
    step's amax reduction, so the autocast exit updates the quantizer from its slot."""
    op = ops.BasicLinear(32, 32)
    with tp_fuse.autocast(recipe=DelayedScaling()):
        q = op._quantizers.get(DelayedScaling())["input"]
        q.amax_history[0] = 2.0
        args = (q.amax_history[0].clone(), q.scale, op._quantizers.compile_ref, "input", "DelayedScaling",
                torch.float8_e4m3fn)
        result = torch.library.opcheck(torch.ops.tp_fuse.fp8_track.default, args,
                                       test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        assert result and all(v == "SUCCESS" for v in result.values()), result
        out = torch.ops.tp_fuse.fp8_track(*args)
        assert torch.equal(out, q.scale) and out is not q.scale
    assert q.scale == 448.0 / 2.0 and q.amax_history[0] == 0  # reduced, updated and rolled at the exit


class _Checkpointed(torch.nn.Module):
    """``tp_fuse.checkpoint(inner, x)``: the recompute in backward runs ``inner`` again
    (compiled code for a compiled ``inner``) with the first forward's FP8 scales replayed."""

    def __init__(self, inner: torch.nn.Module, owner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.owner = inner, owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_fuse.checkpoint(self.inner, x, modules=[self.owner])


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED], ids=["current", "delayed"])
def test_activation_recompute_of_a_compiled_body_equals_eager(recipe) -> None:
    """The traced casts read the quantizer buffers at run time, so checkpoint's scale replay
    reaches the recompute; the recompute's casts fold and count as eager's do."""
    eager = _mlp(torch.bfloat16, norm=False)
    twin = copy.deepcopy(eager)
    compiled = _Checkpointed(torch.compile(twin, backend="aot_eager", fullgraph=True), twin)
    _assert_same(_steps(_Checkpointed(eager, eager), copy.deepcopy(recipe), torch.bfloat16),
                 _steps(compiled, copy.deepcopy(recipe), torch.bfloat16))
