"""Run a Triton test module under ``TRITON_INTERPRET=1`` in its own pytest process.

The variable must be set before triton is imported, and the interpreter must not leak
into the rest of the suite; so each interpreter module runs itself in a subprocess from
one ordinary test (``if not INTERPRETED``) and holds its real cases in the ``else`` branch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_interpreter(test_file: str, timeout: int = 900) -> None:
    """Run ``test_file`` with ``TRITON_INTERPRET=1``; fail with its report unless every case passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    report = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
