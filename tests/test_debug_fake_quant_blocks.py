"""FakeQuant with the block formats (MXFP8, blockwise 1x128/128x128, row-wise): the values
equal the block quantizers' dequantized copies, the GEMMs run on them, and a training run
with a debug config YAML works."""

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
from tp_fuse.quantization.block.scaling import BlockSpec, ScaleRule, dequantize_blocks, quantize_blocks
from tp_fuse.quantization.op_quantizers import make_quantizer
from tp_fuse.recipe import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling

# E4M3 block formats and the recipe whose quantizers they must reproduce.
FORMATS = {
    "MXFP8E4M3": MXFP8BlockScaling(),
    "FP8E4M3_BLOCKWISE": Float8BlockScaling(),
    "FP8E4M3_ROWWISE": Float8RowwiseScaling(),
}
ROLE = {"activation": "input", "weight": "weight", "gradient": "grad_output"}
# (gemm, tensor) -> whether that GEMM reads the column-wise copy.
OPERANDS = {("fprop", "activation"): False, ("fprop", "weight"): False, ("dgrad", "weight"): True,
            ("dgrad", "gradient"): False, ("wgrad", "gradient"): True, ("wgrad", "activation"): True}


def _tensor(seed: int, rows: int = 256, cols: int = 192) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes vary along both dims: 1x128 blocks of x and of x.T get different scales.
    return torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, cols) * torch.logspace(1, -1, rows)[:, None]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("gemm,tensor_name", list(OPERANDS))
def test_fake_quant_equals_the_block_quantizers_dequantized_copy(fmt, gemm, tensor_name):
    x = _tensor(1)
    feature = FakeQuant(StatsBuffer())
    got = feature.modify_tensor({"quant_format": fmt}, "l", gemm, tensor_name, x, None, 0)
    t = make_quantizer(FORMATS[fmt], ROLE[tensor_name]).quantize(x, transpose=True)
    ref = t._columnwise.dequantize().t() if OPERANDS[(gemm, tensor_name)] else t._rowwise.dequantize()
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, ref)
    assert not torch.equal(got, x)
    # The other copy is different (except for the transposition-invariant 128x128 weight blocks).
    other = t._rowwise.dequantize() if OPERANDS[(gemm, tensor_name)] else t._columnwise.dequantize().t()
    assert torch.equal(got, other) == (fmt == "FP8E4M3_BLOCKWISE" and tensor_name == "weight")


@pytest.mark.parametrize("fmt,spec,rule", [
    ("MXFP8E5M2", BlockSpec(1, 32), ScaleRule("e8m0")),
    ("FP8E5M2_BLOCKWISE", BlockSpec(1, 128), ScaleRule("fp32")),
    ("FP8E5M2_ROWWISE", BlockSpec(1, None), ScaleRule("fp32")),
])
def test_e5m2_block_formats(fmt, spec, rule):
    x = _tensor(2).to(torch.bfloat16)
    got = FakeQuant(StatsBuffer()).modify_tensor({"quant_format": fmt}, "l", "fprop", "activation", x, None, 0)
    data, s = quantize_blocks(x, spec, torch.float8_e5m2, rule)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize_blocks(data, s, spec).to(torch.bfloat16))


def _section(fmt: str, gemms_struct: list) -> dict:
    return {"sec": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                    "transformer_engine": {"FakeQuant": {"enabled": True, "quant_format": fmt,
                                                         "gemms_struct": gemms_struct}}}}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fake_quantized_gemms_run_in_high_precision_on_the_block_values(fmt):
    recipe = FORMATS[fmt]
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.BasicLinear(192, 128, userbuffers_options={"comm_name": "fc1"}))
    DebugSession(_section(fmt, [{"gemm": "fprop", "tensors": ["activation", "weight"]},
                                {"gemm": "wgrad", "tensors": ["gradient", "activation"]}])).attach(model)
    x = _tensor(3).requires_grad_()
    g = _tensor(4, 256, 128)
    with te.autocast(recipe=recipe):
        y = model(x)
    (y * g).sum().backward()
    w = next(model.parameters())
    q = {r: make_quantizer(recipe, r) for r in ROLE.values()}
    xq = q["input"].quantize(x.detach(), transpose=True)
    wq = q["weight"].quantize(w.detach())
    gq = q["grad_output"].quantize(g, transpose=True)
    # fprop and wgrad: high-precision GEMMs of the block round trips (exact expressions).
    assert torch.equal(y.detach(), xq._rowwise.dequantize() @ wq._rowwise.dequantize().t())
    assert torch.equal(w.grad, gq._columnwise.dequantize() @ xq._columnwise.dequantize().t())
    # dgrad was not covered: it stays an FP8 block GEMM (it differs from the HP product).
    assert not torch.equal(x.grad, g @ w.detach())


def test_block_format_option_errors():
    def err(opts, match):
        with pytest.raises(ValueError, match=match):
            DebugSession({"s": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                                "transformer_engine": {"FakeQuant": {"enabled": True, "tensors": ["activation"],
                                                                     **opts}}}}).attach(
                te.ops.Sequential(te.ops.BasicLinear(4, 4)))

    err({"quant_format": "MXFP8E4M3", "margin": 1}, r"margin: block format MXFP8E4M3 .* FP8E4M3/FP8E5M2 only")
    err({"quant_format": "NVFP8"}, r"quant_format: expected one of .*MXFP8E4M3.*NVFP4.*got 'NVFP8'")


def test_training_run_with_block_fake_quant_debug_config(tmp_path):
    """The launcher trains with ``fp8=blockwise`` and a debug YAML that fake-quantizes the
    fprop/wgrad inputs of three layers, one per block format."""
    sections = []
    for layer, fmt in (("layers\\.0\\.fc1", "MXFP8E4M3"), ("layers\\.0\\.fc2", "FP8E4M3_BLOCKWISE"),
                       ("layers\\.1\\.qkv", "FP8E4M3_ROWWISE")):
        sections.append(
            f"fq_{fmt.lower()}:\n  enabled: true\n  layers:\n    layer_name_regex_pattern: {layer}$\n"
            "  transformer_engine:\n    FakeQuant:\n      enabled: true\n"
            f"      quant_format: {fmt}\n      gemms_struct:\n"
            "      - gemm: fprop\n        tensors: [activation, weight]\n"
            "      - gemm: wgrad\n        tensors: [gradient, activation]\n"
        )
    cfg = tmp_path / "fake_quant.yaml"
    cfg.write_text("".join(sections))
    run_dir = str(tmp_path / "run")
    train([*TINY, "data.seq_len=64", "trainer.max_steps=3", "trainer.log_interval=1", "trainer.val_interval=0",
           "logger=none", "fp8=blockwise", "fp8.stats=false", f"debug.config={cfg}"], run_dir)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
