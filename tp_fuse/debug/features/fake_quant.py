"""``FakeQuant``: emulate an FP8 cast in high precision (quantize, then dequantize)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...quantization import scaling
from .api import DebugFeature

__all__ = ["FakeQuant"]

_FORMATS = {"FP8E4M3": torch.float8_e4m3fn, "FP8E5M2": torch.float8_e5m2}


class FakeQuant(DebugFeature):
    """Replace GEMM inputs by their FP8 round trip, computed with current scaling.

    Options: ``gemms`` / ``gemms_struct`` (which GEMMs), ``tensors`` /
    ``tensors_struct`` (activation, weight, gradient), ``quant_format``
    (``FP8E4M3`` or ``FP8E5M2``, required), ``margin`` (int >= 0, default 0):
    ``scale = fp8_max / amax(x) / 2**margin``, ``x' = dequant(cast(x * scale))``.
    The covered GEMMs run in high precision on the fake-quantized values (TE
    semantics: ``fp8_gemm_enabled`` is False for them), so a model can be tried at
    FP8 precision without FP8 GEMMs, or with a different format per tensor.
    Gradients pass straight through.
    """

    options = frozenset({"quant_format", "margin"})
    allowed_tensors = frozenset({"activation", "weight", "gradient"})

    def check(self, opts: dict[str, Any], where: str) -> None:
        fmt = opts.get("quant_format")
        if fmt is not None and fmt not in _FORMATS:
            raise ValueError(f"{where}.quant_format: expected one of {sorted(_FORMATS)}, got {fmt!r}")
        margin = opts.get("margin", 0)
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"{where}.margin: expected an int >= 0, got {margin!r}")

    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        if "quant_format" not in config:
            raise ValueError(f"FakeQuant on {layer_name}/{gemm}/{tensor_name}: option 'quant_format' is required")
        return True, iteration + 1

    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        return False, None

    @torch.no_grad()
    def modify_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        default_quantizer: Any,
        iteration: int,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        dtype = _FORMATS[config["quant_format"]]
        fp8_max = float(torch.finfo(dtype).max)
        x = tensor.detach().to(torch.float32)
        scale = scaling.current_scale(x.abs().amax(), fp8_max) / (2.0 ** int(config.get("margin", 0)))
        q = (x * scale).clamp(-fp8_max, fp8_max).to(dtype)
        return (q.to(torch.float32) / scale).to(tensor.dtype)
