"""The peak FLOP/s that MFU divides by, and where it comes from.

A wrong peak makes MFU meaningless (issue 25: one 512^3 matmul timed at start-up on a
busy machine gave peaks from 1.3 to 186 GFLOP/s for the same command, and two ranks on
two cores "measured" more than the machine can do). So the peak comes from one of:

* ``trainer.peak_flops=<FLOP/s>`` -- the user's peak of one rank's device (the job's
  peak is ``world_size`` times it);
* CUDA: the vendor's dense data-sheet peak of known GPUs for the training dtype
  (bfloat16; float32 with or without TF32 matmuls); other GPUs and dtypes: n/a;
* CPU: a measurement (:func:`measure_cpu_peak`): every trial starts on all ranks at once
  (a barrier) and runs the same number of matmuls; its rate counts the slowest rank's
  time, so ranks sharing cores divide them and the sum can never exceed the machine;
  the best of several trials is kept. The per-rank result is cached per machine, dtype,
  ranks on the machine and threads per rank (:class:`PeakCache`, a small JSON file under
  the user's cache directory) so later runs reuse a measurement instead of repeating a
  noisy one; ``trainer.peak_flops=remeasure`` measures again and replaces it.

MFU above 100% means the peak is wrong: :class:`tp_fuse.launch.logging.report.StepMeter`
then stops showing MFU and drops the cached measurement (:meth:`PeakFlops.forget`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from tp_fuse.safe_files import read_regular_file, write_atomic

__all__ = ["PeakCache", "PeakFlops", "CpuProbe", "cuda_datasheet_peak", "default_cache_dir", "machine_key",
           "measure_cpu_peak"]

#: Dense peaks (FLOP/s) from the vendors' data sheets, by device-name substring (first match
#: wins: the specific names come before "H100"). ``tf32``: float32 matmuls on tensor cores
#: (``torch.backends.cuda.matmul.allow_tf32``); ``float32``: without them.
_CUDA_PEAK: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12},
    "H100 SXM": {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12},
    "H100 NVL": {"bfloat16": 835e12, "tf32": 418e12, "float32": 60e12},
    "H100 PCIe": {"bfloat16": 756e12, "tf32": 378e12, "float32": 51e12},
    "H100": {"bfloat16": 989e12, "tf32": 494e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "tf32": 183e12, "float32": 91.6e12},
    "A10G": {"bfloat16": 70e12},
}

#: The cache file is a few hundred bytes per entry; anything larger is not ours.
_CACHE_LIMIT_BYTES = 64 * 1024
#: Entries kept in the cache file (oldest dropped), so it stays small on shared home directories.
_CACHE_MAX_ENTRIES = 32
#: No CPU does a PFLOP/s: a cached value above this is damaged, not a measurement.
_CPU_PEAK_SANITY = 1e15


def cuda_datasheet_peak(name: str, dtype: torch.dtype, tf32: bool) -> tuple[Optional[float], str]:
    """``(FLOP/s of one GPU, what it is)`` from the data-sheet table; ``(None, why)`` if unknown."""
    key = {torch.bfloat16: "bfloat16", torch.float32: "tf32" if tf32 else "float32"}.get(dtype)
    if key is None:
        return None, f"no data-sheet peak for training dtype {dtype}"
    gpu = next((k for k in _CUDA_PEAK if k in name), None)
    if gpu is None:
        return None, f"no data-sheet peak known for {name}; set trainer.peak_flops"
    peak = _CUDA_PEAK[gpu].get(key)
    if peak is None:
        return None, f"no data-sheet {key} peak known for {name}; set trainer.peak_flops"
    return peak, f"{name} dense {key}, data sheet"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/tp-fuse`` (default ``~/.cache/tp-fuse``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tp-fuse")


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        text = read_regular_file("/proc/cpuinfo", 4 << 20, "cpu info", follow_symlinks=True).decode(errors="replace")
    except (OSError, ValueError):
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_key(dtype: torch.dtype, ranks_on_machine: int, threads: int) -> str:
    """Cache key: this machine (host, CPU model, CPU count), dtype, and how the cores are shared."""
    dt = str(dtype).replace("torch.", "")
    return (f"{socket.gethostname()}|{_cpu_model()}|{os.cpu_count()} cpus|{dt}|{ranks_on_machine} ranks x "
            f"{threads} threads|torch {torch.__version__.split('+')[0]}")


class PeakCache:
    """Per-rank CPU peaks measured before, in ``<directory>/cpu_peak.json``.

    Reads are bounded and refuse links and special files; a damaged, foreign or
    implausible entry reads as missing (it is measured again and replaced). Writes are
    atomic. Failures to write (read-only home) only cost a measurement next time.
    """

    FILE = "cpu_peak.json"

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, self.FILE)

    def _read_all(self) -> dict[str, Any]:
        try:
            data = json.loads(read_regular_file(self.path, _CACHE_LIMIT_BYTES, "peak cache").decode())
        except (OSError, ValueError):  # missing, a link, too large, not JSON: nothing cached
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Optional[tuple[float, float]]:
        """``(FLOP/s per rank, measured at (epoch s))`` for ``key``, or None."""
        entry = self._read_all().get(key)
        if not isinstance(entry, dict):
            return None
        value, when = entry.get("flops_per_rank"), entry.get("measured_at")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, when)):
            return None
        if not (math.isfinite(value) and 0 < value < _CPU_PEAK_SANITY and math.isfinite(when)):
            return None
        return float(value), float(when)

    def put(self, key: str, flops_per_rank: float, when: float) -> Optional[str]:
        """Store an entry; returns None, or why it could not be written."""
        return self._write(key, {"flops_per_rank": flops_per_rank, "measured_at": when})

    def forget(self, key: str) -> Optional[str]:
        """Drop ``key``'s entry (the next run measures again); None, or why it failed."""
        return self._write(key, None)

    def _write(self, key: str, entry: Optional[dict[str, float]]) -> Optional[str]:
        data = {k: v for k, v in self._read_all().items() if k != key and isinstance(v, dict)}
        if entry is not None:
            data[key] = entry
        # Bounded: keep the newest entries only.
        newest = sorted(data.items(), key=lambda kv: kv[1].get("measured_at", 0)
                        if isinstance(kv[1].get("measured_at", 0), (int, float)) else 0)[-_CACHE_MAX_ENTRIES:]
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomic(self.path, json.dumps(dict(newest), indent=1, sort_keys=True), fsync=False)
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        return None


@dataclass
class CpuProbe:
    """How :func:`measure_cpu_peak` measures (tests inject a fake clock and matmul).

    ``trials`` timed trials of ``reps`` ``n x n`` matmuls each, where ``reps`` makes a trial
    last at least ``min_trial_s`` (calibrated once on an untimed warm-up).
    """

    n: int = 512
    trials: int = 5
    min_trial_s: float = 0.05
    clock: Callable[[], float] = time.perf_counter
    matmul: Callable[[torch.Tensor, torch.Tensor], Any] = torch.mm


def measure_cpu_peak(dtype: torch.dtype, group: Optional[dist.ProcessGroup], world_size: int,
                     probe: Optional[CpuProbe] = None) -> float:
    """FLOP/s of one rank while all ranks run matmuls together: best trial (see module docstring).

    Collective: every rank of ``group`` must call it.
    """
    probe = probe or CpuProbe()
    n = probe.n
    # A private generator: the global stream must be where a resumed checkpoint left it
    # (NVFP4's stochastic rounding draws its seeds from it).
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    flop = 2.0 * n**3
    t0 = probe.clock()
    probe.matmul(a, b)  # warm-up (first-call allocation and thread start-up), also the calibration
    one = max(probe.clock() - t0, 1e-9)
    reps = torch.tensor([max(1, math.ceil(probe.min_trial_s / one))], dtype=torch.float64)
    if world_size > 1:  # the same work on every rank, or a fast rank's trial would end alone
        dist.all_reduce(reps, op=dist.ReduceOp.MAX, group=group)
    count = int(reps.item())
    best = 0.0
    for _ in range(probe.trials):
        if world_size > 1:
            dist.barrier(group=group)
        start = probe.clock()
        for _ in range(count):
            probe.matmul(a, b)
        elapsed = torch.tensor([max(probe.clock() - start, 1e-12)], dtype=torch.float64)
        if world_size > 1:  # the trial lasts until its slowest rank is done
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        best = max(best, count * flop / float(elapsed.item()))
    return best


@dataclass
class PeakFlops:
    """The job's peak FLOP/s (all ranks) and where it comes from; ``value`` None = n/a.

    ``cache``/``cache_key`` name the cached measurement it came from (CPU), so that an
    impossible MFU can drop it (:meth:`forget`).
    """

    value: Optional[float]
    source: str
    #: Where the peak comes from, in a few words (the end-of-run summary).
    kind: str = "unknown"
    cache: Optional[PeakCache] = field(default=None, repr=False)
    cache_key: Optional[str] = None

    @property
    def short(self) -> str:
        """``171.5 GFLOP/s (data sheet)``, or ``n/a``."""
        return f"{_fmt_flops(self.value)} ({self.kind})" if self.value is not None else "n/a"

    def forget(self) -> Optional[str]:
        """Drop the cached measurement this peak came from; a line saying so, or None."""
        if self.cache is None or self.cache_key is None:
            return None
        problem = self.cache.forget(self.cache_key)
        if problem is not None:
            return f"could not drop the cached peak ({problem})"
        return f"the cached peak was dropped from {self.cache.path}; the next run measures again"

    @classmethod
    def detect(cls, device: torch.device, dtype: torch.dtype, world_group: Optional[dist.ProcessGroup],
               world_size: int, *, user_peak: Union[None, float, str] = None, ranks_on_machine: int = 1,
               local_rank: int = 0, cache_dir: Optional[str] = None, probe: Optional[CpuProbe] = None,
               now: Callable[[], float] = time.time) -> "PeakFlops":
        """The peak for this job (collective on CPU: every rank calls it).

        Args:
            user_peak: ``trainer.peak_flops``: FLOP/s of one rank, ``"remeasure"`` (CPU: measure
                and replace the cached value), or None (data sheet / cached or new measurement).
            ranks_on_machine, local_rank: ranks sharing this machine's cores, and this one's
                index among them (the lowest writes the cache).
            cache_dir: where the CPU peak is cached (default :func:`default_cache_dir`).
        """
        if isinstance(user_peak, (int, float)) and not isinstance(user_peak, bool):
            total = float(user_peak) * world_size
            return cls(total, f"{_fmt_flops(total)} = {world_size} rank(s) x trainer.peak_flops={user_peak:g} "
                              "(set by the user)", "trainer.peak_flops")
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            peak, what = cuda_datasheet_peak(name, dtype, torch.backends.cuda.matmul.allow_tf32)
            if peak is None:
                return cls(None, f"n/a ({what})")
            return cls(peak * world_size, f"{_fmt_flops(peak * world_size)} = {world_size} x "
                                          f"{_fmt_flops(peak)} ({what})", "data sheet")
        if device.type != "cpu":
            return cls(None, f"n/a (device {device.type}; set trainer.peak_flops)")
        return cls._cpu(dtype, world_group, world_size, remeasure=user_peak == "remeasure",
                        ranks_on_machine=ranks_on_machine, local_rank=local_rank,
                        cache=PeakCache(cache_dir or default_cache_dir()), probe=probe or CpuProbe(), now=now)

    @classmethod
    def _cpu(cls, dtype: torch.dtype, group: Optional[dist.ProcessGroup], world_size: int, *, remeasure: bool,
             ranks_on_machine: int, local_rank: int, cache: PeakCache, probe: CpuProbe,
             now: Callable[[], float]) -> "PeakFlops":
        key = machine_key(dtype, ranks_on_machine, torch.get_num_threads())
        cached = None if remeasure else cache.get(key)
        # [per-rank peak, 1 if this rank has a cached value]: all ranks must agree to use the cache.
        mine = torch.tensor([cached[0] if cached else 0.0, 1.0 if cached else 0.0], dtype=torch.float64)
        have_all = torch.tensor([mine[1].item()], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(have_all, op=dist.ReduceOp.MIN, group=group)
        dt = str(dtype).replace("torch.", "")
        what = f"CPU {dt} {probe.n}^3 matmuls, best of {probe.trials} trials on all {world_size} rank(s) at once"
        kind = "CPU peak measured now"
        if have_all.item() > 0:
            kind = "CPU peak measured before, cached"
            assert cached is not None
            stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(cached[1]))
            how = f"measured {stamp}, cached in {cache.path}; trainer.peak_flops=remeasure measures again"
        else:
            mine[0] = measure_cpu_peak(dtype, group, world_size, probe)
            problem = cache.put(key, float(mine[0]), now()) if local_rank == 0 else None
            how = ("measured now, " + (f"not cached: {problem}" if problem else f"cached in {cache.path}")
                   + "; trainer.peak_flops=remeasure measures again")
        total = torch.tensor([float(mine[0])], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(total, group=group)
        value = float(total.item())
        return cls(value, f"{_fmt_flops(value)} ({what}; {how})", kind, cache, key)


def _fmt_flops(v: float) -> str:
    return f"{v / 1e12:.1f} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.1f} GFLOP/s"
