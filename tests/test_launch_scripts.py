"""The scripts in launch/ run as files (``python launch/x.py``): their shared header
(launch/_tp_fuse_checkout.py) takes launch/ off sys.path before anything can import
launch/logging/ as the standard library's logging, and imports tp_fuse from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys

from tp_fuse.launch.logging.metrics import MetricsSink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch", name), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_plot_and_prepare_data_run_as_scripts(tmp_path):
    sink = MetricsSink(str(tmp_path), True, None)
    sink.log(1, {"loss": 1.0}, {f"fp8/model.model.layers.0/mlp.down_proj._tp.ops.linear/{r}/{s}": 1.0
                                for r in ("input", "weight", "grad_output") for s in ("amax", "mse", "underflow_pct")})
    sink.close()
    proc = _script("plot_fp8_stats.py", str(tmp_path), "--list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model.model.layers.0/mlp.down_proj._tp.ops.linear  [input, weight, grad_output]: amax, mse" in proc.stdout
    proc = _script("plot_fp8_stats.py", str(tmp_path), "x.png", "--gemm", "fc1", cwd=tmp_path)
    assert proc.returncode == 1 and "--gemm 'fc1' is not a GEMM" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "a.txt").write_text("some text\n\n" * 50)
    proc = _script("prepare_data.py", "a.txt", "--out", "data", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "data.paths=[data/train.bin,data/val.bin]" in proc.stderr
    assert os.path.getsize(tmp_path / "data" / "train.bin") + os.path.getsize(tmp_path / "data" / "val.bin") == 2 * 550
