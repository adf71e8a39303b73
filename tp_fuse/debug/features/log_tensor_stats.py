"""``LogTensorStats``: statistics of high-precision tensors (min, max, mean, std, ...)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..stats import TENSOR_STATS, components_for, tensor_components
from .api import DebugFeature, _check_window, check_stats_option, enabled_at

__all__ = ["LogTensorStats"]


class LogTensorStats(DebugFeature):
    """Record ``stats`` of the listed tensors every ``freq`` iterations.

    Options: ``tensors`` (any of activation, weight, gradient, output, wgrad, dgrad),
    ``stats`` (from ``min, max, mean, std, l1_norm, l2_norm, amax, dynamic_range``),
    ``freq``, ``start_step``, ``end_step``. Records are named
    ``debug/<layer>/<tensor>/<stat>``; statistics cover all ranks of the session's
    reduction group (replicated tensors count once per rank in the norms).
    """

    options = frozenset({"stats", "freq", "start_step", "end_step"})
    allowed_tensors = frozenset({"activation", "weight", "gradient", "output", "wgrad", "dgrad"})

    def check(self, opts: dict[str, Any], where: str) -> None:
        _check_window(opts, where)
        check_stats_option(opts, where, TENSOR_STATS)

    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        if "stats" not in config:
            raise ValueError(f"LogTensorStats on {layer_name}/{tensor_name}: option 'stats' is required")
        return enabled_at(config, iteration)

    def inspect_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        tensor_name: str,
        tensor: torch.Tensor,
        rowwise_quantized_tensor: Optional[torch.Tensor],
        columnwise_quantized_tensor: Optional[torch.Tensor],
        quantizer: Any,
        iteration: int,
        tp_group: Optional[dist.ProcessGroup],
    ) -> None:
        stats = config["stats"]
        comps = tensor_components(tensor, components_for(stats))
        self.stats.add(iteration, f"debug/{layer_name}/{tensor_name}", stats, comps,
                       source="LogTensorStats", once=tensor_name == "weight")
