"""Private multi-process runner for the comm tests (until tests/dist_utils.py exists).

``run_distributed(world_size, fn, *args, timeout=...)`` spawns ``world_size`` processes
once, rendezvouses them through a ``file://`` store in a fresh temporary directory (no
fixed path or port), calls ``fn(rank, world_size, *args)`` in each, and returns the
per-rank return values. A child's exception is re-raised in pytest with the child's
traceback; a child that dies without reporting or a run that exceeds ``timeout`` kills all
children and fails instead of hanging.

``fn`` must be a module-level (picklable) function. Each child is limited to one intra-op
thread: several ranks share this machine's cores, and oversubscription would make the
tests slow, not more thorough.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _child(rank: int, world_size: int, init_file: str | None, backend: str, timeout: float,
           fn: Callable[..., Any], args: tuple, results: Any) -> None:  # fmt: skip
    import faulthandler

    import torch.distributed as dist

    # If the parent is about to time out, leave every thread's stack on stderr first.
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False)
    try:
        torch.set_num_threads(1)
        if init_file is not None:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if init_file is not None and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 60.0,
    init_process_group: bool = True,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="comm_test_") as tmp:
        init_file = os.path.join(tmp, "store") if init_process_group else None
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, init_file, backend, timeout, fn, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        failures: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(failures) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                    if dead and results.empty():
                        time.sleep(0.5)  # let a dying child's last report arrive
                        if results.empty():
                            codes = {i: procs[i].exitcode for i in dead}
                            raise RuntimeError(f"ranks died without reporting (exit codes {codes})")
                    continue
                if ok:
                    out[rank] = value
                else:
                    failures.append(f"--- rank {rank} ---\n{value}")
                    break  # one failure is enough; peers may now block forever
            if failures:
                raise RuntimeError("child process failed:\n" + "\n".join(failures))
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]
