"""Scaled activations (ScaledSwiGLU, ScaledSiTUGLU, ScaledClampedQGeGLU, ScaledSReLU):
``y = act(x) * scales[..., None]`` against float64 math written here, with gradients for
the input and the scales, both GLU layouts, and Transformer Engine's option checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tolerances import assert_close
from tp_fuse.ops.basic import ScaledClampedQGeGLU, ScaledSiTUGLU, ScaledSReLU, ScaledSwiGLU
from tp_fuse.ops.sequential import Sequential


def _deinterleave(x, k):
    if k is None:
        return x
    shape = x.shape
    return x.reshape(*shape[:-1], shape[-1] // (2 * k), 2, k).transpose(-3, -2).reshape(shape)


def _clamped(x, limit=7.0, alpha=1.702, offset=1.0):
    a, b = x.chunk(2, dim=-1)
    a, b = a.clamp(max=limit), b.clamp(-limit, limit)
    return a * torch.sigmoid(alpha * a) * (b + offset)


def _situ(x, beta1=4.0, beta2=25.0):
    a, b = x.chunk(2, dim=-1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


# (constructor, float64 math on the gates-first layout, gated)
OPS = {
    "swiglu": (ScaledSwiGLU, lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], True),
    "situglu": (ScaledSiTUGLU, _situ, True),
    "clamped_qgeglu": (ScaledClampedQGeGLU, _clamped, True),
    "srelu": (ScaledSReLU, lambda x: torch.relu(x).square(), False),
}


def _randn(shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("grads", ["both", "input", "scales"])
def test_scaled_activation_matches_float64(name, dtype, shape, grads):
    make, math, gated = OPS[name]
    # Magnitude 4: the clamps (limit 7) and soft caps are exercised.
    x = _randn(shape, dtype, 1, scale=4.0).requires_grad_(grads in ("both", "input"))
    s = _randn(shape[:-1], dtype, 2).requires_grad_(grads in ("both", "scales"))
    out_shape = (*shape[:-1], shape[-1] // 2 if gated else shape[-1])
    dy = _randn(out_shape, dtype, 3)
    y = make()(x, s)
    y.backward(dy)
    x64, s64 = x.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    y64 = math(x64) * s64.unsqueeze(-1)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == y64.shape
    assert_close(y, y64)
    if x.requires_grad:
        assert_close(x.grad, x64.grad)
    if s.requires_grad:
        assert s.grad.dtype == dtype
        assert_close(s.grad, s64.grad)


@pytest.mark.parametrize("name", ["swiglu", "situglu", "clamped_qgeglu"])
def test_interleaved_layout(name):
    make, math, _ = OPS[name]
    k = 8
    x = _randn((6, 64), torch.float32, 1, scale=4.0).requires_grad_()
    s = _randn((6,), torch.float32, 2).requires_grad_()
    dy = _randn((6, 32), torch.float32, 3)
    make(glu_interleave_size=k)(x, s).backward(dy)
    x64, s64 = x.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    y64 = math(_deinterleave(x64, k)) * s64.unsqueeze(-1)
    y64.backward(dy.double())
    assert_close(x.grad, x64.grad)
    assert_close(s.grad, s64.grad)


def test_options_follow_transformer_engine():
    for make in (ScaledSwiGLU, ScaledSiTUGLU, ScaledClampedQGeGLU):
        assert make().activation_recompute_in_mlp is False
        with pytest.raises(ValueError, match="does not support activation recomputation"):
            make(activation_recompute_in_mlp=True)
    op = ScaledSReLU(activation_recompute_in_mlp=True)
    assert op.activation_recompute_in_mlp
    with pytest.raises(RuntimeError, match="requires the fused grouped MLP path"):
        op(torch.randn(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="beta1 must be finite and positive"):
        ScaledSiTUGLU(beta1=0.0)
    op = ScaledClampedQGeGLU(limit=3.0, alpha=1.0, glu_linear_offset=0.0)
    x = _randn((4, 16), torch.float64, 1, scale=5.0)
    s = _randn((4,), torch.float64, 2)
    assert_close(op(x, s), _clamped(x, 3.0, 1.0, 0.0) * s.unsqueeze(-1))


def test_scales_shape_is_checked():
    with pytest.raises(ValueError, match=r"ScaledSwiGLU: scales must have the input's shape without its last dimension \(3, 5\), got \(3,\)"):
        ScaledSwiGLU()(torch.randn(3, 5, 8), torch.randn(3))
    # The wrapped SwiGLU checks the layout and names itself.
    with pytest.raises(ValueError, match="SwiGLU: expected a last dimension divisible by 2"):
        ScaledSwiGLU()(torch.randn(3, 7), torch.randn(3))


def test_in_a_sequential_the_scales_are_an_extra_input():
    seq = Sequential(ScaledSReLU(), ScaledSwiGLU())
    x = _randn((5, 16), torch.float64, 1).requires_grad_()
    s1, s2 = _randn((5,), torch.float64, 2), _randn((5,), torch.float64, 3)
    y = seq(x, s1, s2)
    h = torch.relu(x).square() * s1.unsqueeze(-1)
    a, b = h.chunk(2, -1)
    assert_close(y, F.silu(a) * b * s2.unsqueeze(-1))
