"""Transformer Engine's quantizer API on every format: ``make_empty`` + ``quantize_`` /
``update_quantized`` (block-scaled and NVFP4 too), ``get_scale_shape`` /
``get_columnwise_shape``, ``QuantizedTensor.update_usage``, 0-d tensors, and
``Float8Tensor``'s TE keyword constructor over uint8 bytes. References are computed in
float64 from the stored bytes and scales, or are the quantizer's own output."""

from __future__ import annotations

import math

import pytest
import torch

from tp_fuse import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from tp_fuse.quantization import BlockScaledTensor, Float8Tensor, QuantizedTensor, make_quantizer
from tp_fuse.recipe import Float8RowwiseScaling

BLOCK_QUANTIZERS = {
    "mxfp8": lambda: MXFP8Quantizer(DType.kFloat8E4M3),
    "block1d": lambda: Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
    "block2d": lambda: Float8BlockQuantizer(DType.kFloat8E5M2, rowwise=True, columnwise=True, block_scaling_dim=2),
    "rowwise": lambda: make_quantizer(Float8RowwiseScaling(power_2_scale=True), "input"),
    "nvfp4": lambda: NVFP4Quantizer(with_rht=False),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_rht=False, with_2d_quantization=True),
}


def _x(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _same(a: QuantizedTensor, b: QuantizedTensor) -> None:
    torch.testing.assert_close(a.dequantize(dtype=torch.float64), b.dequantize(dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(BLOCK_QUANTIZERS))
@pytest.mark.parametrize("shape", [(2, 32, 64), (64, 48)], ids=("3d", "2d"))
def test_block_make_empty_then_quantize_(name: str, shape: tuple[int, ...]) -> None:
    q = BLOCK_QUANTIZERS[name]()
    t = q.make_empty(shape, dtype=torch.bfloat16, device="cpu", requires_grad=True)
    assert isinstance(t, BlockScaledTensor) and t.quantizer is q
    assert (tuple(t.shape), t.dtype, t.device.type, t.requires_grad) == (shape, torch.bfloat16, "cpu", True)
    assert t._rowwise is not None and t._columnwise is not None
    buffers = [t._rowwise.data, t._rowwise.scale_inv, t._columnwise.data, t._columnwise.scale_inv]
    x = _x(0, *shape, scale=3.0)
    assert t.quantize_(x) is t
    # Same buffers (in place), same values as quantizing x directly.
    assert all(a is b for a, b in zip(buffers, [t._rowwise.data, t._rowwise.scale_inv, t._columnwise.data,
                                                   t._columnwise.scale_inv]))
    _same(t, q.quantize(x, transpose=True))
    # And the column-wise copy alone holds the same tensor (within its own rounding).
    ref = q.quantize(x, transpose=True).transpose_fp8().dequantize(dtype=torch.float64).t().reshape(shape)
    t.update_usage(rowwise_usage=False)
    assert t._rowwise is None
    torch.testing.assert_close(t.dequantize(dtype=torch.float64), ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mxfp8", "block1d", "nvfp4"])
def test_block_update_quantized_noop_and_usage(name: str) -> None:
    q = BLOCK_QUANTIZERS[name]()
    q.set_usage(rowwise=True, columnwise=False)
    t = q.make_empty((32, 64), device="cpu")
    assert t._columnwise is None
    x, y = _x(1, 32, 64), _x(2, 32, 64, scale=5.0)
    assert q.update_quantized(x, t) is t
    _same(t, q.quantize(x))
    q.update_quantized(y, t, noop_flag=torch.ones(1))  # skipped
    _same(t, q.quantize(x))
    # quantize_ with a quantized source dequantizes it first.
    t.quantize_(q(y))
    _same(t, q.quantize(q(y).dequantize()))
    with pytest.raises(ValueError, match="columnwise_usage=True, but this tensor has no columnwise copy"):
        t.update_usage(columnwise_usage=True)
    with pytest.raises(ValueError, match="at least one usage kept"):
        t.update_usage(rowwise_usage=False)
    with pytest.raises(ValueError, match="expected src of dst's shape"):
        q.update_quantized(_x(3, 16, 64), t)
    other = MXFP8Quantizer(DType.kFloat8E4M3) if name != "mxfp8" else BLOCK_QUANTIZERS["block1d"]()
    with pytest.raises(ValueError, match="dst must be a quantized tensor of this quantizer's format"):
        other.update_quantized(x, t)


def test_quantizer_call_result_keeps_quantizer_and_usage() -> None:
    q = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=False, columnwise=True, block_scaling_dim=1)
    x = _x(4, 256, 128)
    t = q(x)
    assert t.quantizer is q and t._rowwise is None and t._columnwise is not None
    t.quantize_(2 * x)  # fills the one copy it has
    _same(t, q(2 * x))


# --------------------------------------------------------------- get_scale_shape
def _expected_scale_shape(rows: int, cols: int, br: int, bc: int) -> tuple[int, int]:
    return (math.ceil(rows / br), math.ceil(cols / bc))


@pytest.mark.parametrize(
    "name,blocks",
    [("mxfp8", (1, 32)), ("block1d", (1, 128)), ("block2d", (128, 128)), ("nvfp4", (1, 16)), ("nvfp4_2d", (16, 16))],
)
@pytest.mark.parametrize("shape", [(256, 512), (250, 500), (7, 5, 3), (311,), (), (2, 3, 5, 3)])
def test_get_scale_shape_matches_the_tensors(name: str, blocks: tuple[int, int], shape: tuple[int, ...]) -> None:
    q = BLOCK_QUANTIZERS[name]()
    rows, cols = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    br, bc = blocks
    assert q.get_scale_shape(list(shape), columnwise=False) == _expected_scale_shape(rows, cols, br, bc)
    assert q.get_scale_shape(shape, columnwise=True) == _expected_scale_shape(cols, rows, br, bc)
    assert q.get_columnwise_shape(list(shape)) == ((shape[-1], *shape[:-1]) if shape else ())
    if name.startswith("nvfp4") and (rows % 16 or cols % 16):
        with pytest.raises(ValueError, match="multiple of 16"):
            q.make_empty(shape, device="cpu")
        return
    t = q.quantize(_x(5, *shape), transpose=True)
    assert tuple(t._rowwise_scale_inv.shape) == q.get_scale_shape(shape, columnwise=False)
    assert tuple(t._columnwise_scale_inv.shape) == q.get_scale_shape(shape, columnwise=True)
    e = q.make_empty(shape, device="cpu")
    assert tuple(e._rowwise_scale_inv.shape) == q.get_scale_shape(shape, columnwise=False)
    assert tuple(e._columnwise_scale_inv.shape) == q.get_scale_shape(shape, columnwise=True)


def test_get_scale_shape_int_shape_and_errors() -> None:
    q = BLOCK_QUANTIZERS["block1d"]()
    assert q.get_scale_shape(256, columnwise=False) == (1, 2)  # TE's tests pass a bare int
    with pytest.raises(ValueError, match="shape must not have negative sizes"):
        q.get_scale_shape((-1, 4), columnwise=False)
    with pytest.raises(ValueError, match="shape must be an int or an iterable of ints"):
        q.get_scale_shape(None, columnwise=False)
    with pytest.raises(ValueError, match="dtype must be a high-precision float dtype"):
        q.make_empty((4, 4), dtype=torch.int32, device="cpu")


# ------------------------------------------------------------------------- 0-d
@pytest.mark.parametrize("name", ["delayed", "current", "mxfp8", "block1d", "block2d", "rowwise"])
def test_zero_dim_tensors(name: str) -> None:
    if name == "delayed":
        q = Float8Quantizer(scale=torch.full((1,), 4.0), amax=torch.zeros(1), fp8_dtype=DType.kFloat8E4M3)
    elif name == "current":
        q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", force_pow_2_scales=True)
    else:
        q = BLOCK_QUANTIZERS[name]()
    x = torch.tensor(-0.75, dtype=torch.float64)  # exact in E4M3 and E5M2 at any power-of-two scale
    t = q.quantize(x.float())
    assert tuple(t.shape) == () and t.dtype == torch.float32
    torch.testing.assert_close(t.dequantize(dtype=torch.float64), x, rtol=0, atol=0)
    e = q.make_empty((), device="cpu")
    assert tuple(e.shape) == ()
    e.quantize_(torch.tensor(3.0))
    torch.testing.assert_close(e.dequantize(dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64),
                               rtol=0, atol=0)
    if name == "delayed":
        assert float(q.amax) == 3.0  # the cast folded max |x| of both tensors


def test_zero_dim_nvfp4_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Quantizer(with_rht=False)(torch.tensor(1.0))


# ------------------------------------------------------- Float8Tensor(TE keywords)
@pytest.mark.parametrize("fp8_dtype", [DType.kFloat8E4M3, DType.kFloat8E5M2])
@pytest.mark.parametrize("dims", [[], [1], [311], [7, 11], [2, 3, 5, 3]])
def test_float8_tensor_te_constructor_over_uint8(fp8_dtype: DType, dims: list[int]) -> None:
    bytes_ = torch.randint(0, 256, dims, dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    bytes_[(bytes_ & 0x7F) >= (0x7F if fp8_dtype is DType.kFloat8E4M3 else 0x7C)] = 0x11  # no NaN/inf codes
    t = Float8Tensor(shape=dims, dtype=torch.bfloat16, data=bytes_, fp8_dtype=fp8_dtype,
                     fp8_scale_inv=torch.full([1], 0.375))
    assert list(t.size()) == dims and t.dtype == torch.bfloat16 and t._fp8_dtype is fp8_dtype
    # A view over the caller's bytes (TE's _data is that uint8 tensor itself).
    assert t._data.data_ptr() == bytes_.data_ptr() and torch.equal(t._data.view(torch.uint8), bytes_)
    ref = bytes_.view(fp8_dtype.torch_dtype).to(torch.float64) * 0.375
    torch.testing.assert_close(t.dequantize(dtype=torch.float64), ref, rtol=0, atol=0)


def test_float8_tensor_te_constructor_transpose_and_errors() -> None:
    x = _x(7, 6, 8)
    ref = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3)(x)
    data_u8 = ref._data.view(torch.uint8)
    t = Float8Tensor(shape=(6, 8), data=data_u8, fp8_dtype=DType.kFloat8E4M3, fp8_scale_inv=torch.ones(1),
                     data_transpose=data_u8.t().contiguous())
    assert t.dtype == torch.float32  # TE's default nominal dtype
    assert torch.equal(t.transpose_data().view(torch.uint8), data_u8.t())
    with pytest.raises(ValueError, match="need fp8_dtype"):
        Float8Tensor(data=data_u8, fp8_scale_inv=torch.ones(1))
    with pytest.raises(ValueError, match="shape: expected the data's shape"):
        Float8Tensor(shape=(8, 6), data=data_u8, fp8_dtype=DType.kFloat8E4M3, fp8_scale_inv=torch.ones(1))
    with pytest.raises(ValueError, match="does not match fp8_dtype"):
        Float8Tensor(data=ref._fp8, fp8_dtype=DType.kFloat8E5M2, fp8_scale_inv=torch.ones(1))
    with pytest.raises(ValueError, match="data_transpose: expected"):
        Float8Tensor(data=data_u8, fp8_dtype=DType.kFloat8E4M3, fp8_scale_inv=torch.ones(1), data_transpose=data_u8)
    with pytest.raises(ValueError, match="got both"):
        Float8Tensor(ref._fp8, torch.ones(()), fp8_scale_inv=torch.ones(1))


def test_float8_tensor_update_usage() -> None:
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", columnwise=False)
    t = q(_x(8, 16, 32))
    assert t._transpose_cache is None
    t.update_usage(columnwise_usage=True)
    assert t._transpose_cache is not None and torch.equal(t._transpose_cache[1], t._fp8.t())
    t.update_usage(rowwise_usage=False, columnwise_usage=False)
    assert t._transpose_cache is None and t._data is not None


@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_dequantize_is_straight_through_for_every_format(name: str) -> None:
    # One autograd function (quantized_tensor._Dequantize) serves every format.
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu") if name == "current" else BLOCK_QUANTIZERS[name]()
    x = _x(9, 32, 64).to(torch.bfloat16).requires_grad_()
    t = q(x)
    assert t.requires_grad
    y = t.dequantize(dtype=torch.float64)
    g = _x(10, 32, 64).to(torch.float64)
    y.backward(g)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, g.to(torch.bfloat16), rtol=0, atol=0)
