"""``LogTensorStats``: statistics of high-precision tensors (min, max, mean, std, ...)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from nvdlfw_inspect.registry import api_method
import torch.distributed as dist

from tp_fuse.debug.stats import TENSOR_STATS, components_for, tensor_components
from tp_fuse.debug.features.api import StatsLoggingFeature, enabled_at

__all__ = ["LogTensorStats"]


class LogTensorStats(StatsLoggingFeature):
    """Record ``stats`` of the listed tensors every ``freq`` iterations.

    Options: ``tensors`` (any of activation, weight, gradient, output, wgrad, dgrad),
    ``stats`` (from ``min, max, mean, std, l1_norm, l2_norm, amax, dynamic_range``),
    ``freq``, ``start_step``, ``end_step``. Records are named
    ``debug/<layer>/<tensor>/<stat>``; statistics cover all ranks of the session's
    reduction group (replicated tensors count once per rank in the norms).
    """

    feature_name = "LogTensorStats"
    known_stats = TENSOR_STATS
    allowed_tensors = frozenset({"activation", "weight", "gradient", "output", "wgrad", "dgrad"})

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
        comps = tensor_components(tensor, components_for(config["stats"]))
        self.record(config, layer_name, tensor_name, iteration, comps)
