"""`make train` / `make test` install once (a stamp keyed by pyproject.toml) and then run offline.

The Makefile runs against a fake interpreter that records its command lines, in a copy of
the Makefile and pyproject.toml: no pip, no network, no training.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PYTHON = """#!/bin/sh
# Records its arguments; every command "succeeds" (torch and setuptools>=68 are "installed").
echo "$*" >> "{log}"
exit 0
"""


@pytest.fixture
def project(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    log = tmp_path / "calls.log"
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON.format(log=log))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)

    def make(target: str) -> list[str]:
        log.write_text("")
        proc = subprocess.run(["make", "-s", target, f"PYTHON={fake}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return log.read_text().splitlines()

    return tmp_path, make


def _pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip")]


def test_install_once_then_offline(project):
    path, make = project
    first = make("test")
    pips = _pip_calls(first)
    assert len(pips) == 1, first  # torch imports: only the project itself is installed
    # setuptools>=68 is present: the editable build must not fetch it (works offline).
    assert "--no-build-isolation" in pips[0] and '-e .[test]' in pips[0]
    assert first[-1] == "-m pytest -q -n 2 --dist loadfile tests"
    # Every later call: no pip at all.
    for target in ("test", "train", "install"):
        assert _pip_calls(make(target)) == [], target
    train = make("train")
    assert any(c.startswith("-m torch.distributed.run") for c in train)
    # A changed pyproject.toml (new dependencies) installs again, once.
    with open(path / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert len(_pip_calls(make("test"))) == 1
    assert _pip_calls(make("test")) == []


def test_make_train_checks_the_config_first(project):
    _, make = project
    calls = make("train")
    check = next(i for i, c in enumerate(calls) if c.startswith("-m tp_fuse.launch.config_errors"))
    run = next(i for i, c in enumerate(calls) if c.startswith("-m torch.distributed.run"))
    assert check < run and calls[check].endswith("+model=gpt")
