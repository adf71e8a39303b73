"""Already-quantized tensors handed to block / NVFP4 ops (Transformer Engine's
``test_is_quantized`` paths), TE's tensor class names (``NVFP4Tensor``, ``MXFP8Tensor``,
``Float8BlockwiseQTensor``) and private dtype attributes (``_fp8_dtype`` / ``_fp4_dtype``),
and block tensors read under ``torch.inference_mode``."""

from __future__ import annotations

import pytest
import torch

import tp_fuse
from tolerances import NVFP4_REL_NORM
from tp_fuse import ops
from tp_fuse.quantization import (
    BlockScaledTensor,
    DType,
    Float8BlockwiseQTensor,
    Float8Tensor,
    MXFP8Tensor,
    NVFP4Quantizer,
    NVFP4Tensor,
    QuantizedTensor,
    make_quantizer,
)
from tp_fuse.quantization.te_dtype import te_dtype_of
from tp_fuse.recipe import Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling, NVFP4BlockScaling

BLOCK_RECIPES = {
    "nvfp4": (NVFP4BlockScaling, NVFP4Tensor),
    "mxfp8": (MXFP8BlockScaling, MXFP8Tensor),
    "blockwise": (Float8BlockScaling, Float8BlockwiseQTensor),
}


def _gen(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.double()).norm() / ref.double().norm())


# ------------------------------------------------------------------ TE class names / dtypes


@pytest.mark.parametrize("name", sorted(BLOCK_RECIPES))
def test_quantizers_produce_te_tensor_classes(name):
    recipe_cls, te_cls = BLOCK_RECIPES[name]
    x = _gen(0, 32, 64).float()
    q = make_quantizer(recipe_cls(), "input").quantize(x, transpose=True)
    assert type(q) is te_cls and isinstance(q, BlockScaledTensor) and isinstance(q, QuantizedTensor)
    # Derived tensors keep the class (views, detach, the 2-D transpose, row-wise only).
    for derived in (q.detach(), q.view(2, 16, 64), q.transpose_fp8(), q.rowwise_only()):
        assert type(derived) is te_cls
    if name == "nvfp4":
        assert q._fp4_dtype is DType.kFloat4E2M1 and not hasattr(q, "_fp8_dtype")
    else:
        assert q._fp8_dtype is DType.kFloat8E4M3 and not hasattr(q, "_fp4_dtype")
    # The row-wise recipe has no TE class: plain BlockScaledTensor.
    r = make_quantizer(Float8RowwiseScaling(), "input").quantize(x)
    assert type(r) is BlockScaledTensor


def test_te_constructed_nvfp4_quantizer_and_exports():
    y = NVFP4Quantizer(rowwise=True, columnwise=False)(_gen(1, 16, 32).float())
    assert isinstance(y, NVFP4Tensor)
    for cls in ("NVFP4Tensor", "MXFP8Tensor", "Float8BlockwiseQTensor"):
        assert getattr(tp_fuse, cls) is getattr(tp_fuse.quantization, cls)


def test_float8_tensor_fp8_dtype():
    q = make_quantizer(Float8CurrentScaling(), "grad_output")
    assert q.quantize(_gen(2, 8, 16).float())._fp8_dtype is DType.kFloat8E5M2
    assert make_quantizer(Float8CurrentScaling(), "input").quantize(_gen(2, 8, 16).float())._fp8_dtype is DType.kFloat8E4M3
    with pytest.raises(ValueError, match="no Transformer Engine DType"):
        te_dtype_of(torch.complex64)


# ------------------------------------------------------------------ quantize_or_pass


@pytest.mark.parametrize("name", sorted(BLOCK_RECIPES))
def test_quantize_or_pass_uses_a_block_tensor_with_the_needed_copies(name):
    recipe = BLOCK_RECIPES[name][0](**({"disable_rht": True} if name == "nvfp4" else {}))
    q = make_quantizer(recipe, "input")  # no stochastic rounding: re-quantizing is deterministic
    x = _gen(3, 32, 64).float()
    both = q.quantize(x, transpose=True)
    out, fresh = q.quantize_or_pass(both, transpose=True)
    assert out is both and not fresh
    rowwise = both.rowwise_only()
    out, fresh = q.quantize_or_pass(rowwise, transpose=False)
    assert out is rowwise and not fresh
    # Missing the column-wise copy the wgrad GEMM reads: quantized again from the value.
    out, fresh = q.quantize_or_pass(rowwise, transpose=True)
    assert fresh and out._columnwise is not None and type(out) is type(both)
    expected = q.quantize(rowwise.dequantize(), transpose=True)
    assert torch.equal(out._columnwise.data.view(torch.uint8), expected._columnwise.data.view(torch.uint8))


def test_quantize_or_pass_requantizes_other_formats():
    x = _gen(4, 32, 64).float()
    nv = make_quantizer(NVFP4BlockScaling(disable_rht=True), "grad_output")
    mx = make_quantizer(MXFP8BlockScaling(), "grad_output")
    per_tensor = make_quantizer(Float8CurrentScaling(), "grad_output")
    for src, q, cls in ((mx.quantize(x), nv, NVFP4Tensor), (nv.quantize(x), mx, MXFP8Tensor),
                        (per_tensor.quantize(x), nv, NVFP4Tensor), (nv.quantize(x), per_tensor, Float8Tensor)):
        out, fresh = q.quantize_or_pass(src, transpose=False)
        assert fresh and type(out) is cls
        assert _rel(out.dequantize(), x) < NVFP4_REL_NORM


def test_nvfp4_with_rht_does_not_reuse_a_given_columnwise_copy():
    # The given copy does not say whether it was Hadamard-transformed; the wgrad GEMM is
    # right only when both operands' copies were.
    x = _gen(5, 32, 64).float()
    no_rht = NVFP4Quantizer(with_rht=False)(x)
    rht = make_quantizer(NVFP4BlockScaling(), "grad_output")
    assert rht.with_rht
    out, fresh = rht.quantize_or_pass(no_rht, transpose=True)
    assert fresh and out is not no_rht
    out, fresh = rht.quantize_or_pass(no_rht, transpose=False)
    assert out is no_rht and not fresh


# ------------------------------------------------------------------ ops with quantized tensors


@pytest.mark.parametrize("name", sorted(BLOCK_RECIPES))
def test_linear_backward_with_a_quantized_grad_matches_float64(name):
    # [BasicLinear, Quantize(backward)]: the linear's backward receives the gradient already
    # quantized by the Quantize op (it used to raise "input is already a BlockScaledTensor").
    recipe_cls = BLOCK_RECIPES[name][0]
    torch.manual_seed(0)
    lin = ops.BasicLinear(128, 64)
    model = ops.Sequential(lin, ops.Quantize(forward=False, backward=True))
    x = _gen(6, 32, 128).float().requires_grad_()
    dy = _gen(7, 32, 64).float()
    with tp_fuse.autocast(recipe=recipe_cls()):
        y = model(x)
    y.backward(dy)
    w64, x64, dy64 = lin.weight.detach().double(), x.detach().double(), dy.double()
    assert _rel(y, x64 @ w64.t()) < NVFP4_REL_NORM
    assert _rel(x.grad, dy64 @ w64) < NVFP4_REL_NORM
    assert _rel(lin.weight.grad, dy64.t() @ x64) < NVFP4_REL_NORM


@pytest.mark.parametrize("name", sorted(BLOCK_RECIPES))
def test_block_weight_read_under_inference_mode(name):
    # Reading an FP8 parameter (made outside inference mode) inside torch.inference_mode:
    # detach / view used to fail with "Cannot set version_counter for inference tensor".
    recipe = BLOCK_RECIPES[name][0]()
    with tp_fuse.quantized_model_init(recipe=recipe):
        lin = ops.BasicLinear(64, 32)
    assert isinstance(lin.weight, BLOCK_RECIPES[name][1])
    x = _gen(8, 16, 64).float()
    with torch.inference_mode():
        w = lin.weight.detach()
        assert type(w) is BLOCK_RECIPES[name][1]
        w64 = w.dequantize().double()
        with tp_fuse.autocast(recipe=recipe):
            y = lin(x)
    assert torch.equal(w64, lin.weight.dequantize().double())
    assert _rel(y, x.double() @ w64.t()) < NVFP4_REL_NORM
