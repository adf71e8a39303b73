"""No gloo worker thread survives into interpreter finalization (issue 24, case 9).

2-rank runs sometimes ended with ``terminate called without an active exception``
(SIGABRT) after finishing their work: subgroups kept alive by reference cycles were freed
only by the interpreter's final garbage collection, while a gloo worker thread still had
to take the GIL to release its last collective (a core dump showed it in
``AsyncBroadcastWork::~AsyncBroadcastWork`` -> ``take_gil`` -> ``pthread_exit``). The
launcher now frees them in an atexit handler, before finalization starts; afterwards the
process has no thread left but the main one. Checked directly (the abort itself is
intermittent: 8 of 60 starts of ``tools/start_stop_loop.py --modes finish,sigterm``
before the fix).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from test_launch_train import ROOT, torchrun_command

# Runs launch/train.py as __main__ and, at exit, after the launcher's own atexit handler
# (atexit runs handlers last-registered first), reports how many OS threads are left.
WRAPPER = f"""
import atexit, os, runpy, sys
atexit.register(lambda: print(f"[exit] rank {{os.environ['RANK']}} threads {{len(os.listdir('/proc/self/task'))}}",
                              file=sys.stderr, flush=True))
sys.argv[0] = {ROOT!r} + "/launch/train.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.multirank
def test_no_gloo_thread_is_left_for_interpreter_finalization(tmp_path):
    wrapper = tmp_path / "train_wrapper.py"
    wrapper.write_text(WRAPPER)
    cmd, env = torchrun_command(["+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                                 "data.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
                                 "trainer.max_steps=2", "logger=none", "trainer.progress=false",
                                 "checkpoint.interval=1", f"checkpoint.dir={tmp_path / 'ck'}",
                                 f"hydra.run.dir={tmp_path / 'run'}"])
    cmd = [str(wrapper) if c.endswith(os.path.join("launch", "train.py")) else c for c in cmd]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    left = dict(re.findall(r"\[exit\] rank (\d) threads (\d+)", proc.stderr))
    # Before the fix: 7 on each rank (two gloo subgroups' workers and the transport loops).
    assert left == {"0": "1", "1": "1"}, proc.stderr[-3000:]
