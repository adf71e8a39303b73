"""Checkpoints as untrusted input, and runs that cannot lose data (issue: checkpoint security).

Crafted checkpoints must not run code by either route DCP offers (the ``.metadata`` pickle,
and ``BytesStorageMetadata`` entries that DCP's default planner unpickles); the start-up
decision says loudly which checkpoint it uses; a fresh run never starts over (or later
resumes) another run's checkpoints; a finished run reports that it is complete.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import inspect
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import metadata as dcp_md

from tp_fuse.launch.checkpoint import manager as manager_mod
from tp_fuse.launch.checkpoint import safe_dcp
from tp_fuse.launch.api import train
from tp_fuse.launch.checkpoint.manager import MANIFEST, CheckpointError
from tp_fuse.launch.checkpoint.files import read_manifest
from tp_fuse.launch.checkpoint.run_identity import IDENTITY_FILE, decide_start, list_step_dirs
from test_checkpoint_resume import COMMON

SMALL = [*COMMON, "trainer.max_steps=4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of one run at steps 2 and 4."""
    ck = tmp_path_factory.mktemp("safety_ck")
    result = train([*SMALL, "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(tmp_path_factory.mktemp("run")))
    return ck, result


def _copy(ck, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(ck, dst)
    return dst


def _rewrite_manifest(step_dir: pathlib.Path, **files: bytes) -> None:
    """An attacker with write access recomputes the manifest's hashes: they prove nothing."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _resume(ck, tmp_path, *extra):
    return train([*SMALL, "trainer.max_steps=5", "checkpoint.resume=true", f"checkpoint.dir={ck}", *extra],
                 str(tmp_path / "run"))


def _short(s: str) -> bytes:
    data = s.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _dotted_global_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol 4: STACK_GLOBAL(module, dotted name)(arg) -- resolves attributes of attributes."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(arg) + b"\x85R."


# ---- route 1: the .metadata pickle -------------------------------------------------------


def test_dotted_name_through_an_allowed_module_does_not_run_code(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    marker = tmp_path / "pwned"
    payload = _dotted_global_pickle("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    _rewrite_manifest(ck / "step_00000004", **{".metadata": payload})
    for verify in ("true", "false"):
        with pytest.raises(CheckpointError, match=r"\.metadata: checkpoint metadata refers to "
                                                  r"torch\.distributed\.checkpoint\.metadata\.os\.system"):
            _resume(ck, tmp_path, f"checkpoint.verify={verify}")
    assert not marker.exists()


def test_every_allowed_global_is_plain_data():
    """Property: the allowlist holds classes of data (dataclasses, enums, sizes, paths, dicts)
    and dtypes -- nothing that can be called for its side effects -- and names them exactly."""
    data_types = (torch.Size, collections.OrderedDict, pathlib.PurePath)
    for (module, name), value in safe_dcp.ALLOWED_GLOBALS.items():
        assert "." not in name, (module, name)
        if isinstance(value, torch.dtype):
            assert getattr(torch, name) is value
            continue
        if value is safe_dcp._layout_by_name:
            with pytest.raises(pickle.UnpicklingError):
                value("os.system")
            assert value("torch.strided") is torch.strided
            continue
        assert inspect.isclass(value), (module, name, value)
        assert dataclasses.is_dataclass(value) or issubclass(value, (enum.Enum, *data_types)), (module, name)


@settings(max_examples=60, deadline=None)
@given(module=st.sampled_from(sorted({m for m, _ in safe_dcp.ALLOWED_GLOBALS})),
       attr=st.sampled_from(["os.system", "subprocess.Popen", "builtins.eval", "torch.load", "pickle.loads",
                             "__builtins__.exec", "_StorageInfo.__init__.__globals__"]))
def test_no_dotted_path_from_an_allowed_module_resolves(module, attr):
    with pytest.raises(pickle.UnpicklingError, match="is not allowed"):
        safe_dcp._MetadataUnpickler(io.BytesIO(_dotted_global_pickle(module, attr, "x"))).load()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_metadata_bytes_give_a_checkpoint_error(tmp_path_factory, raw):
    d = tmp_path_factory.mktemp("fuzz", numbered=True)
    (d / ".metadata").write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        safe_dcp.read_metadata(str(d))


def test_a_declared_huge_length_does_not_allocate_it(tmp_path):
    """BINBYTES8 declaring 16 GiB in 20 bytes: the C unpickler allocates the declared size
    first (the fuzz test below got the run OOM-killed); the metadata reader must not."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x8e" + (16 << 30).to_bytes(8, "little") + b"abc")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from tp_fuse.launch.checkpoint import safe_dcp\n"
            f"try:\n    safe_dcp.read_metadata({str(tmp_path)!r})\nexcept safe_dcp.CheckpointError as e:\n"
            "    print(e)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert "not a readable DCP metadata file (EOFError" in proc.stdout, proc.stdout + proc.stderr


# ---- route 2: BytesStorageMetadata -> torch.load(weights_only=False) ---------------------


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bytes_entry_is_refused_and_never_unpickled(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    step_dir = ck / "step_00000004"
    marker = tmp_path / "pwned"
    md = safe_dcp.read_metadata(str(step_dir))
    # Declare train/step as pickled bytes stored in a crafted data file.
    md.state_dict_metadata["train/step"] = dcp_md.BytesStorageMetadata()
    index = next(i for i in md.storage_data if i.fqn == "train/step")
    evil = pickle.dumps(_Evil(marker))
    md.storage_data[index] = type(md.storage_data[index])(relative_path="__0_1.distcp", offset=0, length=len(evil))
    _rewrite_manifest(step_dir, **{".metadata": pickle.dumps(md), "__0_1.distcp": evil})
    with pytest.raises(CheckpointError, match=r"refers to torch\.distributed\.checkpoint\.metadata\.BytesStorage"):
        _resume(ck, tmp_path)
    assert not marker.exists()
    # Should such an entry ever get past the metadata check, the planner refuses it too.
    with pytest.raises(CheckpointError, match="stored as pickled bytes"):
        safe_dcp.SafeLoadPlanner().load_bytes(type("R", (), {"dest_index": index})(), io.BytesIO(evil))
    assert not marker.exists()


def test_metadata_structure_is_checked(saved):
    md = safe_dcp.read_metadata(str(saved[0] / "step_00000004"))
    index = next(iter(md.storage_data))
    bad_path = dataclasses.replace(md, storage_data={**md.storage_data, index: type(md.storage_data[index])(
        relative_path="../../etc/passwd", offset=0, length=10)})
    with pytest.raises(CheckpointError, match=r"points at '\.\./\.\./etc/passwd'"):
        safe_dcp.validate_metadata(bad_path, "x/.metadata")
    bytes_entry = dataclasses.replace(md, state_dict_metadata={"k": dcp_md.BytesStorageMetadata()}, storage_data={})
    with pytest.raises(CheckpointError, match=r"entry 'k' is a BytesStorageMetadata, expected TensorStorageMetadata"):
        safe_dcp.validate_metadata(bytes_entry, "x/.metadata")



def test_file_name_patterns_refuse_a_trailing_newline(saved, tmp_path):
    """Issue 24 item 8: `^__\\d+_\\d+\\.distcp$` accepted "__0_0.distcp\\n" (`$` matches before a
    final newline): in .metadata, in a manifest, and step_00000002\\n as a step directory."""
    md = safe_dcp.read_metadata(str(saved[0] / "step_00000004"))
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    newline = dataclasses.replace(md, storage_data={**md.storage_data, index: type(info)(
        relative_path=info.relative_path + "\n", offset=info.offset, length=info.length)})
    with pytest.raises(CheckpointError, match=r"points at '__0_0\.distcp\\n', expected a __<rank>_<n>\.distcp file"):
        safe_dcp.validate_metadata(newline, "x/.metadata")
    ck = _copy(saved[0], tmp_path)
    step = ck / "step_00000004"
    manifest = json.loads((step / MANIFEST).read_text())
    name = next(n for n in manifest["files"] if n.endswith(".distcp"))
    manifest["files"][name + "\n"] = manifest["files"].pop(name)
    (step / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"files lists '__0_0\.distcp\\n', expected"):
        read_manifest(str(step))
    os.mkdir(ck / "step_00000009\n")
    assert [s for s, _, _ in list_step_dirs(str(ck))] == [2, 4]


# ---- which checkpoint is used, and why ------------------------------------------------


def test_a_newer_checkpoint_without_manifest_is_named_when_an_older_one_is_used(saved, tmp_path, capfd):
    ck = _copy(saved[0], tmp_path)
    os.remove(ck / "step_00000004" / MANIFEST)
    result = _resume(ck, tmp_path)
    err = capfd.readouterr().err
    assert result.start_step == 2
    assert "resuming run" in err and "step_00000002" in err
    assert "step_00000004 is newer but has no tp_fuse_checkpoint.json" in err


def test_verification_off_is_said_out_loud(saved, tmp_path, capfd):
    ck = _copy(saved[0], tmp_path)
    _resume(ck, tmp_path, "checkpoint.verify=false")
    assert "checkpoint.verify=false: loading" in capfd.readouterr().err


# ---- run identity ------------------------------------------------------------------------


def test_fresh_run_refuses_another_runs_checkpoints(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    before = sorted(os.listdir(ck))
    with pytest.raises(CheckpointError, match=r"already holds 2 checkpoint\(s\) of run [0-9a-f]{32} .*"
                                              r"checkpoint\.resume=true.*checkpoint\.overwrite=true"):
        train([*SMALL, "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert sorted(os.listdir(ck)) == before


def test_overwrite_starts_a_new_run_whose_checkpoints_survive_retention(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    old_run = json.loads((ck / IDENTITY_FILE).read_text())["run_id"]
    result = train([*SMALL, "checkpoint.interval=2", "checkpoint.keep=1", "checkpoint.overwrite=true",
                    f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert result.checkpoint == str(ck / "step_00000004")
    assert sorted(p for p in os.listdir(ck) if p.startswith("step_")) == ["step_00000004"]
    manifest = json.loads((ck / "step_00000004" / MANIFEST).read_text())
    assert manifest["run_id"] != old_run
    assert json.loads((ck / IDENTITY_FILE).read_text())["run_id"] == manifest["run_id"]


def test_an_elastic_restart_never_resumes_another_runs_checkpoint(saved, tmp_path):
    ck = _copy(saved[0], tmp_path)
    run_a = json.loads((ck / IDENTITY_FILE).read_text())["run_id"]
    # Job B started fresh here and failed before claiming the directory; its restart must
    # not pick up run A's checkpoints.
    decision = decide_start(str(ck), False, restarted=True, job="job-B", overwrite=False)
    assert decision.resume_from is None and "already holds" in decision.error
    # Job A's own restart resumes A's newest checkpoint.
    job_a = json.loads((ck / IDENTITY_FILE).read_text())["job"]
    decision = decide_start(str(ck), False, restarted=True, job=job_a, overwrite=False)
    assert decision.error is None and decision.run_id == run_a
    assert decision.resume_from == str(ck / "step_00000004")
    # ... but not a checkpoint of another run that was copied in later.
    manifest = json.loads((ck / "step_00000004" / MANIFEST).read_text())
    manifest["run_id"] = "someone-else"
    (ck / "step_00000004" / MANIFEST).write_text(json.dumps(manifest))
    decision = decide_start(str(ck), False, restarted=True, job=job_a, overwrite=False)
    assert decision.resume_from == str(ck / "step_00000002")


def test_resuming_a_finished_run_reports_it_complete(saved, tmp_path, capfd):
    ck, first = saved
    ck = _copy(ck, tmp_path)
    result = train([*SMALL, "checkpoint.resume=true", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert result.already_complete and result.start_step == 4 and result.losses == {}
    assert result.final_loss == first.final_loss
    assert "the run is already complete" in capfd.readouterr().err


def test_dcp_size_mismatch_names_the_key_and_both_shapes(saved, tmp_path):
    """Issue 24 item 8: DCP's message was `CheckpointException ranks:dict_keys([0])` plus a
    traceback; the error now says the key and both shapes in one line."""
    ck = _copy(saved[0], tmp_path)
    step_dir = ck / "step_00000004"
    metadata = safe_dcp.read_metadata(str(step_dir))
    key = next(k for k, e in metadata.state_dict_metadata.items() if len(e.size) == 2)
    entry = metadata.state_dict_metadata[key]
    current = entry.size
    entry.size = torch.Size([current[0] * 2, current[1]])
    # Chunks that cover the new size: one that did not would be refused before DCP reads it.
    (chunk,) = entry.chunks
    chunk.sizes = entry.size
    _rewrite_manifest(step_dir, **{".metadata": pickle.dumps(metadata)})
    with pytest.raises(CheckpointError) as info:
        _resume(ck, tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and "dict_keys" not in msg, msg
    assert (f"rank 0: ValueError: Size mismatch between saved {entry.size} and current: {current} for {key}"
            in msg), msg


def test_a_distcp_link_is_never_opened_by_dcp(saved, tmp_path, monkeypatch):
    """Issue 24 item 8: DCP's reader opened data files with Path.open, following a link out of
    the checkpoint. Rank 0's manifest check lstat's them first, but other ranks do not run it
    and a link can be swapped in after it: with the check skipped (as on those ranks), the
    reader itself refuses the link."""
    ck = _copy(saved[0], tmp_path)
    step = ck / "step_00000004"
    outside = tmp_path / "outside"
    outside.mkdir()
    name = next(p.name for p in step.iterdir() if p.name.endswith(".distcp"))
    shutil.move(step / name, outside / name)
    os.symlink(outside / name, step / name)
    monkeypatch.setattr(manager_mod, "verify_files", lambda *a, **k: None)
    with pytest.raises(CheckpointError, match=rf"checkpoint data file .*{name} is a symbolic link; refusing to follow"):
        _resume(ck, tmp_path)


def test_a_checkpoint_directory_that_goes_while_listing_lists_nothing(tmp_path, monkeypatch):
    """Rank 0 removes an empty checkpoint directory at the end of a run while other ranks
    finish their last step; a listing that saw the directory and then lost it must not
    raise (a CI run failed a TP=2 launcher test on rank 1 with FileNotFoundError)."""
    gone = str(tmp_path / "checkpoints")
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: p == gone or real_isdir(p))  # "it was there"
    assert list_step_dirs(gone) == []


def test_training_does_not_look_for_checkpoints_on_healthy_steps(tmp_path, monkeypatch):
    """The non-finite guard names the last good checkpoint only when it stops the run: no
    directory listing per step (it ran on every rank at every step before)."""
    calls = []
    real = manager_mod.CheckpointManager.latest_of_run

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(manager_mod.CheckpointManager, "latest_of_run", counted)
    result = train([*COMMON, "trainer.max_steps=3", "fp8=none"], str(tmp_path / "run"))
    assert sorted(result.losses) == [1, 2, 3]
    assert len(calls) == 1, calls  # the end-of-run summary's "last checkpoint" line only
