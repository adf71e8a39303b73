"""Runs that stop instead of training on garbage, and errors instead of aborts (one process).

Non-finite steps (NaN/inf loss, gradient norm, or an FP8 amax that the saturating cast
would hide) are skipped and stop the run after ``trainer.max_nonfinite_steps`` in a row;
non-finite state is never saved; a full disk is named as such; and every field a run
needs is validated before any process group starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tp_fuse.launch.checkpoint import dcp_io
from tp_fuse.launch.api import compose, train
from tp_fuse.launch.checkpoint.manager import CheckpointError
from tp_fuse.launch.config_validate import validate
from tp_fuse.launch.health import NonfiniteGuard, TrainingDivergedError
from tp_fuse.launch.logging.metrics import read_jsonl
from tp_fuse.layers import GPT
from test_checkpoint_resume import COMMON
from tp_fuse.quantization import DelayedScalingQuantizer
from tp_fuse.recipe import DelayedScaling

SMALL = [*COMMON, "trainer.max_steps=8"]


def _inf_weight_factory(*args, **kwargs):
    """``tp_fuse.layers.GPT`` with one inf entry in the first MLP weight (a poisoned checkpoint, a bad init)."""
    model = GPT(*args, **kwargs)
    name, p = next((n, p) for n, p in model.named_parameters() if "fc1" in n and p.dim() == 2)
    with torch.no_grad():
        p[0, 0] = float("inf")
    return model


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_inf_weight_under_fp8_stops_the_run_and_reaches_the_logs(tmp_path, recipe):
    run = tmp_path / "run"
    with pytest.raises(TrainingDivergedError, match=r"training diverged: step 4 .* 4 non-finite steps in a row "
                                                    r"\(an FP8 amax was NaN/inf \(.*fc1.*\)\).*no checkpoint"):
        train([*SMALL, f"fp8={recipe}"], str(run), model_factory=_inf_weight_factory)
    metrics = read_jsonl(str(run / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["skipped_step"] == 1.0 and m["fp8_nonfinite_amax_count"] > 0 for m in metrics)
    fp8 = read_jsonl(str(run / "fp8_stats.jsonl"))
    counts = {k: v for k, v in fp8[-1].items() if k.endswith("/nonfinite_amax_count")}
    assert counts and max(counts.values()) > 0


def test_an_inf_amax_does_not_freeze_the_delayed_scale():
    q = DelayedScalingQuantizer(DelayedScaling(amax_history_len=1024, amax_compute_algo="max"), "input")
    for amax in (2.0, float("inf"), 4.0):
        q.amax_history[0] = amax
        q.update()
    # The inf step kept the previous scale and was counted; the next finite amax counts again.
    assert q.nonfinite_amax_count.item() == 1
    assert torch.isfinite(q.amax_history).all()
    assert q.scale.item() == pytest.approx(q.fp8_max / 4.0)


def test_divergence_keeps_the_last_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    with pytest.raises(TrainingDivergedError, match=r"the last good checkpoint is .*step_0000000\d"):
        train([*COMMON, "fp8=none", "trainer.max_steps=40", "optim.lr=1e4", "optim.min_lr=0", "optim.warmup_steps=0",
               "checkpoint.interval=1", "checkpoint.keep=2", "trainer.max_nonfinite_steps=2", f"checkpoint.dir={ck}"],
              str(tmp_path / "run"))
    kept = sorted(p for p in os.listdir(ck) if p.startswith("step_"))
    assert kept, "retention must never delete the newest finite checkpoint"
    # Every kept checkpoint resumes (it is finite: the save refuses anything else).
    result = train([*COMMON, "fp8=none", f"trainer.max_steps={int(kept[-1][5:])}", "checkpoint.resume=true",
                    f"checkpoint.dir={ck}"], str(tmp_path / "run2"))
    assert result.already_complete


def test_non_finite_state_is_never_saved(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    args = [*SMALL, "fp8=none", "trainer.max_nonfinite_steps=100", "checkpoint.interval=1", f"checkpoint.dir={ck}"]
    # The step is not finite: the trainer stops before it would save it (issue 39.7) ...
    with pytest.raises(TrainingDivergedError, match=r"step 1 is not finite .* would be saved as the newest "
                                                    r"checkpoint.*no checkpoint was saved"):
        train(args, str(tmp_path / "run"), model_factory=_inf_weight_factory)
    # ... and should a non-finite state ever get past that, the save itself refuses it.
    monkeypatch.setattr(NonfiniteGuard, "stop_if_ending_nonfinite", lambda *a, **k: None)
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 1 .* refusing to save: parameter .*fc1.* "
                                              r"is not finite .*no earlier checkpoint"):
        train(args, str(tmp_path / "run"), model_factory=_inf_weight_factory)
    # Nothing was written; the job that created checkpoint.dir removes it again when it
    # saved nothing (no empty checkpoint dirs), so the dir may be gone altogether.
    assert not [p for p in (os.listdir(ck) if ck.exists() else []) if p.startswith(("step_", ".tmp-"))]


def test_write_failure_names_the_cause(tmp_path, monkeypatch):
    real = dcp_io.FileSystemWriter

    class FullDisk(real):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    ck = tmp_path / "ck"
    train([*SMALL, "trainer.max_steps=2", "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    monkeypatch.setattr(dcp_io, "FileSystemWriter", FullDisk)
    with pytest.raises(CheckpointError, match=rf"saving checkpoint step 4 in {ck} failed: no space left on the "
                                              rf"device of .*; the last good checkpoint .*step_00000002 is intact"):
        train([*SMALL, "trainer.max_steps=4", "checkpoint.interval=2", "checkpoint.resume=true",
               f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert sorted(p for p in os.listdir(ck) if "step_" in p) == ["step_00000002"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1.8 MB filesystem: room for one checkpoint of the SMALL model (~1.2 MB), not two."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1800k", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_real_full_disk_is_named_and_the_last_checkpoint_survives(tmp_path, tiny_tmpfs):
    ck = tiny_tmpfs / "ck"
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 4 .* failed: no space left on the device "
                                              r"of .*the last good checkpoint .*step_00000002 is intact"):
        train([*SMALL, "trainer.max_steps=4", "checkpoint.interval=2", f"checkpoint.dir={ck}"],
              str(tmp_path / "run"))
    result = train([*SMALL, "trainer.max_steps=2", "checkpoint.resume=true", f"checkpoint.dir={ck}"],
                   str(tmp_path / "run2"))
    assert result.already_complete and result.start_step == 2


# ---- validation before start-up -------------------------------------------------------


def _invalid(overrides, match, world_size=1):
    with pytest.raises(ValueError, match=match):
        validate(compose(["+model=gpt", *overrides]), world_size)


@pytest.mark.parametrize("override, match", [
    ("optim.lr=inf", r"optim\.lr must be a finite number, got inf"),
    ("optim.lr=nan", r"optim\.lr must be a finite number"),
    ("optim.lr=0", r"optim\.lr must be > 0"),
    ("optim.eps=0", r"optim\.eps must be > 0, got 0"),
    ("optim.weight_decay=-0.1", r"optim\.weight_decay must be >= 0"),
    ("parallel.timeout_s=0", r"parallel\.timeout_s must be a finite number > 0"),
    ("trainer.max_nonfinite_steps=-1", r"trainer\.max_nonfinite_steps must be >= 0"),
    ("trainer.compile_mode=reduce-overhead", r"trainer\.compile_mode=reduce-overhead needs trainer\.compile=true"),
    ("trainer.compile_mode=fast", r"trainer\.compile_mode: expected one of 'default' \| 'reduce-overhead'"),
])
def test_optimizer_and_runtime_fields_are_validated(override, match):
    _invalid([override], match)


def test_data_files_are_validated_before_start(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 101)
    _invalid(["data=text", f"data.paths=[{tmp_path / 'missing.txt'}]"], r"data\.paths\[0\]: no such file")
    _invalid(["data=text", f"data.paths=[{tmp_path}]"], r"data\.paths\[0\]: .* is not a file")
    _invalid(["data=text", f"data.paths=[{short},{empty}]"], r"data\.paths\[1\]: .*empty\.txt' is empty")
    _invalid(["data=text", f"data.paths=[{short}]"], r"the corpus has 100 tokens; data\.seq_len=128 .* needs")
    _invalid(["data=bin", f"data.paths=[{odd}]"], r"has 101 bytes, not a multiple of 2")


def test_overlap_yaml_is_validated_before_start(tmp_path):
    bad = tmp_path / "tp_comm_overlap_cfg.yaml"
    bad.write_text("qkv_fprop:\n  method: ring_exchange\n  num_splits: [\n")
    _invalid(["overlap=on", f"overlap.config={tmp_path / 'nope.yaml'}"], r"overlap\.config: no such file", 2)
    _invalid(["overlap=on", f"overlap.config={bad}"], rf"overlap\.config={bad}: .*{bad}: not valid YAML: line 4, column 1", 2)


def test_checkpoint_dir_must_be_creatable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _invalid([f"checkpoint.dir={blocker}"], r"checkpoint\.dir: .*a_file exists and is not a directory")
    _invalid([f"checkpoint.dir={blocker / 'ck'}"], r"checkpoint\.dir: .*cannot be created: .*a_file is not a dir")


def test_timeout_reaches_the_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    seen = {}
    real = dist.init_process_group

    def spy(*args, **kwargs):
        seen["timeout"] = kwargs.get("timeout")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", spy)
    train([*SMALL, "trainer.max_steps=1", "parallel.timeout_s=42.5"], str(tmp_path / "run"))
    assert seen["timeout"].total_seconds() == 42.5


def test_command_line_divergence_is_one_clear_line_and_exit_status_1(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [a for a in COMMON if not a.startswith(("optim.", "trainer.max_steps", "fp8"))]
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "launch", "train.py"), *args, "trainer.max_steps=30", "optim.lr=1e4",
         "optim.min_lr=0", "optim.warmup_steps=0", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[tp-fuse] error: training diverged: step" in proc.stderr
    assert "Traceback" not in proc.stderr
