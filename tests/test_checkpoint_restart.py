"""Checkpoints across processes: elastic restart after a rank dies, preemption, and resume at
another TP size.

A: 2 ranks (TP=2), 16 steps, checkpoints every 4 steps: ``tp_fuse.launch.api.train`` in
   one start of 2 gloo ranks (the same launcher path as under torchrun, bit for bit; a
   torchrun start costs ~20 CPU-s more).
B: the same as one real torchrun job with `--max-restarts=1` and `trainer.fail_at_step=6`
   (rank 1 exits on the first attempt, after logging step 5): torchrun restarts both
   ranks and they resume from step 4. Once the restarted attempt has logged step 6, the
   job is preempted: SIGTERM to torchrun's whole process group (what a scheduler sends).
   Both ranks finish the step they are in, agree on it, save a checkpoint and exit 0;
   the resumed run (2 gloo ranks) ends with exactly A's losses: the restart and the
   preemption each lose nothing. (One torchrun job for both: each is ~20 CPU-s.)
C: A's TP=2 checkpoint of step 4, resumed in one process at TP=1: DCP reshards the
   model and optimizer state; the losses follow A's up to TP round-off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tp_fuse.launch.api import train
from tp_fuse.launch.logging.metrics import read_jsonl
from dist_utils import run_distributed
from test_launch_train import TINY, torchrun_command

RUN = [*TINY, "trainer.max_steps=16", "trainer.log_interval=1", "trainer.val_interval=0", "logger=none",
       "checkpoint.interval=4", "checkpoint.keep=4"]


def _losses(run_dir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def _train_on_two_ranks(rank: int, world_size: int, args: list[str], run_dir: str) -> dict[int, float]:
    """One rank of a 2-rank launcher run (inside run_distributed)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    return train(args, run_dir).losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run_distributed(2, _train_on_two_ranks, [*RUN, f"checkpoint.dir={tmp / 'ck'}"], str(tmp / "run"), timeout=300)
    return tmp


def _steps_logged(metrics) -> list[int]:
    """The steps in ``metrics.jsonl`` so far (a line being written is left out)."""
    try:
        lines = metrics.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_rank_failure_restarts_then_sigterm_saves_and_the_resume_is_bit_identical(uninterrupted, tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    cmd, env = torchrun_command([*RUN, "trainer.fail_at_step=6", f"checkpoint.dir={ck}", f"hydra.run.dir={run}"],
                                extra=("--max-restarts=1", "--monitor-interval=0.5"))
    # Its own session: the signal goes to torchrun and both workers, as from a scheduler.
    # Output to files: nothing reads a pipe while the job runs.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=out, stderr=err, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        # Step 6 is logged only by the restarted attempt (the first one's rank 1 exits in it).
        while 6 not in _steps_logged(run / "metrics.jsonl"):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-4000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "err").read_text()
    out = (tmp_path / "out").read_text() + err
    assert "trainer.fail_at_step=6: rank 1 exits" in out  # the fault really happened
    assert "resumed from" in out and "step_00000004" in out  # ... and the restart resumed
    # torchrun itself reports the signal it got (its own SignalException, status 1); the
    # workers finished the step, saved and exited 0.
    m = re.search(r"\[tp-fuse\] SIGTERM: stopped after step (\d+) of 16; checkpoint saved: (\S+)\.", err)
    assert m, err[-4000:]
    step = int(m.group(1))
    assert m.group(2) == str(ck / f"step_{step:08d}") and 6 <= step < 16
    after_restart = err.split("resumed from", 1)[1]
    assert not re.search(r"exitcode\s*:\s*[1-9]", after_restart), err[-3000:]  # no worker of the 2nd attempt failed
    assert "SignalException" in err and proc.returncode == 1  # torchrun's own report of the signal
    expected = _losses(str(uninterrupted / "run"))
    assert _losses(str(run)) == {s: expected[s] for s in range(1, step + 1)}  # the crashed attempt's step 5 dropped
    run_distributed(2, _train_on_two_ranks, [*RUN, f"checkpoint.dir={ck}", "checkpoint.resume=auto"], str(run),
                    timeout=300)
    got = _losses(str(run))
    assert sorted(got) == list(range(1, 17))  # one trajectory
    assert got == expected  # bitwise, including the final loss
    assert got[16] < got[1]


@pytest.mark.multirank
def test_resume_at_a_different_tp_size_reshards(uninterrupted, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copytree(uninterrupted / "ck" / "step_00000004", ck / "step_00000004")
    result = train([*RUN, "checkpoint.resume=true", f"checkpoint.dir={ck}", "parallel.tp=1"], str(tmp_path / "run"))
    assert result.start_step == 4
    expected = _losses(str(uninterrupted / "run"))
    for step in range(5, 17):
        # TP=1 vs TP=2 differ only by float32 reduction order.
        assert result.losses[step] == pytest.approx(expected[step], rel=2e-4), step
