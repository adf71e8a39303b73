"""``LogFp8TensorStats``: what the FP8 cast does to a tensor (underflows, overflows, MSE)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from nvdlfw_inspect.registry import api_method
import torch.distributed as dist

from tp_fuse.debug.stats import FP8_STATS, components_for, fp8_components, simulate_fp8_cast
from tp_fuse.debug.features.api import StatsLoggingFeature, enabled_at
from tp_fuse.quantization import Float8Tensor

__all__ = ["LogFp8TensorStats"]


class LogFp8TensorStats(StatsLoggingFeature):
    """Record FP8 cast statistics of GEMM inputs every ``freq`` iterations.

    Options: ``tensors`` (activation, weight, gradient), ``stats`` (from
    ``underflows%, overflows%, scale_inv_min, scale_inv_max, mse``), ``freq``,
    ``start_step``, ``end_step``. Uses the tensor's actual FP8 version when the GEMM
    ran in FP8; when the GEMM ran in high precision this iteration (e.g.
    ``DisableFP8GEMM``), reports what the layer's quantizer *would* have produced.
    Needs an FP8 recipe in force (``tp_fuse.autocast``).
    """

    feature_name = "LogFp8TensorStats"
    known_stats = FP8_STATS
    allowed_tensors = frozenset({"activation", "weight", "gradient"})

    @api_method
    def inspect_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        tensor_name: str,
        tensor: torch.Tensor,
        rowwise_quantized_tensor: Optional[torch.Tensor] = None,
        columnwise_quantized_tensor: Optional[torch.Tensor] = None,
        quantizer: Any = None,
        iteration: int = 0,
        tp_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        # Under nvdlfw-inspect a tensor some feature inspects this iteration is handed to
        # every feature covering it: each keeps to its own freq/start_step/end_step.
        if not enabled_at(config, iteration)[0]:
            return

        q = rowwise_quantized_tensor
        if isinstance(q, Float8Tensor):
            dequantized = q.dequantize(torch.float32)
            scale = torch.reciprocal(q._scale_inv.to(torch.float32))
            fp8_max = float(torch.finfo(q.fp8_dtype).max)
        elif quantizer is not None:
            dequantized, scale = simulate_fp8_cast(tensor, quantizer)
            fp8_max = quantizer.fp8_max
        else:
            raise RuntimeError(
                f"LogFp8TensorStats on {layer_name}/{tensor_name}: no FP8 recipe in force; "
                "run the model under tp_fuse.autocast(...) or remove the feature"
            )
        comps = fp8_components(tensor, dequantized, scale, fp8_max, components_for(config["stats"]))
        self.record(config, layer_name, tensor_name, iteration, comps)
