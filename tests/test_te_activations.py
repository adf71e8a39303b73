"""TE's activations (GLU family, QGELU, SReLU, SiLU, ClampedSwiGLU, SiTUGLU), the
``glu_interleave_size`` layout and ``cache_quantized_input``, against float64 math."""

import pytest
import torch
import torch.nn.functional as F

from tp_fuse import ops
from tolerances import FP8_UNIT_ROUNDOFF, assert_close


def _halves(x):
    return x.chunk(2, dim=-1)


REFERENCES = {
    "GELU": (lambda: ops.GELU(), lambda x: F.gelu(x, approximate="tanh")),
    "ReLU": (lambda: ops.ReLU(), torch.relu),
    "SiLU": (lambda: ops.SiLU(), F.silu),
    "QGELU": (lambda: ops.QGELU(), lambda x: x * torch.sigmoid(1.702 * x)),
    "SReLU": (lambda: ops.SReLU(), lambda x: torch.relu(x) ** 2),
    "GLU": (lambda: ops.GLU(), lambda x: F.glu(torch.cat(_halves(x)[::-1], -1))),  # torch gates the 2nd half
    "GEGLU": (lambda: ops.GEGLU(), lambda x: F.gelu(_halves(x)[0], approximate="tanh") * _halves(x)[1]),
    "QGEGLU": (lambda: ops.QGEGLU(), lambda x: _halves(x)[0] * torch.sigmoid(1.702 * _halves(x)[0]) * _halves(x)[1]),
    "ReGLU": (lambda: ops.ReGLU(), lambda x: torch.relu(_halves(x)[0]) * _halves(x)[1]),
    "SReGLU": (lambda: ops.SReGLU(), lambda x: torch.relu(_halves(x)[0]) ** 2 * _halves(x)[1]),
    "SwiGLU": (lambda: ops.SwiGLU(), lambda x: F.silu(_halves(x)[0]) * _halves(x)[1]),
    "ClampedSwiGLU": (
        lambda: ops.ClampedSwiGLU(limit=0.75, alpha=1.5, glu_linear_offset=0.5),
        lambda x: (lambda a, b: a * torch.sigmoid(1.5 * a) * (b + 0.5))(
            _halves(x)[0].clamp(max=0.75), _halves(x)[1].clamp(-0.75, 0.75)
        ),
    ),
    "SiTUGLU": (
        lambda: ops.SiTUGLU(beta1=0.5, beta2=0.8),
        lambda x: 0.5 * torch.tanh(_halves(x)[0] / 0.5) * torch.sigmoid(_halves(x)[0]) * 0.8 * torch.tanh(_halves(x)[1] / 0.8),
    ),
}


def _check(op, ref_fn, x, dtype, *, key=None, interleave=None):
    xr = x.detach().double().requires_grad_()
    xi = xr
    if interleave is not None:  # the reference reads gates/values from interleaved blocks
        n = x.shape[-1]
        xi = xr.reshape(*x.shape[:-1], n // (2 * interleave), 2, interleave).transpose(-3, -2).reshape(x.shape)
    y_ref = ref_fn(xi)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    xt = x.detach().to(dtype).requires_grad_()
    y = op(xt)
    y.backward(dy.to(dtype))
    assert y.dtype == dtype and xt.grad.dtype == dtype
    assert_close(y, y_ref, key or dtype)
    assert_close(xt.grad, xr.grad, key or dtype)


@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_activation_matches_reference(name, dtype):
    torch.manual_seed(0)
    make, ref = REFERENCES[name]
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    _check(make(), ref, x, dtype)


@pytest.mark.parametrize("name", ["SwiGLU", "ClampedSwiGLU", "SiTUGLU", "GEGLU"])
def test_glu_interleave_size(name):
    torch.manual_seed(1)
    make, ref = REFERENCES[name]
    op = make()
    op.glu_interleave_size = 4
    _check(op, ref, torch.randn(6, 32, dtype=torch.float64), torch.float64, interleave=4)


@pytest.mark.parametrize("name", ["GELU", "SwiGLU", "SReGLU", "SiLU"])
def test_cache_quantized_input(name):
    """The saved input is FP8 (E4M3): the gradient carries its rounding, the output none."""
    torch.manual_seed(2)
    make, ref = REFERENCES[name]
    op = type(make())(cache_quantized_input=True)
    x = torch.rand(8, 16, dtype=torch.float64) + 0.5  # away from 0: relative rounding bound
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    y_ref.backward(torch.ones_like(y_ref))
    xt = x.clone().float().requires_grad_()
    y = op(xt)
    y.backward(torch.ones_like(y))
    assert_close(y, y_ref, torch.float32)  # forward untouched
    u = FP8_UNIT_ROUNDOFF["e4m3"]
    # d/dx of these activations is smooth on [0.5, 1.5]: an input error of u|x| moves
    # the gradient by at most a few u.
    torch.testing.assert_close(xt.grad.double(), xr.grad, rtol=8 * u, atol=8 * u)
    assert not torch.equal(xt.grad.double(), xr.grad.float().double())  # FP8 rounding applied


def test_activation_argument_errors():
    with pytest.raises(ValueError, match="SiTUGLU: beta1 must be finite and positive"):
        ops.SiTUGLU(beta1=0.0)
    with pytest.raises(ValueError, match="ClampedSwiGLU: limit must be a finite float"):
        ops.ClampedSwiGLU(limit=float("inf"))
    with pytest.raises(ValueError, match="glu_interleave_size applies to gated units only"):
        ops.SiLU(glu_interleave_size=2)
    with pytest.raises(ValueError, match="SwiGLU: glu_interleave_size must be a positive int"):
        ops.SwiGLU(glu_interleave_size=0)
    with pytest.raises(ValueError, match=r"GEGLU: expected a last dimension divisible by 2 .* shape \(2, 5\)"):
        ops.GEGLU()(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"SwiGLU: expected a last dimension divisible by 8"):
        ops.SwiGLU(glu_interleave_size=4)(torch.randn(2, 12))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_l2normalization(dtype):
    torch.manual_seed(3)
    eps = 1e-3
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    x[0, 0] = 0.0  # eps matters for an all-zero row
    ref = lambda t: t * torch.rsqrt(t.square().sum(-1, keepdim=True) + eps)  # noqa: E731
    _check(ops.L2Normalization(eps=eps), ref, x, dtype)
    with pytest.raises(ValueError, match="L2Normalization: eps must be a non-negative float"):
        ops.L2Normalization(eps=-1.0)
