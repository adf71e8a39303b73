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
