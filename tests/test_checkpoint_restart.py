"""Checkpoints across processes: elastic restart after a rank dies, and resume at another TP size.

A: 2 ranks (TP=2), 12 steps, checkpoints every 4 steps: ``tp_fuse.launch.api.train`` in
   one start of 2 gloo ranks (the same launcher path as under torchrun, bit for bit; a
   torchrun start costs ~20 CPU-s more). B and D are real torchrun jobs.
B: the same with `--max-restarts=1` and `trainer.fail_at_step=10` (rank 1 exits on the
   first attempt): torchrun restarts both ranks, they resume from step 8 and end with
   exactly A's losses.
C: A's TP=2 checkpoint of step 4, resumed in one process at TP=1: DCP reshards the
   model and optimizer state; the losses follow A's up to TP round-off.
D: the same run preempted: SIGTERM to torchrun's whole process group (what a scheduler
   sends) once step 2 is logged. Both ranks finish the step they are in, agree on it,
   save a checkpoint and exit 0; the resumed run (2 gloo ranks) ends with exactly A's losses.
"""

from __future__ import annotations

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
from test_launch_train import TINY, torchrun, torchrun_command

RUN = [*TINY, "trainer.max_steps=12", "trainer.log_interval=1", "trainer.val_interval=0", "logger=none",
       "checkpoint.interval=4", "checkpoint.keep=3"]


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


@pytest.mark.multirank
def test_rank_failure_restarts_and_ends_at_the_same_loss(uninterrupted, tmp_path):
    proc = torchrun(
        [*RUN, "trainer.fail_at_step=10", f"checkpoint.dir={tmp_path / 'ck'}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=str(tmp_path), extra=("--max-restarts=1", "--monitor-interval=0.5"),
    )
    out = proc.stdout + proc.stderr
    assert "trainer.fail_at_step=10: rank 1 exits" in out  # the fault really happened
    assert "resumed from" in out and "step_00000008" in out  # ... and the restart resumed
    expected = _losses(str(uninterrupted / "run"))
    got = _losses(str(tmp_path / "run"))
    assert sorted(got) == list(range(1, 13))  # one trajectory: the crashed attempt's steps 9 were dropped
    assert got == expected  # bitwise, including the final loss
    assert got[12] < got[1]


@pytest.mark.multirank
def test_resume_at_a_different_tp_size_reshards(uninterrupted, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copytree(uninterrupted / "ck" / "step_00000004", ck / "step_00000004")
    result = train([*RUN, "checkpoint.resume=true", f"checkpoint.dir={ck}", "parallel.tp=1"], str(tmp_path / "run"))
    assert result.start_step == 4
    expected = _losses(str(uninterrupted / "run"))
    for step in range(5, 13):
        # TP=1 vs TP=2 differ only by float32 reduction order.
        assert result.losses[step] == pytest.approx(expected[step], rel=2e-4), step


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_sigterm_mid_run_saves_on_both_ranks_and_the_resume_is_bit_identical(uninterrupted, tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    args = [*RUN, f"checkpoint.dir={ck}", f"hydra.run.dir={run}"]
    cmd, env = torchrun_command(args)
    # Its own session: the signal goes to torchrun and both workers, as from a scheduler.
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text().count("\n") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # torchrun itself reports the signal it got (its own SignalException, status 1); the
    # workers finished the step, saved and exited 0.
    m = re.search(r"\[tp-fuse\] SIGTERM: stopped after step (\d+) of 12; checkpoint saved: (\S+)\.", err)
    assert m, err[-4000:]
    step = int(m.group(1))
    assert m.group(2) == str(ck / f"step_{step:08d}") and step < 12
    assert not re.search(r"exitcode\s*:\s*[1-9]", err), err[-3000:]  # no worker failed
    assert "SignalException" in err and proc.returncode == 1  # torchrun's own report of the signal
    run_distributed(2, _train_on_two_ranks, [*RUN, f"checkpoint.dir={ck}", "checkpoint.resume=auto"], str(run),
                    timeout=300)
    got = _losses(str(run))
    assert sorted(got) == list(range(1, 13))
    assert got == _losses(str(uninterrupted / "run"))  # bitwise
