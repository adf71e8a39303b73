"""Run a function on N local ranks (CPU, gloo) from a pytest test.

Usage::

    from dist_utils import run_distributed

    def _cases(rank: int, world_size: int, scale: float) -> dict:
        # torch.distributed is initialized here (gloo, world_size ranks).
        ...                       # run many cases; assert freely
        return {"rank": rank}     # any picklable value

    def test_something():
        results = run_distributed(2, _cases, 3.0, timeout=60)   # one start
        assert results[0] == {"rank": 0}

Rules of the game:

* ``fn`` must be picklable: a module-level function of the test module (ranks
  are started with the ``spawn`` method and import it by name).
* Start-up is the expensive part (each rank imports torch): run many cases per
  call, e.g. from a module-scoped fixture.
* Rendezvous uses a ``file://`` store in a fresh temporary directory: no fixed
  path or port, so concurrent test runs cannot collide.
* Any exception in a rank is re-raised in the caller as
  :class:`DistributedTestError`, with every failing rank's traceback.
* Nothing hangs forever: after ``timeout`` seconds the ranks are killed and a
  ``DistributedTestError`` names the ranks that did not finish. The same
  timeout bounds each collective inside the ranks.
* Each rank uses one intra-op thread (tests share small CI machines).
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch.multiprocessing as mp

__all__ = ["run_distributed", "DistributedTestError"]

# Time left to the other ranks to report after one has failed (they are usually
# blocked in a collective with the dead rank and will not finish).
_GRACE_AFTER_FAILURE_S = 3.0


class DistributedTestError(RuntimeError):
    """A rank raised, crashed, or the run timed out. The message has the details."""


def _worker(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    timeout: float,
    payload: bytes,
    results: Any,
) -> None:
    """Entry point of one rank: init the group, run fn, report, tear down."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            # All ranks are local; don't depend on the hostname resolving.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        fn, args = pickle.loads(payload)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # Subgroups held in reference cycles would otherwise be freed by the interpreter's
        # final collection, where a gloo worker thread that still needs the GIL aborts the
        # process ("terminate called without an active exception"); see
        # launch/runtime.py:_free_process_groups_before_finalization.
        gc.collect()


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        world_size: number of ranks (processes).
        fn: module-level function; runs with ``torch.distributed`` initialized.
        *args: picklable extra arguments for ``fn``.
        timeout: seconds for the whole run (and for each collective).
        backend: process-group backend (``"gloo"`` on CPU).

    Returns:
        The values returned by ``fn``, indexed by rank.

    Raises:
        DistributedTestError: a rank raised or crashed, or the run timed out.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size: expected >= 1, got {world_size}")
    payload = pickle.dumps((fn, args))  # fail here, readably, if fn is not picklable
    tmpdir = tempfile.mkdtemp(prefix="tp_fuse_dist_")
    init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, init_method, backend, timeout, payload, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, body = results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) never will.
                for rank, p in enumerate(procs):
                    reported = rank in values or rank in errors
                    if not reported and p.exitcode is not None:
                        errors[rank] = f"rank {rank} exited with code {p.exitcode} without reporting"
                continue
            if status == "ok":
                values[rank] = pickle.loads(body)
            else:
                errors[rank] = body
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if errors:
        parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        silent = [r for r in range(world_size) if r not in errors and r not in values]
        if silent:
            parts.append(f"ranks {silent} did not finish (killed after the failure above)")
        raise DistributedTestError(
            f"{len(errors)} of {world_size} ranks failed running {fn.__name__}:\n" + "\n".join(parts)
        )
    missing = [r for r in range(world_size) if r not in values]
    if missing:
        raise DistributedTestError(
            f"run_distributed({fn.__name__}): ranks {missing} did not finish within {timeout}s"
        )
    return [values[r] for r in range(world_size)]


def run_cases(
    cases: dict[str, Callable[[int, int], Any]], rank: int, world_size: int,
    unavailable: Callable[[str], Optional[str]] = lambda name: None,
) -> dict[str, tuple[str, Any]]:
    """Run every case on this rank (inside :func:`run_distributed`): ``name -> ("ok",
    value)`` or ``("fail", traceback)``, so one failing case does not hide the others.
    ``unavailable(name)``: a reason to skip that case here (reported as ``{"skipped": why}``)."""
    results: dict[str, tuple[str, Any]] = {}
    for name, fn in cases.items():
        why = unavailable(name)
        if why is not None:
            results[name] = ("ok", {"skipped": why})
            continue
        try:
            results[name] = ("ok", fn(rank, world_size))
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = ("fail", traceback.format_exc())
    return results


def case_values(results: list[dict[str, tuple[str, Any]]], name: str) -> list[Any]:
    """Every rank's value of case ``name`` from :func:`run_cases`; fails the test with the
    rank's traceback, or skips it when the case reported ``{"skipped": why}``."""
    values = []
    for rank, res in enumerate(results):
        status, value = res[name]
        if status != "ok":
            pytest.fail(f"case {name} failed on rank {rank}:\n{value}", pytrace=False)
        if isinstance(value, dict) and "skipped" in value:
            pytest.skip(value["skipped"])
        values.append(value)
    return values
