"""FP8 scaling statistics of every GEMM, for the training logs.

``Fp8StatsCollector`` observes the FP8 casts ``BasicLinear`` does anyway and never
changes numerics. It keeps one fusion from happening: ``ForwardNormQuantizeLinear``
(the norm kernel writing the next GEMM's FP8 input directly) rejects observed layers,
since the high-precision norm output that underflow and MSE are computed from does not
exist there. All other fusions are unchanged. Recording is off by default; switch it
on for the steps you log::

    collector = Fp8StatsCollector(reduction_group=world)
    collector.attach(model)
    collector.active = step % log_interval == 0
    ... forward/backward/optimizer step ...
    if collector.active:
        metrics.update(collector.collect())   # collective over reduction_group

Statistics per ``(layer, gemm, tensor)``, ``tensor`` in ``input, weight,
grad_output``, named ``fp8/<layer>/<gemm>/<tensor>/<stat>``:

=================== ============================================================
``amax``            max |x| of the tensor over the step's micro-batches and ranks
``scale``           scale the tensor was cast with (``fp8 = saturate(x * scale)``)
``scale_inv``       ``1 / scale`` (what the GEMM multiplies by)
``amax_history_max`` max of the delayed-scaling amax history after the step's update
                    (delayed scaling only)
``underflow_pct``   % of elements that are non-zero but become 0 in FP8
``overflow_pct``    % of elements with ``|x * scale| > fp8_max`` (saturated)
``mse``             mean squared error of the FP8 round trip
``nonfinite_amax_count`` NaN/inf amaxes this quantizer has met so far (cumulative;
                    such steps are skipped by the launcher, ``tp_fuse.launch.health``)
=================== ============================================================

Block-scaled recipes (``Float8BlockScaling``, ``MXFP8BlockScaling``, ``Float8RowwiseScaling``)
have one scale per block, so instead of ``scale``/``scale_inv``/``amax_history_max`` they
report ``block_scale_inv_min``, ``block_scale_inv_max`` and ``block_scale_inv_std`` (over all
blocks of the row-wise copy, all micro-batches and ranks); ``overflow_pct`` counts elements
saturated by their block's scale (MXFP8's OCP rule saturates block maxima).

``scale``, ``scale_inv`` and ``amax_history_max`` are this rank's values (identical on
all ranks of the FP8 amax-reduction group); the others combine all ranks of
``reduction_group``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .hooks import LinearDebugHooks
from .naming import hooks_for, name_linears
from ..ops.basic._checks import maybe_dequantize
from .stats import StatsBuffer, block_fp8_components, fp8_components
from ..quantization import BlockScaledTensor, Float8Tensor

__all__ = ["Fp8StatsCollector", "FP8_STAT_NAMES"]

FP8_STAT_NAMES = (
    "amax", "scale", "scale_inv", "amax_history_max", "underflow_pct", "overflow_pct", "mse", "nonfinite_amax_count",
)
_BUFFER_STATS = ("amax", "underflows%", "overflows%", "mse")
_RENAME = {"amax": "amax", "underflows%": "underflow_pct", "overflows%": "overflow_pct", "mse": "mse",
           "scale_inv_min": "block_scale_inv_min", "scale_inv_max": "block_scale_inv_max",
           "scale_inv_std": "block_scale_inv_std"}
# Block-scaled recipes (no single scale): the distribution of the block scales instead.
_BLOCK_BUFFER_STATS = _BUFFER_STATS + ("scale_inv_min", "scale_inv_max", "scale_inv_std")
_COMPONENTS = {"amax", "numel", "underflows", "overflows", "sqerr"}


class Fp8StatsCollector:
    """Collects FP8 scaling statistics of a model's ``BasicLinear`` ops.

    Args:
        reduction_group: group over which counts and amaxes are combined in
            :meth:`collect` (None: the default group when initialized).

    Attributes:
        active: record casts only while True (the logging steps).
    """

    def __init__(self, reduction_group: Optional[dist.ProcessGroup] = None) -> None:
        self.reduction_group = reduction_group
        self.active = False
        self._buffer = StatsBuffer()
        # key -> (quantizer, scale used by the last cast), this rank's view
        self._last: dict[str, tuple[Any, torch.Tensor]] = {}
        self.layer_names: list[str] = []

    def attach(self, model: torch.nn.Module, *, tp_group: Optional[dist.ProcessGroup] = None) -> list[str]:
        """Observe every ``BasicLinear`` of ``model``; returns their layer names."""
        names = name_linears(model)
        for name in names:
            hooks_for(name, tp_group).fp8_tap = self
        self.layer_names = [n.layer_name for n in names]
        return self.layer_names

    def record(self, hooks: LinearDebugHooks, role: str, hp: torch.Tensor, q: Any, quantizer: Any) -> None:
        """One cast ``hp -> q`` (a Float8Tensor or BlockScaledTensor) of ``role`` by ``hooks``' layer."""

        key = f"fp8/{hooks.layer}/{hooks.gemm_name}/{role}"
        if isinstance(q, BlockScaledTensor) and q._rowwise is not None:
            with torch.no_grad():
                comps = block_fp8_components(maybe_dequantize(hp), q)
            self._buffer.add(0, key, _BLOCK_BUFFER_STATS, comps)
            return
        if not isinstance(q, Float8Tensor):
            return
        with torch.no_grad():
            scale = torch.reciprocal(q._sinv.to(torch.float32))
            dequantized = q.dequantize(torch.float32)
            fp8_max = float(torch.finfo(q.fp8_dtype).max)
            hp_values = hp.dequantize() if isinstance(hp, Float8Tensor) else hp
            comps = fp8_components(hp_values, dequantized, scale, fp8_max, _COMPONENTS)
        self._buffer.add(0, key, _BUFFER_STATS, comps)
        self._last[key] = (quantizer, scale)

    def collect(self) -> dict[str, float]:
        """Statistics recorded since the last call (collective over ``reduction_group``)."""
        records = self._buffer.collect(self.reduction_group)
        out: dict[str, float] = {}
        for _, rec in records:
            for name, value in rec.items():
                key, stat = name.rsplit("/", 1)
                out[f"{key}/{_RENAME[stat]}"] = value
        for key, (quantizer, scale) in sorted(self._last.items()):
            s = float(scale)
            out[f"{key}/scale"] = s
            out[f"{key}/scale_inv"] = 1.0 / s
            history = getattr(quantizer, "amax_history", None)
            if history is not None:
                out[f"{key}/amax_history_max"] = float(history.amax())
            count = getattr(quantizer, "nonfinite_amax_count", None)
            if count is not None:
                out[f"{key}/nonfinite_amax_count"] = float(count)
        self._last.clear()
        return dict(sorted(out.items()))
