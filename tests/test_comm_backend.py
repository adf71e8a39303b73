"""Backend choice and process-group start-up: the torchrun path (launched with torchrun
--standalone, which picks a free port) and the one-process fallback (plain python)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tp_fuse.comm import backend_for_device, device_for_local_rank, device_type_for_backend

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from tp_fuse import comm

    ctx = comm.init_distributed()
    assert ctx.owns_group and dist.is_initialized(), ctx
    assert ctx.backend == "gloo" and ctx.device == torch.device("cpu"), ctx
    assert (ctx.rank, ctx.world_size) == (dist.get_rank(), dist.get_world_size())
    again = comm.init_distributed()  # an existing group is described, not re-created
    assert not again.owns_group and again.world_size == ctx.world_size
    t = torch.ones(2)
    dist.all_reduce(t)  # a real group, also with one process
    assert t.tolist() == [float(ctx.world_size)] * 2
    topo = comm.ParallelTopology(tp="auto")
    assert topo.tp_size == ctx.world_size
    store_dir = ctx.store_dir
    ctx.shutdown()
    assert not dist.is_initialized()
    assert store_dir is None or not os.path.exists(store_dir), store_dir
    print(f"OK rank={ctx.rank} world={ctx.world_size} store={'file' if store_dir else 'env'}")
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU/gloo path even on a GPU box
    return env


def test_backend_for_device() -> None:
    assert backend_for_device("cuda") == "nccl"
    assert backend_for_device(torch.device("cuda", 1)) == "nccl"
    assert backend_for_device("cpu") == "gloo"
    with pytest.raises(ValueError, match="'meta'"):
        backend_for_device("meta")
    assert device_type_for_backend("gloo") == "cpu"
    assert device_type_for_backend("nccl") == "cuda"
    with pytest.raises(ValueError, match="mpi"):
        device_type_for_backend("mpi")


def test_device_for_local_rank() -> None:
    assert device_for_local_rank(3, "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="local_rank must be >= 0"):
        device_for_local_rank(-1, "cpu")
    with pytest.raises(ValueError, match="'tpu'"):
        device_for_local_rank(0, "tpu")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert device_for_local_rank(0, "cuda") == torch.device("cuda", 0)
        with pytest.raises(ValueError, match=f"has {n} GPU"):
            device_for_local_rank(n, "cuda")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            device_for_local_rank(0, "cuda")


def test_partial_launch_environment_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from tp_fuse.comm import init_distributed

    if dist.is_initialized():
        pytest.skip("a default process group is initialized in this pytest process")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"\['MASTER_ADDR', 'MASTER_PORT'\] missing"):
        init_distributed(device_type="cpu")
    assert not dist.is_initialized()


def test_single_process_fallback(tmp_path: Path) -> None:
    script = tmp_path / "single.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK rank=0 world=1 store=file" in proc.stdout


@pytest.mark.multirank
def test_torchrun_environment(tmp_path: Path) -> None:
    script = tmp_path / "launched.py"
    script.write_text(_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    env = _env()
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert f"OK rank={r} world=2 store=env" in proc.stdout, proc.stdout
