"""The built wheel installs one top-level import name, ``tp_fuse``, beside Jupyter's ``comm``.

The repository keeps its folders ``comm/``, ``layers/``, ``launch/`` and ``configs/``;
pyproject's ``package-dir`` maps them to ``tp_fuse.comm``, ``tp_fuse.layers``,
``tp_fuse.launch`` and ``tp_fuse/configs``. The wheel is built from a copy of the sources
(no ``build/`` left in the checkout, none reused from an earlier layout) and installed,
with PyPI's ``comm`` (Jupyter's, required by ipykernel), into a fresh venv without pip.
torch and the other dependencies come from this environment, *after* the venv's own
site-packages on ``sys.path`` (a ``.pth`` line), so nothing of this checkout or its
editable install is importable there.
"""

from __future__ import annotations

import os
import shutil
import site as site_module
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: repository folder -> where its files go in the wheel
FOLDERS = {"tp_fuse": "tp_fuse", "comm": "tp_fuse/comm", "layers": "tp_fuse/layers",
           "launch": "tp_fuse/launch", "configs": "tp_fuse/configs"}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def _source_files(folder: str, suffix: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames if f.endswith(suffix)]
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in FOLDERS:
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    proc = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                 str(src), "-w", str(tmp / "dist")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = [str(p) for p in (tmp / "dist").glob("tp_fuse-*.whl")]
    return whl


def test_wheel_has_one_top_level_name_and_every_module(wheel: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tp_fuse"}, tops
    # every module and config of the mapped folders is in the wheel (pyproject lists packages)
    expected = set()
    for folder, dest in FOLDERS.items():
        for f in _source_files(folder, ".py" if folder != "configs" else ".yaml"):
            expected.add(dest + f[len(folder):])
    missing = sorted(expected - set(names))
    assert not missing, f"not in the wheel (add the package to pyproject.toml): {missing}"
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["tp_fuse"]


def test_wheel_installs_beside_jupyters_comm(wheel: str, tmp_path) -> None:
    pip = [sys.executable, "-m", "pip"]
    # Jupyter's comm from the package index (a small pure-Python wheel, no dependencies)
    proc = _run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "comm", "-d", str(tmp_path / "dl")])
    if proc.returncode != 0:
        pytest.skip(f"cannot download Jupyter's comm from the package index: {proc.stderr.strip()[-300:]}")
    (comm_whl,) = [str(p) for p in (tmp_path / "dl").glob("comm-*.whl")]

    venv = tmp_path / "venv"
    proc = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert proc.returncode == 0, proc.stderr
    py = str(venv / "bin" / "python")
    # this pip installs into the venv (pip >= 22.3), offline: both wheels are local files
    proc = _run([*pip, "--python", py, "install", "-q", "--no-deps", "--no-index", wheel, comm_whl])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # torch, hydra... from this environment, after the venv's own packages
    # (site.getsitepackages() too: a venv made with --system-site-packages has torch in the base's)
    parent = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                            *site_module.getsitepackages()])
    with open(os.path.join(site, "zz_parent_env.pth"), "w") as f:
        f.write("\n".join(parent) + "\n")

    code = textwrap.dedent(
        f"""
        import os, sys
        import comm  # Jupyter's, not tp_fuse.comm (pkgmove: keep)
        import tp_fuse.comm, tp_fuse.layers, tp_fuse.launch, tp_fuse.comm.topology
        from tp_fuse.launch.api import CONFIG_DIR, compose

        site = {site!r}
        assert comm.__file__ == os.path.join(site, "comm", "__init__.py"), comm.__file__
        assert callable(comm.create_comm) and hasattr(comm, "get_comm_manager")  # Jupyter's API
        # tp_fuse/comm.py is the package; its modules are in tp_fuse/comm/ (tp_fuse/_floors.py)
        assert tp_fuse.comm.__file__ == os.path.join(site, "tp_fuse", "comm.py"), tp_fuse.comm.__file__
        assert tp_fuse.comm.__path__ == [os.path.join(site, "tp_fuse", "comm")], tp_fuse.comm.__path__
        assert tp_fuse.comm.topology.__file__ == os.path.join(site, "tp_fuse", "comm", "topology.py")
        assert callable(tp_fuse.comm.all_gather_dim0)
        assert tp_fuse.layers.__file__.startswith(site) and tp_fuse.launch.__file__.startswith(site)
        for name in ("launch", "layers"):
            assert name not in sys.modules, name
        # the launcher finds its Hydra configs inside the installed package
        assert CONFIG_DIR == os.path.join(site, "tp_fuse", "configs"), CONFIG_DIR
        assert compose(["+model=gpt"]).trainer.max_steps > 0
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = _run([py, "-I", "-c", code], cwd=str(tmp_path), env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
