"""``DisableFP8GEMM`` / ``DisableFP8Layer``: run the listed (or all) GEMMs of a layer in high precision."""

from __future__ import annotations

from typing import Any

from nvdlfw_inspect.registry import api_method

from tp_fuse.debug.features.api import DebugFeature

__all__ = ["DisableFP8GEMM", "DisableFP8Layer"]


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

    @api_method
    def fp8_gemm_enabled(self, config: dict[str, Any], layer_name: str, gemm: str, iteration: int):
        return False, None


class DisableFP8Layer(DebugFeature):
    """TE's ``DisableFP8Layer``: every GEMM of the selected layers runs in high precision
    (``fp8_gemm_enabled`` is False for fprop, dgrad and wgrad). No options."""

    options = frozenset()
    uses_tensors = False

    def validate(self, spec) -> None:
        super().validate(spec)
        if spec.per_gemm is not None:
            raise ValueError(f"{spec.where}: DisableFP8Layer acts on every GEMM of the layer and takes no gemms "
                             "list (use DisableFP8GEMM to pick GEMMs)")

    @api_method
    def fp8_gemm_enabled(self, config: dict[str, Any], layer_name: str, gemm: str, iteration: int):
        return False, None
