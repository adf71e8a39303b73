"""Which path block quantization takes (tp_fuse.kernels.dispatch rules), and explain's plan.

The Triton block kernels themselves are checked bit for bit against the torch path in
``test_block_kernels_interpret.py`` (under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

import tp_fuse as te
from tp_fuse import kernels
from tp_fuse.kernels import dispatch, record_kernel_paths
from tp_fuse.quantization.block.cast import quantize_layouts
from tp_fuse.quantization.block.scaling import BlockSpec, ScaleRule
from tp_fuse.recipe import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling, NVFP4BlockScaling

RECIPES = [Float8BlockScaling(), MXFP8BlockScaling(), Float8RowwiseScaling()]
IDS = ["blockwise", "mxfp8", "rowwise"]


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_block_recipes_quantize_on_the_torch_path_on_cpu_and_explain_plans_it(recipe):
    torch.manual_seed(0)
    seq = te.ops.Sequential(te.ops.Linear(128, 64), te.ops.GELU(), te.ops.Linear(64, 128))
    x = torch.randn(4, 32, 128, requires_grad=True)
    with te.autocast(recipe=recipe):
        plan = te.explain(seq)
    with record_kernel_paths() as log:
        with te.autocast(recipe=recipe):
            y = seq(x)
        y.sum().backward()
    # x and W of both linears in forward, dy of both in backward.
    assert log.backends("block_quantize") == ["torch"] * 6
    assert all("Triton kernels are for CUDA" in c.reason for c in log.calls if c.kernel == "block_quantize")
    # No per-tensor cast or per-tensor FP8 GEMM kernel under a block recipe.
    assert not {"quantize", "fp8_gemm"} & {c.kernel for c in log.calls}
    assert {p.kernel for p in plan.kernels} == {c.kernel for c in log.calls}
    planned = {(p.kernel, p.backend) for p in plan.kernels if p.kernel == "block_quantize"}
    assert planned == {("block_quantize", "torch")}
    assert "block_quantize=torch" in str(plan)


def test_nvfp4_plans_the_nvfp4_quantize_kernel_and_runs_it():
    # NVFP4 casts with its own dispatched kernel (nvfp4_quantize), never block_quantize:
    # explain claimed block_quantize after the Triton and NVFP4 branches met, then nothing
    # while the NVFP4 Triton kernel was not wired in. Plan == what ran, on torch on CPU.
    torch.manual_seed(0)
    seq = te.ops.Sequential(te.ops.Linear(128, 64), te.ops.GELU(), te.ops.Linear(64, 128))
    x = torch.randn(4, 32, 128, requires_grad=True)
    recipe = NVFP4BlockScaling()
    with te.autocast(recipe=recipe):
        plan = te.explain(seq)
    with record_kernel_paths() as log:
        with te.autocast(recipe=recipe):
            y = seq(x)
        y.sum().backward()
    ran = {c.kernel for c in log.calls}
    assert "nvfp4_quantize" in ran and "block_quantize" not in ran
    assert {p.kernel for p in plan.kernels} == ran
    assert {p.backend for p in plan.kernels} == {c.backend for c in log.calls} == {"torch"}
    assert {p.direction for p in plan.kernels if p.kernel == "nvfp4_quantize"} == {"forward", "backward"}


def test_cuda_plan_is_triton_and_float64_stays_on_torch(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "triton X"))
    cuda = torch.device("cuda")
    assert kernels.planned_backend("block_quantize", cuda, torch.bfloat16).backend == "triton"
    choice = kernels.planned_backend("block_quantize", cuda, torch.float64)
    assert choice.backend == "torch" and "float64" in choice.reason


def test_backend_errors_name_the_problem(monkeypatch):
    x = torch.randn(4, 128)
    spec, rule = BlockSpec(1, 128), ScaleRule("fp32")
    with pytest.raises(ValueError, match="backend: expected None, 'torch' or 'triton'"):
        quantize_layouts(x, spec, torch.float8_e4m3fn, rule, columnwise=False, backend="cuda")
    if dispatch.triton_status()[0] and not dispatch.triton_interpreted():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            quantize_layouts(x, spec, torch.float8_e4m3fn, rule, columnwise=False, backend="triton")
    # Shapes the Triton kernels do not take are refused when Triton is asked for, not run on torch.
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "triton X"))
    monkeypatch.setattr(dispatch, "triton_interpreted", lambda: True)
    with pytest.raises(ValueError, match="1xB or BxB blocks"):
        quantize_layouts(x, BlockSpec(2, 128), torch.float8_e4m3fn, rule, columnwise=False, backend="triton")
    with pytest.raises(ValueError, match="E8M0 scales with whole-row blocks"):
        quantize_layouts(x, BlockSpec(1, None), torch.float8_e4m3fn, ScaleRule("e8m0"), columnwise=False,
                         backend="triton")
    with pytest.raises(ValueError, match="scale rule 'nvfp4'"):
        quantize_layouts(x, spec, torch.float8_e4m3fn, ScaleRule("nvfp4"), columnwise=False, backend="triton")
    with pytest.raises(ValueError, match="float8_e4m3fn / float8_e5m2"):
        quantize_layouts(x, spec, torch.float8_e4m3fnuz, rule, columnwise=False, backend="triton")
    with pytest.raises(ValueError, match="reduce_columnwise_amax: only row-wise"):
        quantize_layouts(x, spec, torch.float8_e4m3fn, rule, columnwise=True, reduce_columnwise_amax=lambda a: a)
    with pytest.raises(ValueError, match="expected a 2-D tensor"):
        quantize_layouts(x.reshape(2, 2, 128), spec, torch.float8_e4m3fn, rule, columnwise=False)
