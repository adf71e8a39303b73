"""W&B never takes the training down: an online start that fails falls back to offline.

No real network: the "server" is a loopback port nobody listens on (connection refused),
or ``wandb.init`` is replaced by one that times out. One W&B run id per run directory.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref

import pytest

from tp_fuse.kernels import fp8_emulation
from tp_fuse.launch.config import LoggerConfig
from tp_fuse.launch.logging.wandb_logger import WandbLogger
from tp_fuse.launch.logging.wandb_safe import run_id_for

wandb = pytest.importorskip("wandb")


def _closed_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: connecting is refused


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("WANDB_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)  # "configured": logger.mode=auto goes online
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_loopback_port()}")
    yield tmp_path
    wandb.teardown()


def test_unreachable_server_falls_back_to_offline(wandb_env, capsys):
    run_dir = str(wandb_env / "run")
    os.makedirs(run_dir)
    logger = WandbLogger(LoggerConfig(init_timeout_s=2.0), run_dir, {"x": 1})
    assert logger.requested_mode == "online" and logger.mode == "offline"
    err = capsys.readouterr().err
    assert "W&B could not start online" in err and "logging offline instead" in err
    assert "wandb sync" in logger.describe()
    logger.log(1, {"loss": 1.0})
    logger.finish()
    run_id = run_id_for(run_dir)
    assert any(d.startswith("offline-run-") and d.endswith(run_id) for d in os.listdir(os.path.join(run_dir, "wandb")))


def test_init_timeout_falls_back_and_restart_keeps_the_run_id(wandb_env, monkeypatch, capsys):
    real_init = wandb.init
    modes = []

    def init(*args, mode=None, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("Timed out while retrying")  # what a dead network gives
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    run_dir = str(wandb_env / "run")
    os.makedirs(run_dir)
    first = WandbLogger(LoggerConfig(), run_dir, {})
    first.finish()
    second = WandbLogger(LoggerConfig(), run_dir, {})  # an elastic restart in the same run directory
    second.finish()
    assert modes == ["online", "offline", "online", "offline"]
    assert first.run.id == second.run.id == run_id_for(run_dir)
    assert "CommError: Timed out" in capsys.readouterr().err


def test_run_id_file_is_checked(tmp_path):
    run_dir = str(tmp_path)
    first = run_id_for(run_dir)
    assert run_id_for(run_dir) == first
    with open(os.path.join(run_dir, "wandb", "run_id"), "w") as f:
        f.write("../../etc\n")
    with pytest.raises(ValueError, match=r"wandb/run_id: expected a W&B run id"):
        run_id_for(run_dir)


def test_wandb_threads_are_declared_matmul_free(wandb_env, monkeypatch):
    """W&B starts threads for an offline run; undeclared, they would keep every CPU FP8
    GEMM of the default run off the AMX-BF16 units (fp8_emulation.emulation_units)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(fp8_emulation, "_MATMUL_FREE_THREADS", weakref.WeakSet())
    before = set(threading.enumerate())
    fp8_emulation.declare_matmul_free_threads(before)  # the test runner's own threads
    run_dir = str(wandb_env / "run")
    os.makedirs(run_dir)
    logger = WandbLogger(LoggerConfig(), run_dir, {})
    assert set(threading.enumerate()) - before, "expected W&B to start a thread (else this test checks nothing)"
    assert fp8_emulation._other_threads_matmul_free()
    logger.finish()


def test_disabled_mode_does_not_start_wandb(wandb_env, monkeypatch):
    """WANDB_MODE=disabled costs nothing: no wandb.init (whose import and thread cost every
    launcher process about a second), and the log lines say it is disabled."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(wandb, "init", lambda *a, **k: pytest.fail("wandb.init called in disabled mode"))
    run_dir = str(wandb_env / "run")
    os.makedirs(run_dir)
    logger = WandbLogger(LoggerConfig(), run_dir, {})
    assert logger.mode == "disabled" and logger.run_path is None
    assert logger.describe() == "W&B: disabled (WANDB_MODE=disabled)"
    logger.log(1, {"loss": 1.0})
    logger.finish()
    assert not os.path.exists(os.path.join(run_dir, "wandb"))
