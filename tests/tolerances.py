"""One tolerance table for the whole suite, by dtype (and FP8 format).

Results are compared with a float64 reference computed from the same inputs.
``rtol``/``atol`` are for ``torch.testing.assert_close``.
"""

import torch

TOLERANCES: dict[object, dict[str, float]] = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    # FP8 GEMMs: operand rounding of 2^-4 (E4M3) / 2^-3 (E5M2) relative,
    # averaged over the reduction dimension; checked against float64 math.
    "fp8_e4m3": dict(rtol=0.125, atol=0.0625),
    "fp8_hybrid": dict(rtol=0.25, atol=0.125),
}


def tols(key) -> dict[str, float]:
    """Tolerances for a dtype or an FP8 key ("fp8_e4m3", "fp8_hybrid")."""
    if key not in TOLERANCES:
        raise KeyError(f"no tolerance entry for {key!r}; add one to tests/tolerances.py")
    return TOLERANCES[key]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, key=None, **override) -> None:
    """Compare ``actual`` to a (float64) reference with the table's tolerances."""
    key = actual.dtype if key is None else key
    kw = {**tols(key), **override}
    torch.testing.assert_close(actual.double(), expected.double(), **kw)


# Unit roundoff of the FP8 formats (round to nearest): half the spacing of
# consecutive values relative to the value, i.e. 2^-(mantissa bits + 1).
FP8_UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


def assert_fp8_matmul_close(
    actual: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    unit_a: float,
    unit_b: float,
    *,
    bias: torch.Tensor | None = None,
    underflow_atol: float = 1e-3,
) -> None:
    """Check an FP8 GEMM result ``actual ~ a @ b.T (+ bias)`` elementwise.

    Each operand element is rounded with relative error <= its format's unit
    roundoff (values below the smallest normal add at most ``underflow_atol``
    in total), so ``|actual - a @ b.T| <= (|a| @ |b|.T) * (u_a + u_b + u_a u_b)``
    plus the accumulation error of the high-precision sum, which is far
    smaller. The reference is computed in float64.
    """
    a64, b64 = a.detach().double(), b.detach().double()
    expected = a64 @ b64.t()
    if bias is not None:
        expected = expected + bias.detach().double()
    bound = (a64.abs() @ b64.abs().t()) * (unit_a + unit_b + unit_a * unit_b) + underflow_atol
    err = (actual.detach().double().reshape(expected.shape) - expected).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"FP8 GEMM error exceeds the rounding bound by {worst:.3g} (max err {err.max().item():.3g})"


# NVFP4 GEMMs against float64 math: relative Frobenius error. E2M1 keeps 1 mantissa bit
# (relative rounding up to 1/4, values below a quarter of the block scale flush to 0), so
# on Gaussian data one operand's round trip is ~10 % (1x16 blocks), ~11 % (16x16) and
# ~14 % with stochastic rounding (measured); a GEMM of two such operands ~15-17 %.
NVFP4_REL_NORM = 0.25
