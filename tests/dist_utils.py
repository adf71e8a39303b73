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
  are started with the ``forkserver`` method and import it by name).
* Ranks are forked from a server process that has imported torch, torch._dynamo
  (which every torch optimizer imports) and tp_fuse once (``PRELOAD``): a rank starts
  in a fraction of a second instead of re-importing them (about 2.5 s on the 2-core
  machine). The server holds no threads when it forks. Each rank gets the caller's
  environment as it is at the call (``os.environ``), not the server's.
* Start-up is still the expensive part: run many cases per call, e.g. from a
  module-scoped fixture.
* Rendezvous uses a ``file://`` store in a fresh temporary directory: no fixed
  path or port, so concurrent test runs cannot collide.
* Any exception in a rank is re-raised in the caller as
  :class:`DistributedTestError`, with every failing rank's traceback.
* Nothing hangs forever: after ``timeout`` seconds the ranks are killed and a
  ``DistributedTestError`` names the ranks that did not finish. The same
  timeout bounds each collective inside the ranks.
* A rank that dies without reporting (``os._exit``, a segfault, an abort, the
  out-of-memory killer's SIGKILL) fails the run at once, not at the timeout: its
  peers may be blocked on it in a store wait (``new_group``, a mesh) that only the
  timeout ends. The error names the rank, its exit code or signal, and the end of
  what it printed.
* Each rank's stdout and stderr (file descriptors 1 and 2) go to files in the
  temporary directory, copied to the caller's ``sys.stdout``/``sys.stderr`` when
  the run ends (pytest shows them with the test); ``faulthandler`` is on in the
  ranks, so a crash prints the Python stacks there.
* Each rank uses one intra-op thread (tests share small CI machines).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any, Callable, Optional

import pytest
import torch.multiprocessing as mp

__all__ = ["run_distributed", "DistributedTestError"]

#: What the forkserver imports once, before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tp_fuse"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)

# Time left to the other ranks to report after one has failed (they are usually
# blocked in a collective with the dead rank and will not finish).
_GRACE_AFTER_FAILURE_S = 3.0
# How long a rank that reported may take to exit before it counts as hung.
_EXIT_AFTER_REPORT_S = 10.0
# Longest wait between two checks of the deadline (results and deaths wake the loop at once).
_POLL_S = 0.5
# How much of a dead rank's output its error message quotes (the whole output is replayed).
_TAIL_LINES = 40
_TAIL_CHARS = 6000


class DistributedTestError(RuntimeError):
    """A rank raised, crashed, or the run timed out. The message has the details."""


def _log_paths(tmpdir: str, rank: int) -> tuple[str, str]:
    return os.path.join(tmpdir, f"rank{rank}.stdout"), os.path.join(tmpdir, f"rank{rank}.stderr")


def _redirect_output(out_path: str, err_path: str) -> None:
    """Send this process's fds 1 and 2 (Python, C++ and gloo output alike) to files."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    if hasattr(sys.stdout, "reconfigure"):
        # Lines printed just before an os._exit or a crash reach the file.
        sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # Asked for by the parent before it kills a rank that did not finish in time: where
    # every thread of a hung rank was waiting ends up in the rank's output.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _worker(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    timeout: float,
    payload: bytes,
    conn: Connection,
    log_paths: tuple[str, str],
    environ: dict[str, str],
) -> None:
    """Entry point of one rank: init the group, run fn, report, tear down."""
    try:
        # The caller's environment (a forked rank inherits the server's, from its start).
        os.environ.clear()
        os.environ.update(environ)
        _redirect_output(*log_paths)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # The objects of the server's imports (torch, tp_fuse: ~300k) are left out of every
        # collection of this rank: the launcher collects after each in-process train() and
        # each full collection walked them all (0.2-0.25 CPU-s). Objects created by fn are
        # still collected, so its process groups are freed as before.
        gc.freeze()
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
            # init_process_group has no barrier: a rank whose fn needs no collective
            # could tear its group down while a peer is still connecting to it, and the
            # peer failed with gloo's "Connection closed by peer" (seen with forked
            # ranks, which start within milliseconds of each other).
            dist.barrier()
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        conn.send_bytes(pickle.dumps(("ok", pickle.dumps(value))))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        # Subgroups held in reference cycles would otherwise be freed by the interpreter's
        # final collection, where a gloo worker thread that still needs the GIL aborts the
        # process ("terminate called without an active exception"); see
        # launch/runtime.py:_free_process_groups_before_finalization.
        gc.collect()
        # A spawned rank ends in the interpreter's finalization, whose collection frees the
        # frozen objects as it always did (nanobind, in Triton, reports unfreed ones as leaks).
        gc.unfreeze()


def _exit_description(exitcode: int) -> str:
    """``"exited with code 3"`` / ``"was killed by SIGKILL (exit code -9)"``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _read_log(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _tail(text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    tail = "\n".join(lines[-_TAIL_LINES:])[-_TAIL_CHARS:]
    return tail if len(tail) == len(text.rstrip("\n")) else "[...]\n" + tail


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        world_size: number of ranks (processes).
        fn: module-level function; runs with ``torch.distributed`` initialized.
        *args: picklable extra arguments for ``fn``.
        timeout: seconds for the whole run (and for each collective).
        backend: process-group backend (``"gloo"`` on CPU).
        fresh: start each rank as a new interpreter (``spawn``) instead of forking it
            from the preloaded server: for a test of what a module imports.

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
    ctx = mp.get_context("spawn") if fresh else _CONTEXT
    # One pipe per rank: a rank that dies in the middle of a report gives EOF on its own
    # pipe (a shared queue would leave the reader blocked on the partial message).
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, init_method, backend, timeout, payload, pipes[rank][1],
                  _log_paths(tmpdir, rank), dict(os.environ)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead: dict[int, int] = {}  # rank -> exit code, for ranks that died without reporting
    outputs: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout

    def collect(rank: int) -> bool:
        """Take rank's report if there is one, or note that it died without one. True: done with it."""
        reader = pipes[rank][0]
        try:
            if reader.poll():  # a report, or EOF
                status, body = pickle.loads(reader.recv_bytes())
                if status == "ok":
                    values[rank] = pickle.loads(body)
                else:
                    errors[rank] = body
                return True
        except (EOFError, OSError):
            pass  # the pipe closed without a (complete) report
        # Its pipe closed or its process ended: give the exit a moment to complete.
        procs[rank].join(timeout=_POLL_S)
        exitcode = procs[rank].exitcode
        if exitcode is None:
            return False
        dead[rank] = exitcode
        return True

    pending = set(range(world_size))  # ranks that have neither reported nor died
    try:
        for p, (_, writer) in zip(procs, pipes):
            p.start()
            writer.close()  # the rank holds the only write end: EOF when it is gone
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            watch = {pipes[r][0]: r for r in pending}
            watch.update({procs[r].sentinel: r for r in pending})
            ready = wait_for(list(watch), timeout=min(_POLL_S, deadline - now))
            for rank in sorted({watch[obj] for obj in ready}):
                if collect(rank):
                    pending.discard(rank)
                    if rank in errors or rank in dead:
                        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    finally:
        # A rank that reported is tearing down (its group, the final gc.collect): give it
        # the time to exit. Only the others are hung (before the fix, every run waited a
        # second here and dumped the stacks of ranks that had simply not exited yet).
        for rank in set(range(world_size)) - pending:
            if procs[rank].pid is not None:
                procs[rank].join(timeout=_EXIT_AFTER_REPORT_S)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:  # their Python stacks first (faulthandler, registered in each rank)
            os.kill(p.pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)
        for p in hung:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:  # started
                p.join(timeout=5)
        for reader, writer in pipes:
            reader.close()
            writer.close()
        outputs = [tuple(_read_log(path) for path in _log_paths(tmpdir, rank)) for rank in range(world_size)]
        shutil.rmtree(tmpdir, ignore_errors=True)
        # What the ranks printed, where it went before the ranks wrote to files.
        for out, err in outputs:
            if out:
                sys.stdout.write(out)
            if err:
                sys.stderr.write(err)
        sys.stdout.flush()
        sys.stderr.flush()
    for rank, exitcode in dead.items():
        msg = f"rank {rank} {_exit_description(exitcode)} without reporting a result"
        if exitcode == -signal.SIGKILL:
            msg += " (the kernel's out-of-memory killer sends SIGKILL: see dmesg)"
        for name, text in zip(("stdout", "stderr"), outputs[rank] if outputs else ("", "")):
            if text.strip():
                msg += f"\n{name} of rank {rank}:\n{_tail(text)}"
        errors[rank] = msg
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


def value_error(fn: Callable[[], Any]) -> str:
    """The message of the ValueError ``fn()`` raises, or ``"no error"``: a refusal checked
    inside a rank, returned to the parent as a picklable string."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"
