"""Every launcher command in README.md and the docs in DOCS runs as written (with small step counts).

Commands are read from the ```bash blocks; the commands of one block run in order in one
directory (a checkpoint sequence is one block). What the test changes, and only that:

* step counts are divided by ``SCALE`` (``trainer.max_steps``, ``exit_at_step``,
  ``fail_at_step``, ``checkpoint.interval``, ``log_interval``, ``val_interval``), a run is
  at most ``MAX_STEPS`` steps long (also a command without ``trainer.max_steps`` that sets
  another step: its checkpoint, exit or failure comes before the end; ``DEFAULT_STEPS`` for
  a command that sets none: the suite's time is the commands' start-up and steps) and
  validation is shortened (``trainer.val_tokens``);
* torchrun's rendezvous port comes from the environment (``PET_MASTER_PORT``, a free port:
  tests never use a fixed one), W&B runs with ``WANDB_MODE=disabled``, ``make`` targets use a
  stamp directory that says "installed" (no pip) and a run directory under the test's;
* data files the docs name (``book.txt``...) are created from the default corpus.

Commands that cannot run on a CPU test box are listed with the reason (multi-node,
8 processes, placeholder paths such as ``/path/to``, absolute paths of the user's machine
such as a model directory). Commands of 3 or 4 processes (TP x DP layouts of a GPU node)
would oversubscribe the 2-core test box 2:1 and are already trained at 4 ranks by
``test_fsdp.py``/``test_fsdp_launch.py``: their configuration is checked as the launcher
checks it before starting (``config_errors.precheck`` at their world size: every key, value
and layout constraint), in-process. Anything else that starts ``launch/train.py`` runs, and
so does ``python -m tp_fuse.launch.prepare_data`` (data preparation).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
import torch

from tp_fuse.launch.config_errors import CONFIG_DIR, precheck
from tp_fuse.launch.data import stdlib_corpus
from preloaded_launcher import PreloadedLauncher, forkable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/launcher-tour.md", "docs/launcher.md", "docs/debug.md", "docs/scale-out.md"]
# The blocks of these docs run in test_documented_commands_more.py: the two modules take
# about as long, and make test's two pytest-xdist workers (whole modules each) share them.
MORE_DOCS = ("docs/launcher.md", "docs/debug.md", "docs/scale-out.md")
SCALE = 50
# A command that sets no step (the launcher's default is 300): 2 steps, the second with the
# FP8 scales the first measured, and the last step logs and validates whatever the intervals.
DEFAULT_STEPS = 2
MAX_STEPS = 4  # trainer.max_steps=1000 would be 20 steps; 4 still logs (log_interval=1) and validates
MAX_RUN_PROCESSES = 2  # the test box's cores: larger layouts are config-checked (module doc)
STEP_KEYS = ("trainer.max_steps", "trainer.exit_at_step", "trainer.fail_at_step", "checkpoint.interval",
             "trainer.log_interval", "trainer.val_interval")
# Validation runs at the last step: 2 windows of 128 tokens, one per rank at DP=2 (every rank validates).
EXTRA = ["trainer.val_tokens=256", "trainer.progress=false"]
PREPARE = "tp_fuse.launch.prepare_data"  # data preparation runs as written (before the training that reads it)


def _blocks(path: str) -> list[list[str]]:
    """Commands (continuations joined, comments dropped) of each ```bash block."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        cmds, cur = [], ""
        for line in body.splitlines():
            line = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            cur += line
            if cur.strip():
                cmds.append(" ".join(cur.split()))
            cur = ""
        blocks.append(cmds)
    return blocks


def _skip_reason(cmd: str) -> str | None:
    if "launch/train.py" not in cmd and not cmd.startswith("make train") and PREPARE not in cmd:
        return "not a launcher command"
    if "+model=megatron_gpt" in cmd and not torch.cuda.is_available():
        return "needs CUDA (megatron-core allocates with torch.cuda)"
    if "--nnodes" in cmd or "$" in cmd:
        return "multi-node (Slurm/rendezvous variables)"
    if "/path/to" in cmd or "/data/" in cmd:
        return "placeholder paths"
    for arg in shlex.split(cmd):
        value = arg.partition("=")[2].strip("[]")
        if any(p.startswith("/") and not os.path.exists(p) for p in value.split(",")):
            return f"names a directory or file of the user's machine ({value})"
    m = re.search(r"--nproc-per-node[= ](\d+)", cmd)
    if m and int(m.group(1)) > 4:
        return f"{m.group(1)} processes (a GPU node)"
    return None


def _processes(cmd: str) -> int:
    m = re.search(r"--nproc-per-node[= ](\d+)", cmd) or re.search(r"\bNPROC=(\d+)", cmd)
    return int(m.group(1)) if m else 1


def _checked_only(cmd: str) -> bool:
    """Whether ``cmd`` is config-checked rather than run (3-4 processes, module doc)."""
    return "launch/train.py" in cmd and _processes(cmd) > MAX_RUN_PROCESSES


def _scale(args: list[str]) -> list[str]:
    out, has_max, has_step = [], False, False
    for a in args:
        key, _, value = a.partition("=")
        if key in STEP_KEYS and value.isdigit():
            steps, has_step = max(1, round(int(value) / SCALE)), True
            if key == "trainer.max_steps":
                steps, has_max = min(steps, MAX_STEPS), True
            a = f"{key}={steps}"
        out.append(a)
    if not has_max:
        out.append(f"trainer.max_steps={MAX_STEPS if has_step else DEFAULT_STEPS}")
    return out + EXTRA


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare(cmd: str, cwd: str) -> list[str]:
    argv = shlex.split(cmd)
    if argv[0] == "make":
        stamp_dir = os.path.join(cwd, ".make")
        os.makedirs(stamp_dir, exist_ok=True)
        cksum = subprocess.run(["cksum", "pyproject.toml"], cwd=ROOT, capture_output=True, text=True, check=True)
        open(os.path.join(stamp_dir, f"installed-{cksum.stdout.split()[0]}"), "w").close()
        args = next((a.split("=", 1)[1] for a in argv if a.startswith("ARGS=")), "")
        args = " ".join(_scale(shlex.split(args)) + [f"hydra.run.dir={os.path.join(cwd, 'run')}"])
        rest = [a for a in argv[2:] if not a.startswith("ARGS=")]
        return ["make", "-s", "-C", ROOT, "train", *rest, f"ARGS={args}", f"STAMP_DIR={stamp_dir}",
                f"PYTHON={sys.executable}"]
    if PREPARE in argv:
        return [sys.executable, *argv[1:], "--no-progress"]
    i = next(k for k, a in enumerate(argv) if a.endswith("launch/train.py"))
    argv[i] = os.path.join(ROOT, "launch", "train.py")
    if argv[0] == "python":
        argv[0] = sys.executable
    return argv[: i + 1] + _scale(argv[i + 1 :])


def cases(docs) -> list:
    """One case per block of ``docs`` with runnable commands. A command documented twice
    runs once (in the first block of DOCS' order that has it), whichever module asks."""
    seen: set[str] = set()
    out = []
    for doc in DOCS:
        for b, cmds in enumerate(_blocks(doc)):
            runnable = [c for c in cmds if _skip_reason(c) is None and not _checked_only(c) and c not in seen]
            seen.update(runnable)
            if runnable and doc in docs:
                out.append(pytest.param(runnable, id=f"{os.path.basename(doc).split('.')[0]}_{b}"))
    return out


def test_larger_layouts_are_valid_as_written():
    """The 3-4 process commands (not run here, module doc) pass the launcher's own
    pre-start check at their world size."""
    checked = [c for doc in DOCS for cmds in _blocks(doc) for c in cmds
               if _skip_reason(c) is None and _checked_only(c)]
    assert checked, "expected the docs to show a TP x DP layout"
    for cmd in checked:
        argv = shlex.split(cmd)
        i = next(k for k, a in enumerate(argv) if a.endswith("launch/train.py"))
        assert precheck(argv[i + 1:], CONFIG_DIR, _processes(cmd)) is None, cmd


def test_the_extraction_finds_the_documented_commands():
    all_cmds = [c for doc in DOCS for cmds in _blocks(doc) for c in cmds]
    runnable = [c for c in all_cmds if _skip_reason(c) is None]
    assert len(runnable) >= 12, runnable
    assert any("checkpoint.resume" in c for c in runnable)
    skipped = {c: _skip_reason(c) for c in all_cmds if _skip_reason(c) not in (None, "not a launcher command")}
    assert len(skipped) <= 6, skipped  # only what needs GPUs, several nodes or the user's files


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """The module's ``python launch/train.py`` commands run in forks of one process that has
    imported the script's modules (tests/preloaded_launcher.py: what is the same, and why)."""
    helper = PreloadedLauncher(_env(), str(tmp_path_factory.mktemp("launcher_home")))
    yield helper
    helper.close()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("commands", cases([d for d in DOCS if d not in MORE_DOCS]))
def test_documented_commands_run_as_written(commands, tmp_path, launcher):
    run_block(commands, tmp_path, launcher)


def _env() -> dict[str, str]:
    """The commands' environment (``HOME`` and ``PET_MASTER_PORT`` are set per command)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_", "PET_"))}
    env.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    return env


def run_block(commands: list[str], tmp_path, launcher: PreloadedLauncher) -> None:
    """Run one block's commands in order in ``tmp_path`` (see the module doc); a plain
    ``python launch/train.py ...`` in a fork of ``launcher``, the others as subprocesses."""
    # As from a clone: relative paths such as configs/debug/example_features.yaml resolve.
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    corpus = stdlib_corpus()
    for name in ("book.txt", "book1.txt", "book2.txt"):
        (tmp_path / name).write_text(corpus[: 60_000], encoding="utf-8")
    for cmd in commands:
        argv = _prepare(cmd, str(tmp_path))
        env = {**_env(), "HOME": str(tmp_path / "home"), "PET_MASTER_PORT": str(_free_port())}
        if forkable(cmd):
            proc = launcher.run(argv[2:], str(tmp_path), env, timeout=400)
        else:
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd}\n-> {' '.join(argv)}\nfailed ({proc.returncode}):\n{out[-5000:]}"
        if "checkpoint.resume=true" in cmd:
            assert "resumed from" in out, f"{cmd}: did not resume\n{out[-3000:]}"
