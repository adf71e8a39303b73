"""What a practitioner looks for in a training log: model size, throughput, MFU, ETA, memory.

* :func:`count_parameters` -- total (unsharded) and per-rank parameter counts.
* :func:`flops_per_token` -- the model FLOPs of one training token (forward + backward)::

      6 * (L * (qkv + proj + fc1 + fc2) + vocab * hidden)   # weight GEMMs, fwd (2) + bwd (4)
      + 12 * L * num_heads * head_dim * seq_len              # attention scores and values

  with ``qkv = hidden * (num_heads + 2 * kv_groups) * head_dim``,
  ``proj = num_heads * head_dim * hidden``, ``fc1 = hidden * ffn (x2 for SwiGLU)``,
  ``fc2 = ffn * hidden``; ``num_heads * head_dim`` is ``hidden`` except for Hugging Face
  models whose config.json sets ``head_dim`` apart (Gemma, Qwen3); embeddings lookups,
  norms, biases and activations are not counted and the causal mask (or a sliding
  window) is not discounted (the PaLM / Megatron convention).
* :class:`PeakFlops` -- the peak the MFU divides by (``tp_fuse.launch.logging.peak``: the
  user's ``trainer.peak_flops``, the data sheet of known GPUs, or a cached CPU measurement).
* :class:`StepMeter` -- step time, tokens/s, MFU, ETA and peak memory for the log line, and
  the totals of the end-of-run summary; :func:`format_eta` -- ``21m49s``.
"""

from __future__ import annotations

import resource
import sys
import statistics
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tp_fuse.layers import GPTConfig, get_shard_spec

from .peak import PeakFlops

__all__ = ["PeakFlops", "StepMeter", "count_parameters", "flops_per_token", "format_eta", "peak_memory_bytes"]

#: Step times the ETA looks at: recent enough to follow a changing load, enough for a median.
ETA_WINDOW = 20


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


def flops_per_token(gpt: GPTConfig, seq_len: int, head_dim: Optional[int] = None) -> float:
    """Model FLOPs of one training token (forward + backward); formula in the module docstring.
    ``head_dim``: the attention head width where it is not ``gpt.head_dim`` (hidden / heads):
    a Hugging Face config.json's ``head_dim`` (``tp_fuse.launch.models.hf_config.attention_head_dim``)."""
    h = gpt.hidden_size
    d = head_dim or gpt.head_dim
    qkv = h * (gpt.num_heads + 2 * gpt.kv_groups) * d
    proj = gpt.num_heads * d * h
    fc1 = h * gpt.ffn_size * (2 if gpt.activation == "swiglu" else 1)
    fc2 = gpt.ffn_size * h
    weights = gpt.num_layers * (qkv + proj + fc1 + fc2) + gpt.vocab_size * h
    return 6.0 * weights + 12.0 * gpt.num_layers * gpt.num_heads * d * seq_len


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: CUDA peak allocated memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "peak RSS"




class StepMeter:
    """Throughput numbers for the log line and metrics.jsonl, and the run's totals.

    Args:
        tokens_per_step: global batch tokens of one optimizer step.
        flops_per_token: :func:`flops_per_token`.
        peak: the job's peak (:class:`PeakFlops`).
        max_steps, start_step: for the ETA.
        warn: where to say (once) that MFU stopped being shown (rank 0); None elsewhere.
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: PeakFlops, max_steps: int,
                 start_step: int, warn: Optional[Callable[[str], None]] = None) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.max_steps = max_steps
        self._times: list[float] = []
        self._start_step = start_step
        self._warn = warn
        #: Why MFU is not shown although a peak exists (an MFU above 100% proved the peak wrong).
        self.mfu_withdrawn: Optional[str] = None

    def _mfu(self, tokens_per_s: float) -> Optional[float]:
        """MFU against the peak, None when it is unknown or was proven wrong.

        Above 100% the peak is wrong (no step can beat the hardware): clamping would print a
        made-up number, so MFU is withdrawn for the rest of the run, and a cached
        measurement is dropped so the next run measures again.
        """
        if self.peak.value is None or self.mfu_withdrawn is not None:
            return None
        mfu = tokens_per_s * self.flops_per_token / self.peak.value
        if mfu <= 1.0:
            return mfu
        self.mfu_withdrawn = (f"MFU would be {mfu:.0%}, above 100%: the peak it divides by ({self.peak.source}) "
                              "is too low for this machine")
        if self._warn is not None:
            dropped = self.peak.forget()
            self._warn(f"WARNING: {self.mfu_withdrawn}; MFU is not shown for the rest of this run. Set "
                       "trainer.peak_flops to the real peak FLOP/s of one rank"
                       + (f" ({dropped})" if dropped else ""))
        return None

    def metrics(self, step: int, step_time: float, device: torch.device) -> dict[str, float]:
        """Metrics of ``step`` (its wall time ``step_time``).

        The ETA is the median of the last :data:`ETA_WINDOW` step times, leaving out this
        process's first step (start-up: fusion decisions, allocation) once there are
        others: a median ignores the odd slow step (validation, a checkpoint, a load spike)
        that a mean since the start would carry into every later estimate.
        """
        self._times.append(step_time)
        times = self._times[1:] or self._times
        typical = statistics.median(times[-ETA_WINDOW:])
        tokens_per_s = self.tokens_per_step / step_time
        out = {
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "eta_s": typical * (self.max_steps - step),
        }
        mfu = self._mfu(tokens_per_s)
        if mfu is not None:
            out["mfu"] = mfu
        mem, _ = peak_memory_bytes(device)
        out["peak_mem_gib"] = mem / 2**30
        return out

    def totals(self) -> dict[str, float]:
        """Totals over the steps this process ran (for the end-of-run summary).

        ``steps``, ``total_s`` (sum of step times), ``mean_step_s`` (leaving out the first
        step when there are others), ``tokens_per_s`` (all tokens / total time) and ``mfu``
        (from that rate; absent when the peak is unknown or was withdrawn).
        """
        out: dict[str, float] = {"steps": float(len(self._times))}
        if not self._times:
            return out
        total = sum(self._times)
        steady = self._times[1:] or self._times
        out.update(total_s=total, mean_step_s=sum(steady) / len(steady),
                   tokens_per_s=self.tokens_per_step * len(self._times) / total)
        if self.peak.value is not None and self.mfu_withdrawn is None:
            mfu = out["tokens_per_s"] * self.flops_per_token / self.peak.value
            if mfu <= 1.0:  # every step was <= 100%, so the mean is too; checked anyway
                out["mfu"] = mfu
        return out


def format_eta(seconds: float) -> str:
    """A duration that cannot be read as a clock time: ``45s``, ``21m49s``, ``2h03m07s``."""
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"
