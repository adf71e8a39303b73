"""Transformer Engine's block-quantizer names (MXFP8Quantizer, Float8BlockQuantizer):
the recipes' quantization, built from TE's constructor arguments."""

from __future__ import annotations

import pytest
import torch

import tp_fuse as te
from tp_fuse.quantization.block.quantizer import BlockScalingQuantizer
from tp_fuse.recipe import Float8BlockScaling, MXFP8BlockScaling


def _same(a, b) -> None:
    for which in ("rowwise", "columnwise"):
        pa, pb = a.payload(which), b.payload(which)
        assert pa.spec == pb.spec
        assert torch.equal(pa.data.view(torch.uint8), pb.data.view(torch.uint8))
        assert torch.equal(pa.scale_inv.float(), pb.scale_inv.float())


def test_mxfp8_quantizer_equals_the_recipe_quantizer():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 3
    got = te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E4M3)(x)
    want = BlockScalingQuantizer(MXFP8BlockScaling(), "input").quantize(x, transpose=True)
    assert isinstance(got, te.MXFP8Tensor) and got._fp8_dtype == te.DType.kFloat8E4M3
    _same(got, want)
    e5 = te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E5M2)(x)
    assert e5.payload("rowwise").data.dtype == torch.float8_e5m2


@pytest.mark.parametrize("dim,role", [(1, "input"), (2, "weight")])
def test_float8_block_quantizer_equals_the_recipe_quantizer(dim, role):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    q = te.Float8BlockQuantizer(fp8_dtype=te.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)
    got = q(x)
    want = BlockScalingQuantizer(Float8BlockScaling(), role).quantize(x, transpose=True)
    assert isinstance(got, te.Float8BlockwiseQTensor)
    _same(got, want)


def test_usage_and_arguments():
    x = torch.randn(32, 64)
    q = te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E4M3, rowwise=False, columnwise=True)
    t = q(x)
    assert t._rowwise is None and t._columnwise is not None
    q.set_usage(rowwise=True, columnwise=False)
    t = q(x)
    assert t._rowwise is not None and t._columnwise is None
    q.set_usage(rowwise=False)
    with pytest.raises(ValueError, match="neither rowwise nor columnwise"):
        q(x)
    with pytest.raises(ValueError, match="block_scaling_dim"):
        te.Float8BlockQuantizer(fp8_dtype=te.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=3)
    with pytest.raises(ValueError, match="fp8_dtype"):
        te.MXFP8Quantizer(fp8_dtype=torch.float32)
    # The power-of-two rule and epsilon come from the arguments.
    raw = te.Float8BlockQuantizer(fp8_dtype=te.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                  force_pow_2_scales=False, block_scaling_dim=1)(x * 3)
    s = raw.payload("rowwise").scale_inv
    assert not torch.equal(torch.exp2(torch.floor(torch.log2(s))), s)


def test_an_op_uses_a_tensor_from_the_te_quantizer_as_is():
    torch.manual_seed(0)
    lin = te.ops.BasicLinear(64, 32, dtype=torch.float64)
    x = torch.randn(16, 64, dtype=torch.float64)
    x8 = te.MXFP8Quantizer(fp8_dtype=te.DType.kFloat8E4M3)(x)
    with te.autocast(recipe=MXFP8BlockScaling()):
        y = lin(x8)
    w8 = BlockScalingQuantizer(MXFP8BlockScaling(), "weight").quantize(lin.weight.detach())
    ref = x8.dequantize().double() @ w8.dequantize().double().t()
    torch.testing.assert_close(y, ref.to(y.dtype), rtol=1e-6, atol=1e-6)
