"""Transformer Engine's quantizer API points: ``Quantizer.copy()``, ``Quantizer.make_empty``
and ``QuantizedTensor.quantize_`` (per-tensor FP8), ``copy()`` of the block quantizers,
each with TE's semantics (shallow copies; empty tensors that remember their quantizer;
in-place re-quantization with the tensor's quantizer, ``noop_flag`` skipping it)."""

from __future__ import annotations

import pytest
import torch

from tp_fuse import DType, Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer
from tp_fuse.quantization import Float8Tensor


def _x(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _delayed() -> Float8Quantizer:
    return Float8Quantizer(scale=torch.full((1,), 2.0), amax=torch.zeros(1), fp8_dtype=DType.kFloat8E4M3,
                           columnwise=False)


def test_float8_quantizer_copy_is_shallow() -> None:
    q = _delayed()
    c = q.copy()
    assert c is not q and c.scale is q.scale and c.amax is q.amax
    assert (c.fp8_dtype, c.rowwise_usage, c.columnwise_usage) == (q.fp8_dtype, True, False)
    x = _x(0, 8, 16)
    assert torch.equal(c(x)._data.view(torch.uint8), q(x)._data.view(torch.uint8))
    q.scale.fill_(4.0)  # the copy sees writes to the shared scale
    assert torch.equal(c(x)._scale_inv, torch.tensor([0.25]))  # TE's [1] scale


def test_current_scaling_quantizer_copy_keeps_settings() -> None:
    q = Float8CurrentScalingQuantizer(DType.kFloat8E5M2, "cpu", force_pow_2_scales=True, amax_epsilon=1e-3,
                                      columnwise=False)
    c = q.copy()
    assert c is not q
    assert (c.fp8_dtype, c.force_pow_2_scales, c.amax_epsilon, c.with_amax_reduction) == (
        torch.float8_e5m2, True, 1e-3, False)
    assert (c.rowwise_usage, c.columnwise_usage) == (True, False)
    x = _x(1, 8, 16, scale=3.0)
    a, b = q(x), c(x)
    assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8)) and torch.equal(a._scale_inv, b._scale_inv)


@pytest.mark.parametrize("make", [
    lambda: MXFP8Quantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False),
    lambda: Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, amax_epsilon=1e-6,
                                 force_pow_2_scales=False, block_scaling_dim=1),
], ids=("mxfp8", "block1d"))
def test_block_quantizer_copy_keeps_settings(make) -> None:
    q = make()
    c = q.copy()
    assert type(c) is type(q) and c is not q
    for name in ("fp8_dtype", "rowwise_usage", "columnwise_usage", "spec", "rule", "role"):
        assert getattr(c, name) == getattr(q, name), name
    x = _x(2, 128, 128)
    torch.testing.assert_close(c(x).dequantize(), q(x).dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ("delayed", "current"))
def test_make_empty_then_quantize_(kind: str) -> None:
    q = _delayed() if kind == "delayed" else Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    t = q.make_empty((4, 32), dtype=torch.bfloat16, device="cpu", requires_grad=True)
    assert isinstance(t, Float8Tensor) and t.quantizer is q
    assert (tuple(t.shape), t.dtype, t.fp8_dtype, t.device.type, t.requires_grad) == (
        (4, 32), torch.bfloat16, torch.float8_e4m3fn, "cpu", True)
    x = _x(3, 4, 32).to(torch.bfloat16)
    out = t.quantize_(x)
    assert out is t
    ref = q.copy()(x) if kind == "current" else _delayed()(x)
    torch.testing.assert_close(t.dequantize(), ref.dequantize(), rtol=0, atol=0)


def test_quantize_updates_in_place_with_the_tensors_quantizer() -> None:
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    t = q(_x(4, 8, 16))
    data, scale_inv = t._fp8, t._sinv
    y = _x(5, 8, 16, scale=10.0)  # a larger amax: current scaling derives a new scale
    assert t.quantize_(y) is t
    assert t._fp8 is data and t._sinv is scale_inv  # same buffers, new contents
    torch.testing.assert_close(t.dequantize(), q.copy()(y).dequantize(), rtol=0, atol=0)
    # A quantized source is dequantized first.
    z = _delayed()(_x(6, 8, 16))
    t.quantize_(z)
    torch.testing.assert_close(t.dequantize(), q.copy()(z.dequantize()).dequantize(), rtol=0, atol=0)


def test_quantize_noop_flag_and_errors() -> None:
    q = _delayed()
    t = q(_x(7, 8, 16))
    before = t.dequantize().clone()
    t.quantize_(_x(8, 8, 16), noop_flag=torch.ones(1))
    torch.testing.assert_close(t.dequantize(), before, rtol=0, atol=0)
    t.quantize_(_x(8, 8, 16), noop_flag=torch.zeros(1))
    assert not torch.equal(t.dequantize(), before)
    with pytest.raises(ValueError, match="expected a tensor of shape"):
        t.quantize_(_x(9, 4, 16))
    bare = Float8Tensor.from_parts(t._fp8.clone(), torch.ones(()), torch.float32)
    with pytest.raises(ValueError, match="has no quantizer"):
        bare.quantize_(_x(9, 8, 16))
    with pytest.raises(ValueError, match="shape must not have negative"):
        q.make_empty((-1, 4), device="cpu")


def test_float8_tensor_private_attributes_have_te_types() -> None:
    """TE's ``_data`` (uint8 bytes), ``_scale_inv`` (``[1]`` fp32) and ``_transpose`` (uint8,
    ``[shape[-1], *shape[:-1]]``), as TE's own tests read them (``test_quantized_tensor.py``:
    ``assert_close(x_fp8._data, ref.view(torch.uint8))``; 384 of its cases failed when
    ``_data`` had the FP8 dtype and ``_scale_inv`` was 0-d). Views: writes reach the tensor."""
    q = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    x = _x(7, 2, 3, 16)
    t = q(x)  # columnwise usage by default: the transpose is cached at cast time
    assert t._data.dtype == torch.uint8 and t._data.shape == (2, 3, 16)
    assert torch.equal(t._data, t._fp8.view(torch.uint8)) and t._data.data_ptr() == t._fp8.data_ptr()
    assert t._scale_inv.shape == (1,) and t._scale_inv.dtype == torch.float32
    assert t._transpose.dtype == torch.uint8 and t._transpose.shape == (16, 2, 3)
    assert torch.equal(t._transpose, t._data.reshape(6, 16).t().reshape(16, 2, 3))
    before = t.dequantize()
    t._scale_inv.mul_(2.0)  # through the view
    torch.testing.assert_close(t.dequantize(), before * 2, rtol=0, atol=0)
    t._data.zero_()  # a write through _data makes the cached transpose stale
    assert t._transpose is None and not t.dequantize().any()
    t._data = torch.full((2, 3, 16), 0x38, dtype=torch.uint8)  # e4m3 0x38 = 1.0
    torch.testing.assert_close(t.dequantize(), torch.full((2, 3, 16), 2.0 * float(t._sinv) / 2.0 * 1.0), rtol=0, atol=0)
    with pytest.raises(ValueError, match="_scale_inv: expected a one-element fp32 tensor"):
        t._scale_inv = torch.ones(2)
    # Fewer than 2 dims: TE's transpose of [n] is [n], of a scalar a scalar.
    assert q(_x(8, 5))._transpose.shape == (5,) and q(torch.tensor(3.0))._transpose.shape == ()
    q.set_usage(rowwise=True, columnwise=False)
    assert q(x)._transpose is None


def test_block_tensor_missing_copy_attributes_are_none() -> None:
    """TE: after ``update_usage(rowwise_usage=False)`` ``_rowwise_data`` is None (an
    AttributeError before)."""
    t = MXFP8Quantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True)(_x(9, 64, 64))
    t.update_usage(rowwise_usage=False, columnwise_usage=True)
    assert t._rowwise_data is None and t._rowwise_scale_inv is None and t._columnwise_data is not None
    with pytest.raises(AttributeError):
        t._no_such_attribute
