"""Process start-up for a training run: run directory, process groups, device, dtype.

Run directory. Hydra picks ``outputs/<date>/<time>`` in every process; under
torchrun the ranks would disagree by a second and each write its own files. So:

* :func:`rank_overrides` (applied to ``sys.argv`` before Hydra starts) tells Hydra on
  ranks != 0 to create nothing (no ``.hydra/`` dir, no log file, run dir ``.``).
* Under torchrun, when the user did not set ``hydra.run.dir``, every rank gets the same
  deterministic default derived from the torchrun agent (its PID and start time, read
  from ``/proc``): identical on all local ranks, and the same after an elastic restart
  (the agent survives restarts), so a restarted run continues in its directory and
  finds its checkpoints.
* After the process group exists, rank 0's run directory is broadcast and is the only
  one used (:func:`start`).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm import DistributedContext, ParallelTopology, backend_for_device, init_distributed

from .config import ParallelLayout, TrainConfig

__all__ = ["Runtime", "env_rank", "env_world_size", "job_key", "rank_overrides", "restart_count", "start"]


def env_rank() -> int:
    """This process's global rank from torchrun's environment (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """World size from torchrun's environment (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_count() -> int:
    """How many times torchrun restarted the workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _agent_stamp() -> Optional[str]:
    """``<date>/<time>-<pid>`` of the torchrun agent (our parent), or None off Linux.

    Wall-clock start = boot time (``/proc/stat`` btime) + the parent's start tick
    (``/proc/<ppid>/stat`` field 22) / ``CLK_TCK``.
    """
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        start = btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(start)) + f"-{ppid}"


def job_key(rt: "Runtime") -> str:
    """Identifies this job: the same in every elastic restart of one torchrun job, new in the next.

    Under torchrun: host, torchrun's run id and the agent's start stamp (the agent
    survives restarts). Without torchrun every process is its own job.
    """
    host = socket.gethostname()
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return f"{host}:{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{_agent_stamp()}"
    return f"{host}:pid{os.getpid()}:{time.time_ns()}"


def rank_overrides(argv: list[str]) -> list[str]:
    """Extra Hydra overrides for this process (appended after the user's)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ and "RANK" not in os.environ:
        return []  # plain `python launch/train.py`: Hydra's defaults
    user_set_dir = any(a.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for a in argv)
    if env_rank() != 0:
        # Ranks != 0 create nothing; rank 0's directory is broadcast after start-up.
        return [
            "hydra.run.dir=.",
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    if user_set_dir:
        return []
    stamp = _agent_stamp()
    return [f"hydra.run.dir=outputs/{stamp}"] if stamp is not None else []


@dataclasses.dataclass
class Runtime:
    """Everything process-level a training run needs, created once by :func:`start`.

    Attributes:
        dist: the process-group context (shut down by :meth:`shutdown`).
        topology: (dp, tp) layout with the TP/DP/FP8 groups.
        layout: the validated sizes.
        device, dtype: where and in what precision the model computes.
        run_dir: the run directory shared by all ranks (absolute).
    """

    dist: DistributedContext
    topology: ParallelTopology
    layout: ParallelLayout
    device: torch.device
    dtype: torch.dtype
    run_dir: str
    #: Called (last added first) by :meth:`shutdown` and :meth:`abort`: what the job holds
    #: until it ends, e.g. the checkpoint directory's lock.
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list, repr=False)
    #: When the default group was already there (``tp_fuse.launch.api.train`` called in a
    #: process that keeps its group, e.g. one training after another): the groups that
    #: existed before this run, so that :meth:`shutdown` destroys the ones the run made.
    groups_before: Optional[frozenset] = dataclasses.field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def is_rank0(self) -> bool:
        return self.dist.rank == 0

    def barrier(self) -> None:
        dist.barrier(group=self.topology.world_group)

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the job ends (:meth:`shutdown` or :meth:`abort`), once."""
        self.cleanups.append(fn)

    def _run_cleanups(self) -> None:
        while self.cleanups:
            self.cleanups.pop()()

    def shutdown(self) -> None:
        self._run_cleanups()
        if self.groups_before is not None:
            # The TP/DP subgroups and device meshes of this run: each gloo group holds
            # sockets and threads, and nothing else frees them while the default group
            # lives (14 train() runs in one process: 40 -> 278 open files, 20 -> 167
            # threads per rank). The model and topology still reference them; the run is
            # over, so nothing uses them again. (Not on abort: a group with work in flight
            # may block its destruction.)
            for group in _process_groups() - self.groups_before:
                dist.destroy_process_group(group)
            self.groups_before = None
            gc.collect()  # the groups sit in reference cycles (model <-> hooks, meshes)
        self.dist.shutdown()

    def abort(self) -> None:
        """Tear the process group down after an error on this rank, so that peers blocked
        in a collective with it fail at once ("connection closed by peer") instead of
        waiting for ``parallel.timeout_s``."""
        try:
            self._run_cleanups()
        finally:
            self.dist.abort()


def _process_groups() -> frozenset:
    """Every live process group but the default one. (torch has no public listing;
    ``_world.pg_map`` is what ``destroy_process_group`` itself walks.)"""
    if not dist.is_initialized():
        return frozenset()
    world = dist.group.WORLD
    return frozenset(g for g in dist.distributed_c10d._world.pg_map if g is not world)


def _device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but CUDA is not available (use trainer.device=auto or cpu)")
    return requested


def _dtype(requested: str, device_type: str) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]


def _init_torchrun_group(device_type: str, timeout: timedelta) -> bool:
    """Start the default group on torchrun's store, under a per-attempt key prefix.

    Returns True if it created the group (False: not under torchrun, or one exists).
    Why not plain ``env://``: torchrun's agent keeps its store across elastic restarts,
    and gloo's connection keys of the crashed attempt are still there; a restarted rank
    can read a dead peer's address and fail with "connectFullMesh ... Connection
    refused" (seen with torch 2.13, about every other restart). A prefix per
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt fresh keys.
    """
    if dist.is_initialized() or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return False
    rank, world = env_rank(), env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)  # NCCL binds to the current device
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent_store, timeout=timeout,
    )
    prefixed = dist.PrefixStore(f"tp_fuse/attempt_{restart_count()}", store)
    dist.init_process_group(backend_for_device(device_type), store=prefixed, rank=rank, world_size=world,
                            timeout=timeout)
    return True


def _free_process_groups_before_finalization() -> None:
    """atexit: destroy the ProcessGroup objects still alive while the interpreter is intact.

    Why (issue 24, the intermittent ``terminate called without an active exception`` of
    rank 1 at exit, SIGABRT): ``destroy_process_group`` unregisters the groups, but the
    TP/DP subgroups stay referenced by the model and topology, often in reference cycles
    that only the interpreter's final garbage collection frees. A gloo worker thread drops
    its reference to a finished collective (e.g. the last ``broadcast_object_list``) a
    moment after the caller's ``wait()`` returned; its tensors have Python objects, so it
    needs the GIL. When the main thread reaches ``Py_FinalizeEx`` before the worker got
    the GIL (rank 1 has little left to do after the last save; the abort was never seen
    on rank 0), CPython ends the worker with a forced unwind through a ``noexcept`` C++
    destructor: ``std::terminate``. A core dump shows exactly that (worker in
    ``AsyncBroadcastWork::~AsyncBroadcastWork`` -> ``take_gil`` -> ``pthread_exit``, main
    thread in the finalization GC). atexit handlers run before finalization starts: the
    collection here frees those cycles (and a traceback kept in ``sys.last_*``), and
    torch destroys a ProcessGroupGloo with the GIL released, joining its worker threads,
    which can then take the GIL and finish.
    """
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    gc.collect()


def start(cfg: TrainConfig, layout: ParallelLayout, proposed_run_dir: str) -> Runtime:
    """Initialize process groups and the topology; agree on rank 0's run directory.

    ``layout`` was validated against torchrun's ``WORLD_SIZE`` before this call; a
    mismatch with the actual group is an internal error of the launch environment.
    """
    device_type = _device_type(cfg.trainer.device)
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    atexit.unregister(_free_process_groups_before_finalization)  # once, however often start() runs
    atexit.register(_free_process_groups_before_finalization)
    created = _init_torchrun_group(device_type, timeout)
    ctx = init_distributed(device_type=device_type, timeout=timeout)
    # comm describes a group it did not create; the runtime then owns it.
    ctx.owns_group = ctx.owns_group or created
    groups_before = None if ctx.owns_group else _process_groups()
    if ctx.world_size != layout.world_size:
        ctx.shutdown()
        raise ValueError(
            f"the process group has {ctx.world_size} ranks but WORLD_SIZE said {layout.world_size}"
        )
    topology = ParallelTopology(tp=layout.tp, dp=layout.dp, device_type=ctx.device.type)
    box = [os.path.abspath(proposed_run_dir)]
    if ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    run_dir = box[0]
    if ctx.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
    if ctx.world_size > 1:
        dist.barrier()
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    print_rank0 = ctx.rank == 0
    if print_rank0:
        print(f"[tp-fuse] {topology} device={ctx.device} backend={ctx.backend} run_dir={run_dir}",
              file=sys.stderr, flush=True)
    return Runtime(
        dist=ctx,
        topology=topology,
        layout=layout,
        device=ctx.device,
        dtype=_dtype(cfg.trainer.dtype, ctx.device.type),
        run_dir=run_dir,
        groups_before=groups_before,
    )
