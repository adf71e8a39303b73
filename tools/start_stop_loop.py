"""Start and stop 2-rank launcher jobs over and over; report any abnormal end (SIGABRT, ...).

Issue 24 saw an intermittent ``terminate called without an active exception`` (SIGABRT)
at process exit of 2-rank runs under load. This loop runs ``torchrun --nproc-per-node=2
launch/train.py`` with a tiny model many times, cycling through the ways a job ends:

* ``finish``   -- 2 steps, a checkpoint every step, exit 0;
* ``refused``  -- ``checkpoint.resume=true`` on an empty directory: a CheckpointError on
  both ranks after the process group exists, exit 1;
* ``restart``  -- ``--max-restarts=1 trainer.fail_at_step=2``: rank 1 dies, torchrun
  restarts both ranks, they resume and finish, exit 0 (``launcher_3`` of
  ``tests/test_documented_commands.py``, where the abort was seen);
* ``sigterm``  -- SIGTERM to the worker processes during training: they save and exit 0.

A run passes when torchrun's status is the expected one, no worker ended by a signal
(torchrun reports ``exitcode : -N``) other than the SIGTERM it sends itself, and the output
has no ``terminate called``. One start takes 10-30 s on a CPU, so 30 runs do not fit a
test; run it by hand::

    python tools/start_stop_loop.py --runs 30            # all modes in turn
    python tools/start_stop_loop.py --runs 10 --modes restart --keep-failed /tmp/loop

Exit status 0 when every run passed, 1 otherwise (the failing runs' output tails printed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=32",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.log_interval=1",
        "trainer.val_interval=0", "logger=none", "trainer.progress=false", "checkpoint.interval=1"]
MODES = ("finish", "refused", "restart", "sigterm")
# A worker that ended by a signal: torchrun's failure report says "exitcode : -6 (pid: ...)".
_SIGNALLED = re.compile(r"exitcode\s*:\s*-(\d+)")


def _command(mode: str, work: str) -> tuple[list[str], int]:
    """argv and the expected torchrun status of one run of ``mode`` in directory ``work``."""
    extra, args, expect = [], [*TINY, f"checkpoint.dir={work}/ck", f"hydra.run.dir={work}/run"], 0
    if mode == "finish":
        args.append("trainer.max_steps=2")
    elif mode == "refused":
        args += ["trainer.max_steps=2", "checkpoint.resume=true"]
        expect = 1
    elif mode == "restart":
        extra = ["--max-restarts=1", "--monitor-interval=0.5"]
        args += ["trainer.max_steps=3", "trainer.fail_at_step=2"]
    elif mode == "sigterm":
        args.append("trainer.max_steps=100000")
    else:
        raise ValueError(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", *extra, os.path.join(ROOT, "launch", "train.py"), *args]
    return cmd, expect


def _workers(agent_pid: int) -> list[int]:
    """PIDs of the torchrun agent's children (its workers), from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == agent_pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return f.read().count("\n")
    except FileNotFoundError:
        return 0


def run_once(mode: str, work: str, timeout: float) -> tuple[bool, str, float]:
    """``(passed, output, seconds)`` of one run."""
    cmd, expect = _command(mode, work)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "WANDB_MODE": "disabled"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        if mode == "sigterm":
            metrics = os.path.join(work, "run", "metrics.jsonl")
            while proc.poll() is None and time.monotonic() - t0 < timeout:
                if _lines(metrics) >= 2:
                    for pid in _workers(proc.pid):  # the workers only, as `scancel --signal` can
                        os.kill(pid, signal.SIGTERM)
                    break
                time.sleep(0.05)
        out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return False, out + f"\n[loop] timed out after {timeout:.0f} s", time.monotonic() - t0
    seconds = time.monotonic() - t0
    problems = []
    if proc.returncode != expect:
        problems.append(f"status {proc.returncode}, expected {expect}")
    if "terminate called" in out:
        problems.append("'terminate called' in the output")
    signalled = [int(s) for s in _SIGNALLED.findall(out) if int(s) != signal.SIGTERM]
    if signalled:
        problems.append(f"a worker ended by signal(s) {signalled}")
    if mode == "sigterm" and "SIGTERM: stopped after step" not in out:
        problems.append("no '[tp-fuse] SIGTERM: stopped after step' line")
    if problems:
        out += "\n[loop] " + "; ".join(problems)
    return not problems, out, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="number of starts (default 30)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, cycled (default {','.join(MODES)})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    parser.add_argument("--keep-failed", default=None, help="copy the directories of failed runs here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        _command(m, "/")  # unknown modes fail before anything starts
    failed, times = [], []
    start = time.monotonic()
    for i in range(args.runs):
        mode = modes[i % len(modes)]
        work = tempfile.mkdtemp(prefix=f"tp_fuse_loop_{i:03d}_{mode}_")
        ok, out, seconds = run_once(mode, work, args.timeout)
        times.append(seconds)
        load = os.getloadavg()[0]
        print(f"run {i + 1:3d}/{args.runs} {mode:8s} {'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  load {load:5.1f}",
              flush=True)
        if not ok:
            failed.append((i + 1, mode, out))
            if args.keep_failed:
                shutil.copytree(work, os.path.join(args.keep_failed, os.path.basename(work)))
        shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - start
    print(f"{args.runs - len(failed)}/{args.runs} passed in {total:.0f} s "
          f"(median {sorted(times)[len(times) // 2]:.1f} s per run)")
    for n, mode, out in failed:
        print(f"--- run {n} ({mode}) ---\n{out[-4000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
