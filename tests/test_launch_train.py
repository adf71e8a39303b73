"""The launcher end to end: `torchrun --nproc-per-node=2 launch/train.py +model=gpt ...` on CPU.

One launch checks: one shared run directory (rank 0 writes Hydra's files), metrics.jsonl,
a falling loss, W&B offline run read back with FP8 scaling statistics and debug-feature
statistics (finite values), and that the JSONL records match what W&B got.
"""

from __future__ import annotations

import glob
import math
import os
import subprocess
import sys

import pytest

from tp_fuse.launch.logging.metrics import read_jsonl
from tp_fuse.launch.logging.wandb_reader import read_config, read_history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "+model=gpt", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=2", "data.seq_len=32",
    "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "optim.warmup_steps=1", "optim.lr=3e-3",
    "trainer.progress=false",
]


def torchrun_command(args: list[str], *, nproc: int = 2, extra: tuple[str, ...] = (),
                     env: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of launch/train.py under torchrun on a free port chosen by the OS."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    base.update({"OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": ROOT, **(env or {})})
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", *extra, os.path.join(ROOT, "launch", "train.py"), *args]
    return cmd, base


def torchrun(args: list[str], cwd: str, *, nproc: int = 2, extra: tuple[str, ...] = (), timeout: int = 240,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run launch/train.py under torchrun on a free port chosen by the OS (never a fixed one)."""
    cmd, base = torchrun_command(args, nproc=nproc, extra=extra, env=env)
    proc = subprocess.run(cmd, cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.multirank
def test_torchrun_two_ranks_one_run_dir_metrics_wandb_fp8_stats(tmp_path):
    debug_yaml = os.path.join(ROOT, "configs", "debug", "example_features.yaml")
    # HOME without W&B credentials: logger=wandb (the default) must go offline by itself.
    proc = torchrun([*TINY, "trainer.max_steps=6", "trainer.log_interval=1", "trainer.val_interval=6",
                     "fp8=delayed", f"debug.config={debug_yaml}"],
                    cwd=str(tmp_path), env={"HOME": str(tmp_path / "home")})

    # One run directory for both ranks, chosen by rank 0 (no per-rank, per-second dirs).
    # (home/ exists only if something wrote to HOME: W&B's cache goes to XDG_CACHE_HOME,
    # which tests/conftest.py points elsewhere.)
    assert set(os.listdir(tmp_path)) - {"home"} == {"outputs"}
    run_dirs = glob.glob(str(tmp_path / "outputs" / "*" / "*"))
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    names = set(os.listdir(run_dir))
    assert {".hydra", "metrics.jsonl", "fp8_stats.jsonl", "debug_stats.jsonl", "wandb"} <= names
    assert proc.stdout.count("step      6/6") == 1  # only rank 0 prints

    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.2  # it learns
    assert "val_loss" in metrics[-1] and "tokens_per_s" in metrics[-1] and "grad_norm" in metrics[-1]
    assert all(m["fp8_nonfinite_amax_count"] == 0 for m in metrics)

    (wandb_file,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    rows = read_history(wandb_file)
    assert [r["trainer/step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    last = next(r for r in reversed(rows) if "loss" in r)
    fp8_keys = [k for k in last if k.startswith("fp8/")]
    # Every layer, GEMM and tensor role, with every statistic.
    for layer in ("layers.0", "layers.1"):
        for gemm in ("qkv", "proj", "fc1", "fc2"):
            for tensor in ("input", "weight", "grad_output"):
                for stat in ("amax", "scale", "scale_inv", "amax_history_max", "underflow_pct", "overflow_pct", "mse",
                             "nonfinite_amax_count"):
                    assert f"fp8/{layer}/{gemm}/{tensor}/{stat}" in fp8_keys
    assert all(isinstance(last[k], (int, float)) and math.isfinite(last[k]) for k in fp8_keys)
    assert last["fp8/layers.0/fc1/input/scale"] * last["fp8/layers.0/fc1/input/scale_inv"] == pytest.approx(1.0)
    assert last["fp8/layers.0/fc1/input/amax"] > 0
    # The JSONL sink got the same records.
    fp8_jsonl = read_jsonl(os.path.join(run_dir, "fp8_stats.jsonl"))
    assert fp8_jsonl[-1]["step"] == 6
    assert all(fp8_jsonl[-1][k] == pytest.approx(last[k]) for k in fp8_keys)

    debug_rows = [r for r in rows if any(k.startswith("debug/") for k in r)]
    assert len(debug_rows) == 6  # freq 1: one record per iteration, each at its step
    d = debug_rows[-1]
    for tensor in ("activation", "gradient", "weight"):
        for stat in ("min", "max", "mean", "std", "l1_norm", "l2_norm", "amax", "dynamic_range",
                     "underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse"):
            assert math.isfinite(d[f"debug/layers.0.fc1/{tensor}/{stat}"])
    assert d["debug/layers.0.fc1/activation/max"] <= d["debug/layers.0.fc1/activation/amax"]
    assert read_config(wandb_file)["fp8"]["recipe"] == "delayed"
