"""``LogFp8TensorStats``: what the FP8 cast does to a tensor (underflows, overflows, MSE)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from nvdlfw_inspect.registry import api_method
import torch.distributed as dist

from tp_fuse.debug.stats import FP8_STATS, block_fp8_components, components_for, fp8_components, simulate_fp8_cast
from tp_fuse.debug.features.api import StatsLoggingFeature, enabled_at
from tp_fuse.quantization import BlockScaledTensor, BlockScalingQuantizer, Float8Tensor

__all__ = ["LogFp8TensorStats"]


class LogFp8TensorStats(StatsLoggingFeature):
    """Record FP8 cast statistics of GEMM inputs every ``freq`` iterations.

    Options: ``tensors`` (activation, weight, gradient), ``stats`` (from
    ``underflows%, overflows%, scale_inv_min, scale_inv_max, mse``), ``freq``,
    ``start_step``, ``end_step``. Uses the tensor's actual FP8 version when the GEMM
    ran in FP8; when the GEMM ran in high precision this iteration (e.g.
    ``DisableFP8GEMM``), reports what the layer's quantizer *would* have produced.
    Needs an FP8 recipe in force (``tp_fuse.autocast``). Under block-scaled recipes
    (MXFP8, Float8BlockScaling, Float8RowwiseScaling, NVFP4) the statistics come from the
    row-wise block cast, ``scale_inv_min``/``scale_inv_max`` range over its block scales and
    ``scale_inv_std`` (block recipes only) is their standard deviation.
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
        needed = components_for(config["stats"])
        if not isinstance(q, BlockScaledTensor) and isinstance(quantizer, BlockScalingQuantizer):
            # The GEMM ran in high precision this step: what the recipe's block cast would do
            # (block quantizers keep no state, so casting here changes nothing).
            q = quantizer.quantize(tensor.detach())
        if isinstance(q, BlockScaledTensor) and q._rowwise is not None:
            # Block recipes (MXFP8, Float8BlockScaling, rowwise, NVFP4): per-block scales, so
            # the scale_inv statistics describe the distribution of the row-wise blocks' scales.
            comps = block_fp8_components(tensor, q)
            self.record(config, layer_name, tensor_name, iteration, {k: v for k, v in comps.items() if k in needed})
            return
        if isinstance(q, Float8Tensor):
            dequantized = q.dequantize(torch.float32)
            scale = torch.reciprocal(q._sinv.to(torch.float32))
            fp8_max = float(torch.finfo(q.fp8_dtype).max)
        elif quantizer is not None:
            dequantized, scale = simulate_fp8_cast(tensor, quantizer)
            fp8_max = quantizer.fp8_max
        else:
            raise RuntimeError(
                f"LogFp8TensorStats on {layer_name}/{tensor_name}: no FP8 recipe in force; "
                "run the model under tp_fuse.autocast(...) or remove the feature"
            )
        if needed & {"scale_inv_count", "scale_inv_sum", "scale_inv_sumsq"}:
            raise ValueError(f"LogFp8TensorStats on {layer_name}/{tensor_name}: scale_inv_std describes the block "
                             "scales of a block-scaled recipe; this tensor has one per-tensor scale")
        comps = fp8_components(tensor, dequantized, scale, fp8_max, needed)
        self.record(config, layer_name, tensor_name, iteration, comps)
