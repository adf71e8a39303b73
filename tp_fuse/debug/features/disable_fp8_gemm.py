"""``DisableFP8GEMM``: run the listed GEMMs of a layer in high precision."""

from __future__ import annotations

from typing import Any

from .api import DebugFeature

__all__ = ["DisableFP8GEMM"]


class DisableFP8GEMM(DebugFeature):
    """Options: ``gemms`` (any of fprop, dgrad, wgrad). Those GEMMs take the
    high-precision operands (exactly the computation the layer does without FP8);
    the other GEMMs of the layer stay in FP8."""

    options = frozenset()
    uses_tensors = False

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.per_gemm is None:
            raise ValueError(f"{spec.where}: DisableFP8GEMM needs a gemms list (from fprop, dgrad, wgrad)")

    def fp8_gemm_enabled(self, config: dict[str, Any], layer_name: str, gemm: str, iteration: int):
        return False, None
