"""What a practitioner looks for in a training log: model size, throughput, MFU, ETA, memory.

* :func:`count_parameters` -- total (unsharded) and per-rank parameter counts.
* :func:`flops_per_token` -- the model FLOPs of one training token (forward + backward)::

      6 * (L * (qkv + proj + fc1 + fc2) + vocab * hidden)   # weight GEMMs, fwd (2) + bwd (4)
      + 12 * L * hidden * seq_len                            # attention scores and values

  with ``qkv = hidden * (num_heads + 2 * kv_groups) * head_dim``, ``proj = hidden^2``,
  ``fc1 = hidden * ffn (x2 for SwiGLU)``, ``fc2 = ffn * hidden``; embeddings lookups,
  norms, biases and activations are not counted and the causal mask is not discounted
  (the PaLM / Megatron convention).
* :class:`PeakFlops` -- the peak the MFU divides by: on CUDA the vendor's dense bf16 peak
  of known GPUs (others: n/a); on CPU a float32 matmul measured once at start-up on every
  rank at the same time (so ranks sharing cores share the measured peak).
* :class:`StepMeter` -- step time, tokens/s, MFU, ETA and peak memory for the log line.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.layers import GPTConfig, get_shard_spec

__all__ = ["PeakFlops", "StepMeter", "count_parameters", "flops_per_token", "peak_memory_bytes"]

#: Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, by device-name substring.
_CUDA_BF16_PEAK = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


@torch.no_grad()
def count_parameters(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup], tp_size: int) -> tuple[int, int]:
    """``(total, this rank)`` parameter counts; TP shards are summed over the TP group."""
    sharded = replicated = 0
    for p in model.parameters():
        if get_shard_spec(p) is not None:
            sharded += p.numel()
        else:
            replicated += p.numel()
    per_rank = sharded + replicated
    if tp_size > 1:
        t = torch.tensor([sharded], dtype=torch.float64, device=next(model.parameters()).device)
        dist.all_reduce(t, group=tp_group)
        sharded = int(t.item())
    return sharded + replicated, per_rank


def flops_per_token(gpt: GPTConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward); formula in the module docstring."""
    h = gpt.hidden_size
    qkv = h * (gpt.num_heads + 2 * gpt.kv_groups) * gpt.head_dim
    proj = gpt.num_heads * gpt.head_dim * h
    fc1 = h * gpt.ffn_size * (2 if gpt.activation == "swiglu" else 1)
    fc2 = gpt.ffn_size * h
    weights = gpt.num_layers * (qkv + proj + fc1 + fc2) + gpt.vocab_size * h
    return 6.0 * weights + 12.0 * gpt.num_layers * h * seq_len


def _measure_cpu_flops(n: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 ``n x n`` matmul rate of this process (its threads)."""
    # A private generator: the global stream must be where a resumed checkpoint left it
    # (NVFP4's stochastic rounding draws its seeds from it).
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


@dataclass
class PeakFlops:
    """The job's peak FLOP/s (all ranks) and where it comes from; ``value`` None = n/a."""

    value: Optional[float]
    source: str

    @classmethod
    def detect(cls, device: torch.device, dtype: torch.dtype, world_group: Optional[dist.ProcessGroup],
               world_size: int) -> "PeakFlops":
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            if dtype != torch.bfloat16:
                return cls(None, f"n/a (known peaks are bf16 tensor-core peaks; training dtype {dtype})")
            peak = next((v for k, v in _CUDA_BF16_PEAK.items() if k in name), None)
            if peak is None:
                return cls(None, f"n/a (no peak known for {name})")
            return cls(peak * world_size, f"{world_size} x {peak / 1e12:.0f} TFLOP/s ({name} dense bf16, data sheet)")
        if device.type == "cpu":
            # Every rank measures at the same moment: ranks sharing cores share the peak.
            mine = torch.tensor([_measure_cpu_flops()], dtype=torch.float64)
            if world_size > 1:
                dist.all_reduce(mine, group=world_group)
            total = float(mine.item())
            return cls(total, f"{total / 1e9:.1f} GFLOP/s (float32 512^3 matmul measured at start-up on all "
                              f"{world_size} rank(s) at once)")
        return cls(None, f"n/a (device {device.type})")


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: CUDA peak allocated memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "peak RSS"


class StepMeter:
    """Throughput numbers for the log line and metrics.jsonl.

    Args:
        tokens_per_step: global batch tokens of one optimizer step.
        flops_per_token: :func:`flops_per_token`.
        peak: the job's peak (:class:`PeakFlops`).
        max_steps, start_step: for the ETA.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: PeakFlops, max_steps: int,
                 start_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.max_steps = max_steps
        self._times: list[float] = []
        self._start_step = start_step

    def metrics(self, step: int, step_time: float, device: torch.device) -> dict[str, float]:
        """Metrics of ``step`` (its wall time ``step_time``); the ETA uses the mean step time
        since the start, leaving out the first step (start-up: fusion decisions, allocation)."""
        self._times.append(step_time)
        times = self._times[1:] or self._times
        mean = sum(times) / len(times)
        tokens_per_s = self.tokens_per_step / step_time
        out = {
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "eta_s": mean * (self.max_steps - step),
        }
        if self.peak.value is not None:
            out["mfu"] = tokens_per_s * self.flops_per_token / self.peak.value
        mem, _ = peak_memory_bytes(device)
        out["peak_mem_gib"] = mem / 2**30
        return out


def format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
