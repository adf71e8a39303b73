"""Preemption loses nothing: SIGTERM / SIGUSR1 / SIGINT finish the step, save, and stop.

A scheduler's SIGTERM used to end the run with no checkpoint (everything since the last
``checkpoint.interval`` save lost) and Ctrl-C ended with a KeyboardInterrupt traceback.
Now the step in progress finishes, a checkpoint is saved, one line says so, the exit
status is 0, and resuming from that checkpoint repeats the uninterrupted run bit for bit.
The 2-rank case (SIGTERM to torchrun's whole process group) is in test_checkpoint_restart.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tp_fuse.launch.api import train
from tp_fuse.launch.logging.metrics import read_jsonl
from tp_fuse.layers import GPT
from test_checkpoint_resume import COMMON

# 6 steps (COMMON has 12): a signal during step 4 leaves 2 resumed steps, the second of them
# after a whole resumed optimizer step; fewer steps keep the 3 signals x 2 runs cheap.
SHORT = [a for a in COMMON if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=6"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _signal_during_step(step: int, sig: int):
    """``tp_fuse.layers.GPT`` that sends ``sig`` to this process during training step ``step``
    (COMMON: 2 micro-batches, so 2 training forwards per step)."""
    calls = [0]

    def factory(*args, **kwargs):
        model = GPT(*args, **kwargs)

        def hook(module, inputs):
            if module.training:
                calls[0] += 1
                if calls[0] == 2 * (step - 1) + 1:
                    os.kill(os.getpid(), sig)

        model.register_forward_pre_hook(hook)
        return model

    return factory


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 6-step reference run."""
    return train(SHORT, str(tmp_path_factory.mktemp("straight")))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_mid_run_saves_and_the_resume_is_bit_identical(straight, tmp_path, capfd, sig):
    ck, run = tmp_path / "ck", str(tmp_path / "run")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    first = train([*SHORT, f"checkpoint.dir={ck}"], run, model_factory=_signal_during_step(4, sig))
    assert first.stopped_by == sig.name and first.last_step == 4
    assert first.checkpoint == str(ck / "step_00000004")
    assert f"[tp-fuse] {sig.name}: stopped after step 4 of 6; checkpoint saved: {ck}/step_00000004" in \
        capfd.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    second = train([*SHORT, "checkpoint.resume=auto", f"checkpoint.dir={ck}"], run)
    assert second.start_step == 4 and second.stopped_by is None
    assert {**first.losses, **second.losses} == straight.losses  # bitwise
    assert [r["step"] for r in read_jsonl(os.path.join(run, "metrics.jsonl"))] == list(range(1, 7))


@pytest.mark.timeout(300)
def test_ctrl_c_on_the_command_line_is_one_line_no_traceback_exit_0(tmp_path):
    run, ck = tmp_path / "run", tmp_path / "ck"
    args = [a for a in COMMON if not a.startswith("trainer.max_steps")]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "launch", "train.py"), *args, "trainer.max_steps=100000",
         f"checkpoint.dir={ck}", f"hydra.run.dir={run}"],
        cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().count("\n") >= 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    (line,) = [x for x in err.splitlines() if "SIGINT: stopped after step" in x]
    step = int(line.split("stopped after step ")[1].split()[0])
    assert os.path.isdir(ck / f"step_{step:08d}")
    assert [r["step"] for r in read_jsonl(str(run / "metrics.jsonl"))][-1] == step
