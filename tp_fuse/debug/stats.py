"""Tensor statistics that can be combined across micro-batches and ranks.

Every statistic is computed from *components* that reduce with SUM, MIN or MAX
(``mean = sum / numel``, ``std`` from sum and sum of squares, ...). Components are
accumulated as 0-d float64 tensors on the tensor's device (no host sync while
training); :meth:`StatsBuffer.collect` reduces all pending records with three
all-reduces in total (one per reduction kind) and only then turns components into
numbers. Merging two micro-batches of one iteration is the same reduction.

Statistic names follow Transformer Engine's debug features:

``LogTensorStats``: ``min, max, mean, std, l1_norm, l2_norm, amax, dynamic_range``
(``dynamic_range = log2(amax / smallest non-zero |x|)``).

``LogFp8TensorStats``: ``underflows%`` (elements that are non-zero in high precision
and 0 after the FP8 cast, in % of all elements), ``overflows%`` (elements whose
scaled magnitude exceeds the FP8 format's max and are clipped, in %),
``scale_inv_min``, ``scale_inv_max``, ``mse`` (mean squared quantization error).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

from ..quantization.block.scaling import expand_scales
from ..recipe import low_precision_max
from ..quantization import scaling
from ..quantization.float8.current_scaling import CurrentScalingQuantizer

__all__ = [
    "FP8_STATS",
    "TENSOR_STATS",
    "StatsBuffer",
    "components_for",
    "block_fp8_components",
    "fp8_components",
    "simulate_fp8_cast",
    "tensor_components",
]

SUM, MIN, MAX = "sum", "min", "max"

#: component name -> reduction kind
COMPONENT_REDUCE: dict[str, str] = {
    "numel": SUM,
    "sum": SUM,
    "sumsq": SUM,
    "l1": SUM,
    "min": MIN,
    "max": MAX,
    "amax": MAX,
    "min_nonzero_abs": MIN,
    "underflows": SUM,
    "overflows": SUM,
    "sqerr": SUM,
    "scale_inv_min": MIN,
    "scale_inv_max": MAX,
    # Block-scaled recipes: the distribution of the block scales (std over all blocks).
    "scale_inv_count": SUM,
    "scale_inv_sum": SUM,
    "scale_inv_sumsq": SUM,
}


def _std(c: dict[str, float]) -> float:
    n = c["numel"]
    if n < 2:
        return 0.0
    var = (c["sumsq"] - c["sum"] * c["sum"] / n) / (n - 1)
    return math.sqrt(max(var, 0.0))


def _dynamic_range(c: dict[str, float]) -> float:
    if c["amax"] <= 0 or not math.isfinite(c["min_nonzero_abs"]):
        return 0.0  # all zeros: no range
    return math.log2(c["amax"] / c["min_nonzero_abs"])


#: stat name -> (components it needs, finalizer)
TENSOR_STATS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, float]], float]]] = {
    "min": (("min",), lambda c: c["min"]),
    "max": (("max",), lambda c: c["max"]),
    "mean": (("sum", "numel"), lambda c: c["sum"] / max(c["numel"], 1.0)),
    "std": (("sum", "sumsq", "numel"), _std),
    "l1_norm": (("l1",), lambda c: c["l1"]),
    "l2_norm": (("sumsq",), lambda c: math.sqrt(c["sumsq"])),
    "amax": (("amax",), lambda c: c["amax"]),
    # TE's LogTensorStats also names the current tensor's max |x| "cur_amax" (its
    # "amax" may come from a quantizer's history); here both are this tensor's max |x|.
    "cur_amax": (("amax",), lambda c: c["amax"]),
    "dynamic_range": (("amax", "min_nonzero_abs"), _dynamic_range),
}

FP8_STATS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, float]], float]]] = {
    "underflows%": (("underflows", "numel"), lambda c: 100.0 * c["underflows"] / max(c["numel"], 1.0)),
    "overflows%": (("overflows", "numel"), lambda c: 100.0 * c["overflows"] / max(c["numel"], 1.0)),
    "scale_inv_min": (("scale_inv_min",), lambda c: c["scale_inv_min"]),
    "scale_inv_max": (("scale_inv_max",), lambda c: c["scale_inv_max"]),
    "mse": (("sqerr", "numel"), lambda c: c["sqerr"] / max(c["numel"], 1.0)),
    "scale_inv_std": (("scale_inv_count", "scale_inv_sum", "scale_inv_sumsq"), lambda c: _std(
        {"numel": c["scale_inv_count"], "sum": c["scale_inv_sum"], "sumsq": c["scale_inv_sumsq"]})),
}

ALL_STATS = {**TENSOR_STATS, **FP8_STATS}


def components_for(stats: Iterable[str]) -> set[str]:
    """The components needed for ``stats`` (ValueError for an unknown name)."""
    out: set[str] = set()
    for s in stats:
        if s not in ALL_STATS:
            raise ValueError(f"unknown statistic {s!r}; known: {', '.join(ALL_STATS)}")
        out.update(ALL_STATS[s][0])
    return out


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


@torch.no_grad()
def tensor_components(x: torch.Tensor, names: set[str]) -> dict[str, torch.Tensor]:
    """Components of a high-precision tensor (0-d float64 tensors, no host sync)."""
    x = _f64(x.detach())
    out: dict[str, torch.Tensor] = {}
    if "numel" in names:
        out["numel"] = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    if "sum" in names:
        out["sum"] = x.sum()
    if "sumsq" in names:
        out["sumsq"] = x.square().sum()
    if "l1" in names:
        out["l1"] = x.abs().sum()
    if "min" in names:
        out["min"] = x.amin() if x.numel() else torch.tensor(math.inf, dtype=torch.float64)
    if "max" in names:
        out["max"] = x.amax() if x.numel() else torch.tensor(-math.inf, dtype=torch.float64)
    if "amax" in names:
        out["amax"] = x.abs().amax() if x.numel() else torch.zeros((), dtype=torch.float64)
    if "min_nonzero_abs" in names:
        a = x.abs()
        out["min_nonzero_abs"] = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin() if x.numel() else (
            torch.tensor(math.inf, dtype=torch.float64)
        )
    return out


def simulate_fp8_cast(x: torch.Tensor, quantizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dequantized, scale)`` of ``x`` cast the way ``quantizer`` would cast it now.

    Side-effect free (no amax is recorded): used to report what FP8 *would* do for a
    GEMM that runs in high precision this step. Delayed scaling uses the
    quantizer's current ``scale``; current scaling computes ``fp8_max / amax(x)``
    locally (without the group all-reduce a real cast would do).
    """

    xf = x.detach().to(torch.float32)
    if isinstance(quantizer, CurrentScalingQuantizer):
        scale = scaling.current_scale(xf.abs().amax(), quantizer.fp8_max, quantizer.power_2_scale)
    else:
        scale = quantizer.scale.to(xf.device)
    q = (xf * scale).clamp(-quantizer.fp8_max, quantizer.fp8_max).to(quantizer.fp8_dtype)
    return q.to(torch.float32) / scale, scale


@torch.no_grad()
def block_fp8_components(x: torch.Tensor, q: Any) -> dict[str, torch.Tensor]:
    """FP8 components of a block-scaled cast ``x -> q`` (a ``BlockScaledTensor``, row-wise copy;
    for NVFP4 the block "scale_inv" is the effective decode scale ``e4m3 scale * amax / 2688``):
    underflows, overflows (``|x| * block scale > fp8_max``: saturated), squared error, amax,
    and the min / max / sum / sum of squares / count of the finite block ``scale_inv`` values."""
    p = q.payload("rowwise")
    x64 = _f64(x.detach()).reshape(p.shape)
    d64 = _f64(p.dequantize())
    s_inv = p.scale_inv.to(torch.float32)
    if p.is_fp4:
        # NVFP4: the decode scale of a block is its E4M3 scale times the per-tensor amax / (6 * 448)
        # (6 * 256 for 4over6 tensors that use that bound).
        s_inv = s_inv * (p.amax.to(torch.float32) / (6.0 * p.e4m3_max))
    scale = torch.reciprocal(expand_scales(s_inv, p.spec, p.shape)).to(torch.float64)
    fp8_max = low_precision_max(p.data.dtype)
    blocks = _f64(s_inv[torch.isfinite(s_inv)])
    return {
        "numel": torch.tensor(float(x64.numel()), dtype=torch.float64, device=x64.device),
        "underflows": ((x64 != 0) & (d64 == 0)).sum().to(torch.float64),
        "overflows": ((x64.abs() * scale) > fp8_max).sum().to(torch.float64),
        "sqerr": (d64 - x64).square().sum(),
        "amax": x64.abs().amax() if x64.numel() else torch.zeros((), dtype=torch.float64),
        "scale_inv_min": blocks.min() if blocks.numel() else torch.tensor(math.inf, dtype=torch.float64),
        "scale_inv_max": blocks.max() if blocks.numel() else torch.tensor(-math.inf, dtype=torch.float64),
        "scale_inv_count": torch.tensor(float(blocks.numel()), dtype=torch.float64),
        "scale_inv_sum": blocks.sum(),
        "scale_inv_sumsq": blocks.square().sum(),
    }


@torch.no_grad()
def fp8_components(
    x: torch.Tensor,
    dequantized: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float,
    names: set[str],
) -> dict[str, torch.Tensor]:
    """Components comparing ``x`` with its FP8 round trip ``dequantized`` (scale ``scale``).

    Computed in the cast's own compute dtype (fp32; float64 for float64 inputs), with no
    full-size float64 copies (this runs on whole activations at every log step): the
    overflow test is the cast's ``|x * scale| > fp8_max`` in that dtype, and ``d - x`` is
    exact there wherever ``d`` is within a factor 2 of ``x`` (Sterbenz) or 0 -- every
    element the cast did not saturate -- so the squared error, summed in float64, matches a
    float64 reference to its rounding.
    """
    cdtype = torch.float64 if torch.float64 in (x.dtype, dequantized.dtype) else torch.float32
    xc = x.detach().to(cdtype)
    dc = dequantized.detach().to(cdtype)
    out: dict[str, torch.Tensor] = {}
    if "numel" in names:
        out["numel"] = torch.tensor(float(xc.numel()), dtype=torch.float64, device=xc.device)
    if "underflows" in names:
        out["underflows"] = ((xc != 0) & (dc == 0)).sum().to(torch.float64)
    if "overflows" in names:
        scale_c = scale.detach().reshape(()).to(cdtype)
        out["overflows"] = ((xc.abs() * scale_c) > fp8_max).sum().to(torch.float64)
    if "sqerr" in names:
        diff = (dc - xc).reshape(-1).to(torch.float64)
        out["sqerr"] = torch.dot(diff, diff)
    scale64 = _f64(scale.detach().reshape(()))
    if "scale_inv_min" in names:
        out["scale_inv_min"] = 1.0 / scale64
    if "scale_inv_max" in names:
        out["scale_inv_max"] = 1.0 / scale64
    if "amax" in names:
        out["amax"] = xc.abs().amax().to(torch.float64) if xc.numel() else torch.zeros((), dtype=torch.float64)
    return out


def _merge(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if kind == SUM:
        return a + b.to(a.device)
    if kind == MIN:
        return torch.minimum(a, b.to(a.device))
    return torch.maximum(a, b.to(a.device))


class StatsBuffer:
    """Pending statistics, keyed by record name, grouped by iteration.

    ``add(iteration, key, stats, components)``: merge components of one tensor
    observation (several micro-batches of one iteration merge into one record).
    ``collect(group)``: reduce everything pending across ``group`` (every rank must
    call it at the same point, with the same keys) and return
    ``[(iteration, {f"{key}/{stat}": value})]`` in iteration order.
    """

    def __init__(self) -> None:
        # iteration -> key -> (stats requested, components)
        self._pending: dict[int, dict[str, tuple[tuple[str, ...], dict[str, torch.Tensor]]]] = {}

    def add(
        self,
        iteration: int,
        key: str,
        stats: Iterable[str],
        components: dict[str, torch.Tensor],
        *,
        source: str = "",
        once: bool = False,
    ) -> None:
        """Merge one observation into the record ``key`` of ``iteration``.

        ``source`` (e.g. the feature name) keeps components of different recorders of one
        tensor apart (two features must not both count its elements). ``once``: keep the
        first observation of the iteration only (a weight seen again by every
        micro-batch is one tensor, not several).
        """
        stats = tuple(stats)
        records = self._pending.setdefault(iteration, {})
        key = f"{key}\x00{source}"
        if key not in records:
            records[key] = (stats, dict(components))
            return
        if once:
            return
        old_stats, comps = records[key]
        for name, value in components.items():
            comps[name] = _merge(COMPONENT_REDUCE[name], comps[name], value) if name in comps else value
        records[key] = (tuple(dict.fromkeys(old_stats + stats)), comps)

    def __len__(self) -> int:
        return sum(len(r) for r in self._pending.values())

    def collect(self, group: Optional[dist.ProcessGroup] = None) -> list[tuple[int, dict[str, float]]]:
        """Reduce and finalize all pending records (collective over ``group``)."""
        pending, self._pending = self._pending, {}
        slots: dict[str, list[tuple[int, str, str]]] = {SUM: [], MIN: [], MAX: []}
        values: dict[str, list[torch.Tensor]] = {SUM: [], MIN: [], MAX: []}
        for it in sorted(pending):
            for key in sorted(pending[it]):
                _, comps = pending[it][key]
                for name in sorted(comps):
                    kind = COMPONENT_REDUCE[name]
                    slots[kind].append((it, key, name))
                    values[kind].append(comps[name].reshape(()).to(torch.float64).cpu())
        # Every rank must reduce the same slots in the same order: a checksum of the
        # slot names rides along in the MIN and MAX tensors and must agree.
        layout = "|".join(f"{k}:{i}:{key}:{n}" for k in (SUM, MIN, MAX) for (i, key, n) in slots[k])
        checksum = float(zlib.crc32(layout.encode()))
        reduced: dict[str, torch.Tensor] = {}
        world = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        for kind, op in ((SUM, "SUM"), (MIN, "MIN"), (MAX, "MAX")):
            extra = [torch.tensor(checksum, dtype=torch.float64)] if kind != SUM else []
            flat = torch.stack(values[kind] + extra) if values[kind] or extra else torch.zeros(0, dtype=torch.float64)
            if world:
                device = _collective_device(group)
                flat_dev = flat.to(device)
                check_collective("all_reduce", [flat_dev], world_size=dist.get_world_size(group),
                                 op=getattr(dist.ReduceOp, op))
                dist.all_reduce(flat_dev, op=getattr(dist.ReduceOp, op), group=group)
                flat = flat_dev.cpu()
            reduced[kind] = flat
        if reduced[MIN][-1].item() != reduced[MAX][-1].item():
            raise RuntimeError(
                "StatsBuffer.collect: ranks recorded different statistics (the debug/FP8-stats "
                "configuration or the model differs across ranks)"
            )
        comps: dict[tuple[int, str], dict[str, float]] = {}
        for kind in (SUM, MIN, MAX):
            for (it, key, name), v in zip(slots[kind], reduced[kind].tolist()):
                comps.setdefault((it, key), {})[name] = v
        out: dict[int, dict[str, float]] = {}
        for it in sorted(pending):
            for key in sorted(pending[it]):
                stats, _ = pending[it][key]
                c = comps[(it, key)]
                rec = out.setdefault(it, {})
                name = key.split("\x00", 1)[0]
                for stat in stats:
                    rec[f"{name}/{stat}"] = float(ALL_STATS[stat][1](c))
        return sorted(out.items())


def _collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
