"""FakeQuant with ``quant_format: NVFP4``: the values equal the NVFP4 quantizer's
dequantized copies (RHT undone on the wgrad operands), the covered GEMMs run in high
precision on them, and a training run with a debug config YAML works."""

from __future__ import annotations

import math
import os

import pytest
import torch

import tp_fuse as te
from tp_fuse.launch.api import train
from tp_fuse.launch.logging.metrics import read_jsonl
from test_launch_train import TINY
from tp_fuse.debug import DebugSession, StatsBuffer
from tp_fuse.debug.features import FakeQuant
from tp_fuse.quantization.nvfp4.quantizer import NVFP4Quantizer
from tp_fuse.quantization.nvfp4.scaling import rht_matrix
from tp_fuse.recipe import NVFP4BlockScaling

ROLE = {"activation": "input", "weight": "weight", "gradient": "grad_output"}
# (gemm, tensor) -> whether that GEMM reads the column-wise copy.
OPERANDS = {("fprop", "activation"): False, ("fprop", "weight"): False, ("dgrad", "weight"): True,
            ("dgrad", "gradient"): False, ("wgrad", "gradient"): True, ("wgrad", "activation"): True}


def _tensor(seed: int, rows: int = 64, cols: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes vary along both dims: blocks of x and of x.T get different scales.
    return torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, cols) * torch.logspace(1, -1, rows)[:, None]


def _fake(x: torch.Tensor, gemm: str, tensor_name: str, seed: int = 7) -> torch.Tensor:
    torch.manual_seed(seed)  # the stochastic-rounding seed is drawn from the default generator
    return FakeQuant(StatsBuffer()).modify_tensor({"quant_format": "NVFP4"}, "l", gemm, tensor_name, x, None, 0)


def _reference(x: torch.Tensor, gemm: str, tensor_name: str, seed: int = 7) -> tuple[torch.Tensor, NVFP4Quantizer]:
    """The recipe quantizer's copy that ``gemm`` reads, dequantized (RHT undone), fp32."""
    q = NVFP4Quantizer.for_role(NVFP4BlockScaling(), ROLE[tensor_name])
    torch.manual_seed(seed)
    t = q.quantize(x, transpose=True)
    if not OPERANDS[(gemm, tensor_name)]:
        return t._rowwise.dequantize(), q
    col = t._columnwise.dequantize()
    if q.with_rht:
        col = (col.double().reshape(-1, 16) @ rht_matrix().t()).reshape(col.shape).float()
    return col.t(), q


@pytest.mark.parametrize("gemm,tensor_name", list(OPERANDS))
def test_nvfp4_fake_quant_equals_the_quantizers_dequantized_copy(gemm, tensor_name):
    x = _tensor(1)
    got = _fake(x, gemm, tensor_name)
    ref, q = _reference(x, gemm, tensor_name)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, ref)
    assert not torch.equal(got, x)
    # The recipe's settings per role: 16x16 weight blocks, SR gradients, RHT on wgrad inputs.
    assert q.with_2d_quantization == (tensor_name == "weight")
    assert q.stochastic_rounding == (tensor_name == "gradient")
    assert q.with_rht == (tensor_name != "weight")
    # FP4 error, not the Hadamard-rotated values: the round trip stays near x (blocks of 16
    # with 3-bit significands: relative error per block well below 1).
    assert (got - x).norm() < 0.25 * x.norm()


def test_nvfp4_fake_quant_stochastic_rounding_follows_the_seed():
    x = _tensor(2)
    a, b = _fake(x, "dgrad", "gradient", seed=1), _fake(x, "dgrad", "gradient", seed=2)
    assert not torch.equal(a, b)
    assert torch.equal(a, _fake(x, "dgrad", "gradient", seed=1))
    # Activations round to nearest: no dependence on the seed.
    assert torch.equal(_fake(x, "fprop", "activation", seed=1), _fake(x, "fprop", "activation", seed=2))


def test_nvfp4_fake_quant_keeps_dtype_and_shape_of_3d_bf16():
    x = _tensor(3).reshape(4, 16, 48).to(torch.bfloat16)
    got = _fake(x, "wgrad", "activation")
    ref, _ = _reference(x, "wgrad", "activation")
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, ref.to(torch.bfloat16).reshape(x.shape))


def test_nvfp4_fake_quant_shape_errors_name_the_dimension():
    with pytest.raises(ValueError, match="multiple of 16"):
        _fake(torch.randn(16, 40), "fprop", "activation")
    with pytest.raises(ValueError, match="multiple of 16"):
        _fake(torch.randn(24, 32), "wgrad", "activation")  # RHT over 24 rows


def _section(gemms_struct: list) -> dict:
    return {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                    "transformer_engine": {"FakeQuant": {"enabled": True, "quant_format": "NVFP4",
                                                         "gemms_struct": gemms_struct}}}}


def test_nvfp4_fake_quantized_gemms_run_in_high_precision(monkeypatch):
    # Round to nearest everywhere so the order in which quantizers draw seeds does not matter.
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1")
    recipe = NVFP4BlockScaling()
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.BasicLinear(48, 32, userbuffers_options={"comm_name": "fc1"}))
    DebugSession(_section([{"gemm": "fprop", "tensors": ["activation", "weight"]},
                           {"gemm": "wgrad", "tensors": ["gradient", "activation"]}])).attach(model)
    x = _tensor(4).requires_grad_()
    g = _tensor(5, 64, 32)
    with te.autocast(recipe=recipe):
        y = model(x)
    (y * g).sum().backward()
    w = next(model.parameters()).detach()
    xf, _ = _reference(x.detach(), "fprop", "activation")
    wf, _ = _reference(w, "fprop", "weight")
    assert torch.equal(y.detach(), xf @ wf.t())
    gc, _ = _reference(g, "wgrad", "gradient")
    xc, _ = _reference(x.detach(), "wgrad", "activation")
    assert torch.equal(next(model.parameters()).grad, gc.t() @ xc)
    # The RHT cancels in the wgrad product: the fake-quantized GEMM is close to the FP4 one.
    dw_fp4 = (gc.t() @ xc).double()
    exact = g.double().t() @ x.detach().double()
    assert (dw_fp4 - exact).norm() < 0.2 * exact.norm()
    # dgrad was not covered: it stays an NVFP4 GEMM (it differs from the HP product).
    assert not torch.equal(x.grad, g @ w)


def test_training_run_with_nvfp4_fake_quant_debug_config(tmp_path):
    """The launcher trains (per-tensor FP8) with a debug YAML that fake-quantizes every GEMM
    input of two layers to NVFP4."""
    sections = []
    for layer in ("layers\\.0\\.fc1", "layers\\.1\\.fc2"):
        sections.append(
            f"fq_{layer[-3:]}:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: {layer}$\n"
            "  transformer_engine:\n    FakeQuant:\n      enabled: true\n"
            "      quant_format: NVFP4\n      tensors: [activation, weight, gradient]\n"
        )
    cfg = tmp_path / "fake_quant.yaml"
    cfg.write_text("".join(sections))
    run_dir = str(tmp_path / "run")
    train([*TINY, "data.seq_len=64", "trainer.max_steps=3", "trainer.log_interval=1", "trainer.val_interval=0",
           "logger=none", "fp8=current", "fp8.stats=false", f"debug.config={cfg}"], run_dir)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
