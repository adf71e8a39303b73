"""Checkpoints, single process: exact resume, atomic saves, clear errors on bad checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import pytest

from tp_fuse.launch.checkpoint import dcp_io
from tp_fuse.launch.api import train
from tp_fuse.launch.checkpoint.manager import MANIFEST, CheckpointError
from tp_fuse.launch.checkpoint.files import read_manifest
from tp_fuse.launch.logging.metrics import read_jsonl

COMMON = [
    "+model=gpt", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=2", "data.seq_len=32",
    "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.log_interval=1",
    "trainer.val_interval=0", "logger=none", "optim.warmup_steps=3", "trainer.max_steps=12",
    "fp8=delayed", "fp8.amax_history_len=16", "trainer.progress=false",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 12-step reference run."""
    run_dir = tmp_path_factory.mktemp("straight")
    return train(COMMON, str(run_dir))


def test_resume_repeats_the_exact_loss_trajectory(straight, tmp_path):
    ck = str(tmp_path / "ck")
    run_dir = str(tmp_path / "run")
    first = train([*COMMON, "trainer.exit_at_step=6", f"checkpoint.dir={ck}"], run_dir)
    assert first.last_step == 6 and first.checkpoint == os.path.join(ck, "step_00000006")
    second = train([*COMMON, "checkpoint.resume=true", f"checkpoint.dir={ck}"], run_dir)
    assert second.start_step == 6
    resumed = {**first.losses, **second.losses}
    # Bitwise: model, AdamW moments, FP8 amax histories and scales, data position, RNG.
    assert resumed == straight.losses
    steps = [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == list(range(1, 13))
    assert straight.losses[12] < straight.losses[1]


def test_crash_during_save_keeps_the_last_good_checkpoint(straight, tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")
    real_save = dcp_io.dcp.save
    calls = []

    def save_then_crash(*args, **kwargs):
        calls.append(1)
        real_save(*args, **kwargs)  # the data files of step 8 are written ...
        if len(calls) == 2:
            raise RuntimeError("simulated crash in the middle of a save")  # ... but never completed

    monkeypatch.setattr(dcp_io.dcp, "save", save_then_crash)
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 8 .* failed: RuntimeError: simulated crash"
                       r".*the last good checkpoint .*step_00000004 is intact"):
        train([*COMMON, "checkpoint.interval=4", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    monkeypatch.setattr(dcp_io.dcp, "save", real_save)
    # The partial step 8 was removed (its space given back); step 4 and its pointer are untouched.
    assert sorted(os.listdir(ck)) == ["latest", "run.json", "step_00000004"]
    assert open(os.path.join(ck, "latest")).read().strip() == "step_00000004"

    resumed = train([*COMMON, "checkpoint.resume=true", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert resumed.start_step == 4
    assert resumed.losses == {s: v for s, v in straight.losses.items() if s > 4}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint directory with step 4 (small, for the error cases)."""
    ck = tmp_path_factory.mktemp("saved_ck")
    train([*COMMON, "trainer.max_steps=4", "checkpoint.interval=4", f"checkpoint.dir={ck}"],
          str(tmp_path_factory.mktemp("saved_run")))
    return ck


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _resume(ck, tmp_path, *extra):
    return train([*COMMON, "trainer.max_steps=5", "checkpoint.resume=true", f"checkpoint.dir={ck}", *extra],
                 str(tmp_path / "run"))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.resume=true but there is no complete checkpoint in"):
        _resume(tmp_path / "empty", tmp_path)


def test_corrupt_checkpoint_is_a_clear_error(saved, tmp_path):
    ck = _copy(saved, tmp_path / "ck")
    step_dir = ck / "step_00000004"
    data_file = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"is corrupt: file {data_file.name} does not match its SHA-256"):
        _resume(ck, tmp_path)
    data_file.write_bytes(bytes(raw[:100]))
    with pytest.raises(CheckpointError, match=rf"is corrupt: file {data_file.name} has 100 bytes"):
        _resume(ck, tmp_path)


def test_incomplete_checkpoint_is_skipped_and_explicit_one_rejected(saved, tmp_path):
    ck = _copy(saved, tmp_path / "ck")
    os.remove(ck / "step_00000004" / MANIFEST)
    # Without a manifest the directory is not a complete checkpoint: nothing to resume.
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _resume(ck, tmp_path)
    with pytest.raises(CheckpointError, match="is incomplete or not a tp-fuse checkpoint"):
        read_manifest(str(ck / "step_00000004"))


def test_metadata_is_never_unpickled_into_arbitrary_objects(saved, tmp_path):
    ck = _copy(saved, tmp_path / "ck")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    step_dir = ck / "step_00000004"
    payload = pickle.dumps(Evil())
    (step_dir / ".metadata").write_bytes(payload)
    # An attacker can rewrite the manifest too: the hashes then match, the unpickler must hold.
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][".metadata"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"(posix|os)\.system, which is not allowed"):
        _resume(ck, tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_incompatible_model_is_a_clear_error(saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"different model: model.hidden_size: checkpoint 64, config 128"):
        _resume(saved, tmp_path, "model.hidden_size=128")
    with pytest.raises(CheckpointError, match=r"fp8.amax_history_len was 16, config has 8"):
        _resume(saved, tmp_path, "fp8.amax_history_len=8")
