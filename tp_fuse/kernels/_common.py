"""Argument checks and the torch-side math shared by all kernels.

The torch functions here define the semantics that the Triton kernels reproduce:

* ``fp8_cast(v, scale, fp8_dtype)``: ``clamp(v * scale, -fp8_max, fp8_max)`` in fp32
  (float64 for float64 ``v``), then torch's round-to-nearest-even ``.to(fp8_dtype)``.
  Saturating: +-inf map to +-fp8_max; NaN stays NaN (byte ``0x7F | sign``, which is
  what torch emits).
* ``abs_max(v)``: ``max(|v|)`` as an fp32 0-d tensor, NaN if any element is NaN, 0 for
  an empty tensor.

Dtypes: the Triton kernels take fp32 / bf16 / fp16 and compute in fp32. The torch path
also takes float64 and then computes in float64 (``compute_dtype``), so that float64
models (used as references in tests) keep their precision through the same functions;
``triton_dtype_issue`` routes such inputs to torch.

The torch path is written for CPU speed: few passes, in-place updates of temporaries
it owns, aten's fused kernels where their semantics match. The Triton kernels evaluate
the same functions; results agree within rounding (fp32 tolerance, one FP8 step), and
casts of the same fp32 values are bit-identical.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from typing import Optional

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: Dtypes the Triton kernels read and write.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Dtypes the torch path reads and writes (float64 computes in float64).
TORCH_FLOAT_DTYPES = FLOAT_DTYPES + (torch.float64,)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the internal math: float64 stays float64, everything narrower is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` has that dtype already: a no-op ``.to``
    still goes through argument parsing and the dispatcher (~0.8 us on CPU, against 0.07
    for the comparison), and the eager step makes a dozen such calls."""
    return t if t.dtype == dtype else t.to(dtype)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype; no copy when it already is (fp32 / float64)."""
    return as_dtype(t, compute_dtype(t.dtype))


def triton_dtype_issue(*dtypes: Optional[torch.dtype]) -> Optional[str]:
    """Why the Triton kernels cannot take these dtypes (float64), or None."""
    if torch.float64 in dtypes:
        return "float64 tensors: the Triton kernels compute in fp32 (the torch path keeps float64)"
    return None


def check_float(name: str, t: torch.Tensor, *, min_dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in TORCH_FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype in {TORCH_FLOAT_DTYPES}, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimension(s), got shape {tuple(t.shape)}")


def check_fp8_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_MAX:
        raise ValueError(f"{name}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")


def check_scale(name: str, scale: torch.Tensor, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        if isinstance(scale, torch.Tensor):
            got = f"{scale.dtype} tensor of shape {tuple(scale.shape)}"
        else:
            got = type(scale).__name__
        raise ValueError(f"{name}: expected a float32 tensor with one element, got {got}")
    if scale.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {scale.device}")


def check_quant_args(scale: Optional[torch.Tensor], fp8_dtype: Optional[torch.dtype], device: torch.device) -> bool:
    """Validate the optional ``scale``/``fp8_dtype`` pair; returns whether to quantize."""
    if (scale is None) != (fp8_dtype is None):
        raise ValueError(
            f"scale/fp8_dtype: pass both to quantize the output or neither, got scale="
            f"{'None' if scale is None else 'tensor'} and fp8_dtype={fp8_dtype}"
        )
    if fp8_dtype is None:
        return False
    check_fp8_dtype("fp8_dtype", fp8_dtype)
    check_scale("scale", scale, device)
    return True


def check_vector(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    check_float(name, t)
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``[..., n] -> [rows, n]`` view when strides allow (a copy otherwise)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


# The two helpers below skip reshapes that would change nothing: each reshape is a view
# op dispatched through autograd (about a microsecond and a half on CPU), and the eager
# fuser's per-step host time is made of dozens of such small costs.


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t.reshape(-1, n)``, or ``t`` itself when it already is ``[rows, n]``."""
    return t if t.dim() == 2 and t.shape[1] == n else t.reshape(-1, n)


def as_shape(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t.reshape(shape)``, or ``t`` itself when it already has that shape."""
    return t if t.shape == shape else t.reshape(shape)


def fp8_cast(
    v: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, overwrite: bool = False
) -> torch.Tensor:
    """Saturating RTNE cast of ``v * scale`` (fp32, or float64 for float64 ``v``) to ``fp8_dtype``.

    ``overwrite=True`` lets the cast scale ``v`` in place when it already is in its
    compute dtype: callers pass temporaries they own, saving a full-size allocation.
    """
    fp8_max = FP8_MAX[fp8_dtype]
    cdtype = compute_dtype(v.dtype)
    scale = scale if scale.dim() == 0 else scale.reshape(())
    if v.dtype != cdtype:
        t = v.to(cdtype).mul_(scale)
    elif overwrite:
        t = v.mul_(scale)
    else:
        t = v * scale
    # torch's .to(float8) is not saturating (e4m3: >= 464 becomes NaN; e5m2: overflow
    # becomes inf), hence the clamp; clamp keeps NaN as NaN.
    return t.clamp_(-fp8_max, fp8_max).to(fp8_dtype)


def check_fold_outputs(
    device: torch.device, scale: Optional[torch.Tensor], amax_out: Optional[torch.Tensor],
    scale_inv_out: Optional[torch.Tensor],
) -> None:
    """Validate a producer kernel's ``amax_out`` / ``scale_inv_out`` (``cast.quantize``'s
    meaning); ``scale_inv_out`` needs the ``scale`` it inverts."""
    if amax_out is not None:
        check_scale("amax_out", amax_out, device)
    if scale_inv_out is not None:
        if scale is None:
            raise ValueError("scale_inv_out: only with a scale (an FP8 output) to invert")
        check_scale("scale_inv_out", scale_inv_out, device)


def fold_outputs(
    amax: Optional[torch.Tensor], scale: Optional[torch.Tensor], amax_out: Optional[torch.Tensor],
    scale_inv_out: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """The torch path's ``amax_out`` / ``scale_inv_out``: ``amax`` maxed into ``amax_out``
    (returned instead), ``1 / scale`` written into ``scale_inv_out`` -- what the Triton
    kernels do in their own launch."""
    if amax_out is not None:
        amax = torch.maximum(amax_out, amax, out=amax_out)
    if scale_inv_out is not None:
        torch.reciprocal(scale, out=scale_inv_out)
    return amax


_FP32_MAX = float(torch.finfo(torch.float32).max)


def current_scale_torch(
    amax: torch.Tensor, fp8_max: float, power_2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, nonfinite, zero)`` of current scaling for an amax (``max |x|``: >= 0, or
    NaN/inf): ``fp8_max / amax`` in float64, clamped to the fp32 range, [rounded down to a
    power of two,] rounded to fp32 once; 1.0 for a zero or non-finite amax; whether the
    amax is non-finite / zero (0-d bools). The Triton cast computes the same in its
    kernel (``_triton_common.current_scale``)."""
    amax64 = amax.detach() if amax.requires_grad else amax
    amax64 = (amax64 if amax64.dim() == 0 else amax64.reshape(())).to(torch.float64)
    # Finite and > 0 in two comparisons (NaN fails both). Unusable amaxes divide to inf,
    # 0 or NaN, which the where() discards.
    finite = amax64 < math.inf
    positive = amax64 > 0
    usable = positive & finite
    scale64 = (fp8_max / amax64).clamp(max=_FP32_MAX)
    # Round in float64: rounding to fp32 first could round up onto the next power
    # of two and make the scaled amax exceed fp8_max.
    if power_2_scale:
        scale64 = round_down_to_power_of_2(torch.where(usable, scale64, 1.0))
    scale = torch.where(usable, scale64.to(torch.float32), _one(amax64.device))
    return scale, ~finite, amax64 == 0


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``scale`` (scale > 0, finite), exactly."""
    mantissa, exponent = torch.frexp(scale.to(torch.float64))
    # frexp: scale = mantissa * 2**exponent with mantissa in [0.5, 1).
    del mantissa
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent - 1).to(torch.float32)


# fp32 1.0 per device, for the where() above: a Python scalar there is one more op
# (a scalar tensor made per call), and this runs at every current-scaling quantize.
_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # Traced (the compiled CUDA path's casts): a constant the compiler folds; reading
        # or filling the cache would guard on it and retrace once it is filled.
        return torch.ones((), dtype=torch.float32, device=device)
    one = _ONES.get(device)
    if one is None:
        with torch.inference_mode(False):
            one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def abs_max(v: torch.Tensor) -> torch.Tensor:
    """fp32 0-d ``max(|v|)``; NaN-propagating; 0 for an empty tensor."""
    n = v.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=v.device)
    if n <= _ABS_MAX_TEMPORARY_NUMEL:
        # Two ops where the form below takes three: small tensors are bound by op count.
        return v.abs().amax().float()
    # One read, no full-size |v| temporary; max/maximum propagate NaN.
    lo, hi = torch.aminmax(v)
    return torch.maximum(hi, lo.neg()).float()


# Up to this size abs_max computes |v| as a temporary (measured on CPU, torch 2.13, median
# of 300: 1K elements 2.3 us vs 4.1 us for aminmax's three ops; 16K 4.4 vs 5.0; from about
# 100K the temporary costs more: 1M 224 us vs 104 us).
_ABS_MAX_TEMPORARY_NUMEL = 65536


def finish_output(
    v: torch.Tensor,
    out_dtype: torch.dtype,
    scale: Optional[torch.Tensor],
    fp8_dtype: Optional[torch.dtype],
    with_amax: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Result ``v`` in its compute dtype, owned by the caller (it may be overwritten) ->
    (contiguous output in ``out_dtype`` or FP8, amax of ``v`` or None without ``with_amax``)."""
    amax = abs_max(v) if with_amax else None
    # Elementwise ops keep the input's strides; outputs are contiguous like Triton's.
    if fp8_dtype is not None:
        return fp8_cast(v, scale, fp8_dtype, overwrite=True).contiguous(), amax
    v = as_dtype(v, out_dtype)
    return (v if v.is_contiguous() else v.contiguous()), amax


# GELU (tanh approximation) in the form both backends evaluate. Transformer Engine's
# 0.5*x*(1 + tanh(u)) equals x * sigmoid(2u) exactly; the sigmoid form avoids the
# cancellation in 1 + tanh(u) for negative x (where fp32 tanh(u) ~ -1 loses all digits).
GELU_K = 0.7978845608028654  # sqrt(2 / pi)
GELU_C = 0.044715


def gelu_torch(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(2u)``, ``u = k (x + c x^3)``, as a new tensor in x's dtype.

    One allocation, then in-place passes (on CPU a fresh full-size tensor costs more
    than a pass over a warm one). ``torch.sigmoid`` is ``1 / (1 + exp(-z))``: accurate
    in both tails (no cancellation; exp overflow gives exactly 0).
    """
    z = torch.mul(x, x).mul_(2.0 * GELU_K * GELU_C).add_(2.0 * GELU_K).mul_(x)  # 2u = 2k x (1 + c x^2)
    return z.sigmoid_().mul_(x)


#: aten's tanh-form ``gelu_backward`` has relative error <= ~1e-5 for x >= this; below,
#: ``1 + tanh(u)`` cancels (at x = -5 the error is 30%, and tiny gradients change sign).
DGELU_ATEN_MIN_X = -3.0


def dgelu_grad_torch(grad: torch.Tensor, x: torch.Tensor, *, overwrite_grad: bool = False) -> torch.Tensor:
    """``grad * gelu'(x)``; ``grad`` and ``x`` in the same compute dtype.

    aten's fused ``gelu_backward`` (one pass: the fast CPU path) where it is accurate,
    and the elements with ``x < DGELU_ATEN_MIN_X`` -- a sliver of a normal
    pre-activation distribution -- recomputed with :func:`dgelu_torch`, which keeps
    relative accuracy in the tail (the Triton kernel's accuracy everywhere).

    ``overwrite_grad=True``: the result is written into ``grad``'s buffer (contiguous,
    not overlapping ``x``, owned by the caller) instead of a new tensor.
    """
    if overwrite_grad:
        tail = _dgelu_tail(grad, x)  # reads grad before the overwrite
        dx = torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=grad)
    else:
        dx = torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
        # After the pass over x: x is in cache then (the check rereads all of it).
        tail = _dgelu_tail(grad, x)
    if tail is not None:
        idx, grad_tail = tail
        dx[idx] = dgelu_torch(x[idx]).mul_(grad_tail)
    return dx


def _dgelu_tail(grad: torch.Tensor, x: torch.Tensor) -> Optional[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The indices of the elements aten's ``gelu_backward`` gets wrong and ``grad`` there
    (a copy), or None when there are none.

    Usually no element is in the tail: one reduction, no mask. (NaN makes the comparison
    false and takes the mask path, which then fixes the real tail.) A device sync off
    CPU; the CUDA fast path is Triton.
    """
    if not x.numel() or bool(x.amin() >= DGELU_ATEN_MIN_X):
        return None
    idx = (x < DGELU_ATEN_MIN_X).nonzero(as_tuple=True)
    return idx, grad[idx]


def dgelu_torch(x: torch.Tensor) -> torch.Tensor:
    """d/dx gelu_tanh(x) = s (1 + 2k x (1 + 3c x^2) (1 - s)), ``s = sigmoid(2u)``.

    ``1 - s`` is evaluated as ``sigmoid(-2u)``: ``1 - s`` itself would cancel for large
    positive x, and aten's tanh-form ``gelu_backward`` cancels in ``1 + tanh(u)`` for
    negative x (it gets the sign of tiny gradients wrong). Two full-size allocations
    (the result and one temporary): ``2u`` is recomputed for ``s`` rather than kept in
    a third buffer, since on CPU a fresh buffer costs more than a pass over a warm one.
    """
    out = torch.mul(x, x)
    tmp = torch.mul(out, 2.0 * GELU_K * GELU_C).add_(2.0 * GELU_K).mul_(x)  # 2u
    out.mul_(6.0 * GELU_C * GELU_K).add_(2.0 * GELU_K).mul_(x)  # 2k x (1 + 3c x^2)
    out.mul_(tmp.neg_().sigmoid_()).add_(1.0)  # 1 + 2k x (1 + 3c x^2) (1 - s)
    torch.mul(x, x, out=tmp).mul_(2.0 * GELU_K * GELU_C).add_(2.0 * GELU_K).mul_(x)  # 2u again
    return out.mul_(tmp.sigmoid_())
