"""One job per checkpoint directory (issue: reliability round 3, case 1).

Two jobs started together on one ``checkpoint.dir`` used to both run: on an existing
directory both printed ``resuming run ...`` and exited 0 while the second overwrote the
first's checkpoints; on a fresh one the second deleted the first's temporary directory.
Now rank 0 of the first job holds a ``flock`` for the job's life; the second is refused on
every rank with ``checkpoint.dir is in use by run X (host, pid, since ...)`` and changes
nothing. A lock left by a job that died is taken over with a message.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tp_fuse.launch.api import train
from tp_fuse.launch.checkpoint.manager import MANIFEST, CheckpointError
from tp_fuse.launch.checkpoint.dir_lock import LOCK_FILE, acquire
from tp_fuse.launch.checkpoint.run_identity import IDENTITY_FILE
from dist_utils import run_distributed
from test_launch_train import ROOT, torchrun_command

# Small and fast; max_steps is "forever": the job that gets the lock trains until the test
# stops it with SIGTERM (it then saves and exits 0), so the two jobs surely overlap.
JOB = ["+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=32",
       "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.log_interval=1",
       "trainer.val_interval=0", "logger=none", "trainer.progress=false", "trainer.max_steps=100000",
       "checkpoint.interval=1", "checkpoint.keep=1000", "checkpoint.resume=auto"]
HOLDER = re.compile(r"checkpoint\.dir is in use by run ([0-9a-f]{32}) \(host \S+, pid (\d+), since "
                    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\)")


# ---- the lock itself -------------------------------------------------------------------------


def test_a_second_holder_is_refused_naming_the_first_and_release_frees_it(tmp_path):
    first = acquire(str(tmp_path), job="job-a")
    first.set_run_id("a" * 32)
    with pytest.raises(CheckpointError, match=rf"checkpoint\.dir is in use by run {'a' * 32} \(host \S+, pid "
                                              rf"{os.getpid()}, since .*\): {tmp_path} .*Nothing was changed"):
        acquire(str(tmp_path), job="job-b")
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()  # no stale record after a clean end
    second = acquire(str(tmp_path), job="job-b")
    assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == "job-b"
    second.release()
    second.release()  # idempotent


def test_a_lock_left_by_a_dead_job_is_taken_over_with_a_message(tmp_path):
    """The holder is SIGKILLed while it holds the lock: the kernel drops its flock, its record stays."""
    code = ("import fcntl, json, os, sys, time\n"
            f"fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, json.dumps({'run_id': 'dead' * 8, 'job': 'old', 'host': 'h', 'pid': os.getpid(), "
            "'since': time.time()}).encode())\n"
            "print('locked', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=r"in use by run (dead){8} \(host h"):
            acquire(str(tmp_path), job="new")
    finally:
        holder.kill()
        holder.wait()
    said = []
    lock = acquire(str(tmp_path), job="new", say=said.append)
    assert said == [f"checkpoint.dir lock of run {'dead' * 8} (host h, pid {holder.pid}, since "
                    f"{said[0].split('since ')[1].split(')')[0]}) was left behind (that job ended without releasing "
                    "it: crashed or killed); taking it over"]
    lock.release()


def test_an_elastic_restart_waits_for_its_previous_attempt(tmp_path):
    """Same job key: torchrun is still stopping the old rank 0; wait for it instead of refusing."""
    old = acquire(str(tmp_path), job="job-a")
    old.set_run_id("b" * 32)
    threading.Timer(0.5, old.release).start()
    t0 = time.monotonic()
    new = acquire(str(tmp_path), job="job-a", same_job_wait_s=30)
    assert 0.4 < time.monotonic() - t0 < 30
    new.release()


def _train_on_two_ranks(rank: int, world_size: int, ck: str, run_dir: str):
    """One rank of a 2-rank job (inside run_distributed): the refusal as each rank sees it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        train([*JOB, "trainer.max_steps=2", f"checkpoint.dir={ck}"], run_dir)
    except CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.multirank
def test_a_held_directory_is_refused_on_every_rank_and_nothing_changes(tmp_path):
    ck = tmp_path / "ck"
    holder = acquire(str(ck), job="holder")
    holder.set_run_id("c" * 32)
    before = sorted(os.listdir(ck))
    try:
        errors = run_distributed(2, _train_on_two_ranks, str(ck), str(tmp_path / "run"), timeout=300)
    finally:
        holder.release()
    assert all(e is not None and e.startswith(f"checkpoint.dir is in use by run {'c' * 32} (host ") for e in errors)
    assert errors[0] == errors[1]
    assert before == [LOCK_FILE] and os.listdir(ck) == []  # nothing written; the holder's lock file is gone


# ---- two real jobs started together ----------------------------------------------------------


def _start(cmd, env, cwd):
    return subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _steps_logged(run_dir) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def _race(jobs: list[tuple[list[str], dict, object]], cwd, timeout: float = 400):
    """Start both jobs at once; the refused one ends by itself; SIGTERM the other once it has
    trained 2 steps (it saves and exits 0). Returns ``(winner, loser)`` as (index, rc, stdout, stderr)."""
    procs = [_start(cmd, env, cwd) for cmd, env, _ in jobs]
    deadline = time.monotonic() + timeout
    try:
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither job was refused"
            time.sleep(0.1)
        lose = next(i for i, p in enumerate(procs) if p.poll() is not None)
        win = 1 - lose
        while _steps_logged(jobs[win][2]) < 2:
            assert procs[win].poll() is None, procs[win].communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(procs[win].pid, signal.SIGTERM)
        results = [(i, *procs[i].communicate(timeout=240)) for i in (win, lose)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(i, procs[i].returncode, out, err) for i, out, err in results]


def _manifest_run_ids(ck) -> set[str]:
    return {json.loads((ck / d / MANIFEST).read_text())["run_id"] for d in os.listdir(ck) if d.startswith("step_")}


def _digest(path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        h.update(name.encode() + (path / name).read_bytes())
    return h.hexdigest()


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_two_torchrun_jobs_started_together_on_a_fresh_dir(tmp_path):
    ck = tmp_path / "ck"
    jobs = []
    for name in ("a", "b"):
        cmd, env = torchrun_command([*JOB, f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path / name}"])
        jobs.append((cmd, env, tmp_path / name))
    (win, win_rc, _, win_err), (lose, lose_rc, _, lose_err) = _race(jobs, tmp_path)
    assert "SIGTERM: stopped after step" in win_err, win_err[-3000:]
    m = HOLDER.search(lose_err)
    assert m, lose_err[-3000:]
    run_id = json.loads((ck / IDENTITY_FILE).read_text())["run_id"]
    assert m.group(1) == run_id  # the holder's run, by its id
    # (Its workers' exit statuses race with torchrun's SIGTERM to the survivor: not checked.)
    assert lose_rc != 0 and "starting run" not in lose_err and lose_err.count("is in use by run") == 1
    assert f'File "{ROOT}/launch' not in lose_err  # no traceback from our code (torchrun prints its own)
    assert _manifest_run_ids(ck) == {run_id}  # every checkpoint is the winner's
    assert not (tmp_path / "ab"[lose] / "metrics.jsonl").exists()
    assert not (ck / LOCK_FILE).exists()


@pytest.mark.timeout(600)
def test_two_resume_auto_jobs_started_together_on_an_existing_dir(tmp_path):
    ck = tmp_path / "ck"
    earlier = train([*JOB, "trainer.max_steps=2", f"checkpoint.dir={ck}"], str(tmp_path / "earlier"))
    kept = {d: _digest(ck / d) for d in ("step_00000001", "step_00000002")}
    run_id = json.loads((ck / IDENTITY_FILE).read_text())["run_id"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    jobs = [([sys.executable, os.path.join(ROOT, "launch", "train.py"), *JOB, f"checkpoint.dir={ck}",
              f"hydra.run.dir={tmp_path / name}"], env, tmp_path / name) for name in ("a", "b")]
    (win, win_rc, _, win_err), (lose, lose_rc, _, lose_err) = _race(jobs, tmp_path)
    assert win_rc == 0 and f"resuming run {run_id}" in win_err and "SIGTERM: stopped after step" in win_err
    assert lose_rc == 1 and "resuming run" not in lose_err and "Traceback" not in lose_err
    assert f"[tp-fuse] error: checkpoint.dir is in use by run {run_id} (host" in lose_err
    assert HOLDER.search(lose_err).group(2) != str(os.getpid())
    assert {d: _digest(ck / d) for d in kept} == kept  # the earlier checkpoints are untouched
    assert _manifest_run_ids(ck) == {run_id} and earlier.final_loss is not None
    assert not (tmp_path / "ab"[lose] / "metrics.jsonl").exists()
