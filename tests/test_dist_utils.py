"""The test helper ``dist_utils.run_distributed`` itself: a rank that dies without
reporting (``os._exit``, SIGKILL, a segfault) fails the run within seconds, naming the
rank, its exit code or signal and what it printed, instead of waiting for ``timeout``
while its peers stay blocked (a CI run of test_fsdp_launch waited its full 900 s).

Exceptions in ranks and timeouts are covered in test_fp8_amax_reduction.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from dist_utils import DistributedTestError, run_distributed

pytestmark = pytest.mark.multirank

# Far above what any of these runs needs: the old helper waited for it in full.
TIMEOUT_S = 600
# The bound that tells "failed at once" from "waited for the timeout" (start-up included;
# a run takes about 5 s on the 2-core machine).
PROMPT_S = 60


def _one_rank_dies(rank: int, world_size: int, death: str, wait: str) -> int:
    import torch.distributed as dist

    if rank == 1:
        print("rank 1 stdout before dying", flush=True)
        print("rank 1 stderr before dying", file=sys.stderr, flush=True)
        time.sleep(1.0)  # rank 0 is waiting by now
        if death == "exit":
            os._exit(3)
        if death == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if death == "segfault":
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        raise AssertionError(f"unknown death {death}")
    if wait == "new_group":
        # Waits in the store for rank 1's part of the new group's rendezvous: nothing but
        # the timeout ends it (as with the meshes and subgroups each launcher run creates).
        dist.new_group([0, 1])
    else:
        # gloo notices the closed socket itself here: rank 0 fails too, at once.
        dist.barrier()
    return rank


@pytest.mark.parametrize("death, wait, expected", [
    pytest.param("exit", "new_group", r"rank 1 exited with code 3 without reporting a result",
                 id="exit-new_group"),
    pytest.param("sigkill", "new_group", r"rank 1 was killed by SIGKILL \(exit code -9\) without reporting a result",
                 id="sigkill-new_group"),
    pytest.param("segfault", "new_group", r"rank 1 was killed by SIGSEGV \(exit code -11\) without reporting a result",
                 id="segfault-new_group"),
    pytest.param("exit", "barrier", r"rank 1 exited with code 3 without reporting a result", id="exit-barrier"),
])
def test_a_rank_that_dies_without_reporting_fails_the_run_at_once(death, wait, expected) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=expected) as info:
        run_distributed(2, _one_rank_dies, death, wait, timeout=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert elapsed < PROMPT_S, f"took {elapsed:.0f}s (timeout {TIMEOUT_S}s)"
    msg = str(info.value)
    # What the rank printed before it died is quoted.
    assert "rank 1 stdout before dying" in msg and "rank 1 stderr before dying" in msg, msg
    if death == "segfault":
        assert "Fatal Python error: Segmentation fault" in msg, msg  # faulthandler's stacks
    if wait == "new_group":
        assert "ranks [0] did not finish (killed after the failure above)" in msg, msg
    else:
        assert "Connection closed by peer" in msg, msg  # rank 0's own error is kept


def _prints(rank: int, world_size: int) -> int:
    print(f"stdout of rank {rank}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    return rank * 10


def test_what_ranks_print_reaches_the_caller(capfd) -> None:
    assert run_distributed(2, _prints, timeout=120) == [0, 10]
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out, out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err, err


def _rank_1_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)  # stands for a rank stuck in a collective or a lock
    return rank


def test_a_hung_rank_shows_where_it_waits(capfd) -> None:
    """At the timeout the parent asks every unfinished rank for its Python stacks
    (faulthandler on SIGUSR1) before killing it: the next hang says where it waited."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[1\] did not finish within 6"):
        run_distributed(2, _rank_1_hangs, timeout=6)
    assert time.monotonic() - start < 30  # the timeout ends the run: no hang
    err = capfd.readouterr().err
    assert "in _rank_1_hangs" in err, err[-3000:]  # faulthandler's frame line of the sleeping rank


def _start_facts(rank: int, world_size: int) -> dict:
    return {
        "env": os.environ.get("TP_FUSE_TEST_DIST_VALUE"),
        # The process the rank was forked from: the forkserver, unless fresh=True.
        "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
    }


@pytest.mark.parametrize("fresh", [False, True], ids=["forkserver", "fresh"])
def test_ranks_see_the_callers_environment_and_fork_from_a_single_thread(fresh, monkeypatch, capfd) -> None:
    # A forked rank would see the server's environment at its start: a second run, after the
    # change, shows it does not. A fresh rank is spawned from this process at each run (one
    # run shows it: a second one would take the same path, at the cost of 2 interpreters).
    for value in ("first", "second") if not fresh else ("first",):
        monkeypatch.setenv("TP_FUSE_TEST_DIST_VALUE", value)
        facts = run_distributed(2, _start_facts, fresh=fresh)
        assert [f["env"] for f in facts] == [value, value]
    if not fresh:
        # Forking a process that holds threads (OpenMP, gloo) leaves the child's copies
        # of their locks held: the server must still be single-threaded.
        assert [f["parent_threads"] for f in facts] == [1, 1], facts
    # A run whose ranks reported is not treated as hung: no faulthandler stacks (the old
    # helper sent SIGUSR1 to every rank still exiting and waited a second for it).
    assert "most recent call first" not in capfd.readouterr().err
