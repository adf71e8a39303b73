"""Run ``python launch/train.py ARGS`` commands in forks of one process that has already
imported what the script imports (torch, Hydra, tp_fuse.launch: ~4.5 of a run's ~8 CPU-s).

A command still runs its script as ``python launch/train.py`` does: the helper process
(started once, with the commands' environment) executes the script once under another name,
which imports exactly the script's modules and runs nothing else (train.py's ``__main__``
parts, the collector switch included, are skipped), and imports ``torch._dynamo``, which
every run imports when it builds its optimizer (so a launcher module that used it before
then, without importing it, would pass here: the launcher tests that start real processes
would catch that). Per command it forks; the child sets the
command's working directory, environment, argv and standard streams (``stdin`` from
/dev/null, ``stdout``/``stderr`` to files), leaves the helper's loop and runs the script with
``runpy.run_path(script, run_name="__main__")`` at the top level of the program, so the
interpreter's own exit (uncaught exception: traceback and status 1, ``SystemExit``, thread
joins, atexit handlers, flushing) is the one a fresh ``python`` has. The test gets the exit
status and both outputs.

What a fork cannot reproduce, and the guards:

* state an import derived from the environment: the helper starts with the commands'
  environment; only ``HOME`` and ``PET_MASTER_PORT`` differ per command, and the helper
  refuses to serve if any module's globals hold its own ``HOME`` or working directory;
  a command that sets variables of its own (``VAR=1 python ...``) is not sent here
  (``forkable``);
* threads and devices: the helper forks only while it has one thread and CUDA is not
  initialised (asserted before every fork);
* torchrun, ``make`` and shell pipelines start fresh processes and run as real subprocesses.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import shlex
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "train.py")
# Module globals an import computes from the working directory: the child computes them again
# in its own (multiprocessing's spawn starts its children there and resolves '' on sys.path).
RECOMPUTED = {("multiprocessing.process", "ORIGINAL_DIR"): lambda: os.path.abspath(os.getcwd())}


def forkable(cmd: str) -> bool:
    """Whether the documented ``cmd`` is a plain ``python launch/train.py ...`` (no variables
    set before it, no shell syntax): the commands the preloaded helper runs."""
    argv = shlex.split(cmd)
    shell = set(";|&<>`$()")
    return (len(argv) >= 2 and argv[0] == "python" and argv[1].endswith("launch/train.py")
            and not any(shell & set(a) for a in argv))


class PreloadedLauncher:
    """Client of the helper process (``python tests/preloaded_launcher.py``): ``run`` is
    ``subprocess.run(argv, cwd=, env=, capture_output=True, text=True, timeout=)`` for
    ``argv = [sys.executable, launch/train.py, *args]``."""

    def __init__(self, env: dict[str, str], base: str):
        # The helper's HOME and working directory: distinct folders (the helper checks for both).
        home, cwd = os.path.join(base, "home"), os.path.join(base, "cwd")
        os.makedirs(home)
        os.makedirs(cwd)
        self._errors = os.path.join(home, "helper.stderr")
        with open(self._errors, "wb") as errors:
            self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), SCRIPT], cwd=cwd,
                                          env={**env, "HOME": home}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=errors)
        ready = self._read(timeout=300)
        assert ready == {"ready": True}, ready

    def _read(self, timeout: float) -> dict:
        readable, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if readable else b""
        if not line:
            if not readable:
                raise TimeoutError(f"preloaded launcher: no answer in {timeout} s")
            self._proc.wait(10)
            with open(self._errors, encoding="utf-8", errors="replace") as f:
                raise RuntimeError(f"preloaded launcher exited ({self._proc.returncode}):\n{f.read()[-5000:]}")
        return json.loads(line)

    def run(self, args: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        out, err = os.path.join(cwd, ".launcher.stdout"), os.path.join(cwd, ".launcher.stderr")
        request = {"argv": [SCRIPT, *args], "cwd": cwd, "env": env, "stdout": out, "stderr": err}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        pid = self._read(timeout=30)["pid"]
        try:
            returncode = self._read(timeout)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(timeout=30)
            raise subprocess.TimeoutExpired([sys.executable, *request["argv"]], timeout) from None
        texts = []
        for path in (out, err):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
            os.remove(path)
        return subprocess.CompletedProcess([sys.executable, *request["argv"]], returncode, *texts)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(30)
        self._proc.stdout.close()
        assert self._proc.returncode == 0, open(self._errors, encoding="utf-8", errors="replace").read()[-5000:]


def _assert_no_state_from(values: dict[str, str]) -> None:
    """No module's globals hold a string naming the helper's own ``HOME`` or working
    directory (what an import derived from them would keep; the commands have their own).
    Exempt: ``site``'s user folders (``~/.local``), computed at every start, which must then
    not be on ``sys.path`` (both HOMEs are empty folders: no user site holds anything), and
    what the child sets again (``RECOMPUTED``)."""
    assert not any(p.startswith(values["HOME"]) for p in sys.path), sys.path
    exempt = {("site", "USER_SITE"), ("site", "USER_BASE"), *RECOMPUTED}
    held = [f"{name}.{key} holds the helper's {what}: {value!r}"
            for name, module in list(sys.modules.items())
            for key, value in list(getattr(module, "__dict__", {}).items())
            if isinstance(value, (str, os.PathLike)) and (name, key) not in exempt
            for what, seen in values.items() if seen in os.fspath(value)]
    assert not held, held


def _assert_forkable() -> None:
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the helper has {len(threads)} threads: a fork would lose them"
    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized(), "CUDA is initialised: a fork cannot use it"


def _serve(script: str) -> dict:
    """The helper's loop: returns (in a forked child) the request the child is to run."""
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # stderr: the client's file of the helper's own errors
        os.dup2(null, fd)
    os.close(null)
    # As `python launch/train.py` has it: the script's folder first (the script takes it off).
    sys.path[0] = os.path.dirname(script)
    # As train.py imports (its run() freezes the imports' objects, collects once and enables
    # the collector): a child starts with the collector state of a fresh run's imports.
    gc.disable()
    runpy.run_path(script, run_name="__preloaded__")
    # Every run imports it too, when it builds its optimizer (torch.optim's constructors call
    # functions wrapped by torch._compile.disable_dynamo, which imports it on the first call):
    # ~1 CPU-s of each run's start-up, here once.
    importlib.import_module("torch._dynamo")
    _assert_no_state_from({"HOME": os.environ["HOME"], "working directory": os.getcwd()})
    answers.write(b'{"ready": true}\n')
    answers.flush()
    for line in requests:
        request = json.loads(line)
        _assert_forkable()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            return request
        answers.write(json.dumps({"pid": pid}).encode() + b"\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        answers.flush()
    raise SystemExit(0)


def _child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for (module, name), value in RECOMPUTED.items():
        if module in sys.modules:
            setattr(sys.modules[module], name, value())
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = list(request["argv"])
    runpy.run_path(request["argv"][0], run_name="__main__")


if __name__ == "__main__":
    _child(_serve(sys.argv[1]))
