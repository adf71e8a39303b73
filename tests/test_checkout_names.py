"""From the repository root, the top-level folders ``comm/``, ``layers/``, ``launch/`` never shadow
an installed package of the same name (Jupyter's ``comm``): they carry no ``__init__.py``, so
Python sees them only as namespace portions (tp_fuse/_floors.py). Inside tp_fuse they are
still ``tp_fuse.comm``, ``tp_fuse.layers`` and ``tp_fuse.launch`` with their public names."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ("comm", "layers", "launch")


def _run_at_root(code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    # `python -c` puts the current directory (the repository root) first on sys.path.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", FLOORS)
def test_root_folders_are_not_regular_packages(name: str) -> None:
    assert os.path.isdir(os.path.join(ROOT, name))
    assert not os.path.exists(os.path.join(ROOT, name, "__init__.py")), (
        f"{name}/__init__.py would shadow an installed `{name}` from the repository root; "
        f"the package's public names go in tp_fuse/{name}.py")


def test_installed_package_wins_at_the_repository_root(tmp_path) -> None:
    # A stand-in for Jupyter's comm (and any installed `layers` / `launch`): regular packages.
    for name in FLOORS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'installed {name}'\ndef create_comm(): pass\n")
    proc = _run_at_root("""
        import comm, layers, launch
        assert comm.WHO == 'installed comm' and callable(comm.create_comm), comm.__file__
        assert layers.WHO == 'installed layers' and launch.WHO == 'installed launch'
        import tp_fuse.comm
        assert callable(tp_fuse.comm.all_gather_dim0) and tp_fuse.comm is not comm
    """, extra_path=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_floors_keep_their_public_names() -> None:
    proc = _run_at_root("""
        import os
        import tp_fuse.comm, tp_fuse.layers, tp_fuse.launch
        from tp_fuse.comm import ParallelTopology
        from tp_fuse.layers import GPT, wrap
        from tp_fuse.comm.overlap import ring_exchange_ag_gemm
        assert tp_fuse.comm.topology.ParallelTopology is ParallelTopology
        for name in ("comm", "layers", "launch"):
            assert getattr(tp_fuse, name).__path__ == [os.path.join(os.getcwd(), name)]
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
