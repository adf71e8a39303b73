"""Checkpoints that cannot change the program, hide gaps, inflate, or be shared (issues 39 and 40).

Each test crafts what the attacker and unlucky-operator rounds did, with the manifest
rehashed so that hash checks pass:

* 39.6: ``.metadata`` with a prefix whose pickle ``BUILD`` sets attributes on
  ``pathlib.PosixPath`` (``rename``, ``_str``) before the genuine metadata;
* 40.1: chunks that leave part of a tensor uncovered, or cover it twice;
* 40.2: a data slice whose zip record inflates far beyond what its chunk can hold;
* 39.7: a lock file that is a hard link to another file, lock records with ``since`` out of
  range, and a checkpoint with huge finite embedding rows that trains to NaN;
* 40.5: a live job's lock file deleted while it runs.
"""

from __future__ import annotations

import re
import fcntl
import io
import json
import os
import pathlib
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import filesystem as dcp_fs

from tp_fuse.launch.api import train
from tp_fuse.launch.checkpoint import safe_dcp
from tp_fuse.launch.checkpoint.chunk_tiling import tiling_problem
from tp_fuse.launch.checkpoint.dir_lock import LOCK_FILE, acquire
from tp_fuse.launch.checkpoint.manager import CheckpointError, CheckpointManager
from tp_fuse.launch.checkpoint.run_identity import IDENTITY_FILE, decide_start
from tp_fuse.launch.health import TrainingDivergedError
from test_checkpoint_resume import COMMON
from test_checkpoint_safety import _copy, _rewrite_manifest, _short

SMALL = [*COMMON, "trainer.max_steps=4"]
STEP = "step_00000004"
EMBEDDING = "model/embedding.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint directory with steps 2 and 4 of one finished run."""
    ck = tmp_path_factory.mktemp("integrity_ck")
    train([*SMALL, "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(tmp_path_factory.mktemp("run")))
    return ck


def _resume(ck, tmp_path, *extra):
    return train([*SMALL, "trainer.max_steps=5", "checkpoint.resume=true", f"checkpoint.dir={ck}", *extra],
                 str(tmp_path / "run"))


def _newest(ck) -> str:
    return sorted(p for p in os.listdir(ck) if p.startswith("step_"))[-1]


# ---- 39.6: metadata that would change a class ------------------------------------------------


_POSIX_PATH = _short(pathlib.PosixPath.__module__) + _short("PosixPath") + b"\x93"  # STACK_GLOBAL
_SNAPSHOT_CLASSES = (pathlib.PurePath, pathlib.Path, pathlib.PurePosixPath, pathlib.PosixPath)


@pytest.fixture
def classes_restored():
    """What the crafted pickles target, as it was; put back afterwards should a load change
    it (on code without the fix), so that one failing test does not break the session."""
    members = list(dcp_md._MEM_FORMAT_ENCODING)
    before = {cls: dict(vars(cls)) for cls in _SNAPSHOT_CLASSES}
    values = {m: m.__dict__.copy() for m in members}
    yield before
    for cls, attrs in before.items():
        for name in set(vars(cls)) - set(attrs):
            delattr(cls, name)
    for m, d in values.items():
        m.__dict__.clear()
        m.__dict__.update(d)


def _build_on_posix_path(attr: str, value_ops: bytes) -> bytes:
    """Pickle ops: ``setattr(pathlib.PosixPath, attr, value)`` by BUILD with a slot state, then
    POP. No MEMOIZE, so that the genuine metadata after it still finds its memo entries."""
    return b"\x80\x04" + _POSIX_PATH + b"N}" + _short(attr) + value_ops + b"s\x86b0"


@pytest.mark.parametrize("attr, value_ops", [("rename", _POSIX_PATH), ("_str", _short("/attacker/path"))],
                         ids=["rename_becomes_a_no_op", "every_path_becomes_one"])
def test_metadata_that_sets_an_attribute_of_a_class_is_refused(saved, tmp_path, classes_restored, attr, value_ops):
    ck = _copy(saved, tmp_path)
    step = ck / STEP
    genuine = (step / ".metadata").read_bytes()
    _rewrite_manifest(step, **{".metadata": _build_on_posix_path(attr, value_ops) + genuine})
    rename = pathlib.Path.rename
    with pytest.raises(CheckpointError, match=rf"^{step}/\.metadata: checkpoint metadata uses pickle's BUILD on the "
                                              r"class pathlib\.PosixPath .* refusing to load it") as info:
        _resume(ck, tmp_path)
    assert "\n" not in str(info.value)
    # Nothing in the process changed: no attribute on the class, paths behave.
    assert {cls: dict(vars(cls)) for cls in _SNAPSHOT_CLASSES} == classes_restored
    assert pathlib.Path.rename is rename and str(pathlib.Path("/a/b")) == "/a/b"
    (tmp_path / "f").write_text("x")
    (tmp_path / "f").rename(tmp_path / "g")
    assert (tmp_path / "g").read_text() == "x" and not (tmp_path / "f").exists()


def test_metadata_may_not_fill_a_shared_enum_member(tmp_path, classes_restored):
    """BUILD on ``_MEM_FORMAT_ENCODING(0)``, a process-wide singleton DCP itself uses."""
    module, name = dcp_md.__name__, "_MEM_FORMAT_ENCODING"
    member = _short(module) + _short(name) + b"\x93" + b"K\x00\x85R"  # _MEM_FORMAT_ENCODING(0)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + member + b"N}" + _short("_value_") + b"K\x07s\x86b.")
    with pytest.raises(CheckpointError, match=r"BUILD on a torch\.distributed\.checkpoint\.metadata\."
                                              r"_MEM_FORMAT_ENCODING object"):
        safe_dcp.read_metadata(str(tmp_path))
    assert dcp_md._MEM_FORMAT_ENCODING(0).value == 0


def test_metadata_records_take_only_their_own_fields(saved, tmp_path):
    md = safe_dcp.read_metadata(str(saved / STEP))
    chunk = md.state_dict_metadata[EMBEDDING].chunks[0]
    chunk.__dict__["run_me"] = "x"  # pickled into the record's BUILD state
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"state sets 'run_me', which ChunkStorageMetadata has no field of"):
        safe_dcp.read_metadata(str(tmp_path))


# ---- 40.1: chunks that do not tile their tensor ----------------------------------------------


def _with_metadata(saved, tmp_path, change) -> pathlib.Path:
    """A copy of the checkpoint whose step-4 metadata is changed by ``change(md)``, rehashed."""
    ck = _copy(saved, tmp_path)
    md = safe_dcp.read_metadata(str(ck / STEP))
    change(md)
    _rewrite_manifest(ck / STEP, **{".metadata": pickle.dumps(md)})
    return ck


def test_a_tensor_half_covered_by_its_chunks_is_refused_before_loading(saved, tmp_path):
    def halve(md):
        (chunk,) = md.state_dict_metadata[EMBEDDING].chunks
        chunk.sizes = torch.Size([1, 128, 64])

    ck = _with_metadata(saved, tmp_path, halve)
    with pytest.raises(CheckpointError, match=rf"\.metadata: the chunks of tensor '{EMBEDDING}' \(size \[1, 256, "
                                              r"64\]\) do not cover it exactly: \[0:1, 128:256, 0:64\] is covered "
                                              r"by no chunk"):
        _resume(ck, tmp_path)


def test_a_tensor_without_chunks_is_refused(saved):
    md = safe_dcp.read_metadata(str(saved / STEP))
    md.state_dict_metadata[EMBEDDING].chunks = []
    with pytest.raises(CheckpointError, match=r"\[0:1, 0:256, 0:64\] is covered by no chunk"):
        safe_dcp.validate_metadata(md, "x/.metadata")


def test_a_chunk_without_storage_is_refused(saved):
    md = safe_dcp.read_metadata(str(saved / STEP))
    del md.storage_data[next(i for i in md.storage_data if i.fqn == EMBEDDING)]
    with pytest.raises(CheckpointError, match=rf"chunk \[0, 0, 0\] of tensor '{EMBEDDING}' has no storage_data entry"):
        safe_dcp.validate_metadata(md, "x/.metadata")


@pytest.mark.parametrize("chunks, problem", [
    ([((0, 0), (4, 3)), ((0, 3), (4, 3))], None),
    ([((0, 0), (2, 6)), ((2, 0), (2, 6)), ((4, 0), (0, 6))], None),  # an empty shard covers nothing
    ([((0, 0), (4, 3)), ((0, 2), (4, 4))], r"\[0:4, 2:3\] is covered by more than one chunk"),
    ([((0, 0), (4, 3)), ((0, 3), (4, 4))], r"chunk 1 \[0:4, 3:7\] reaches outside the tensor's size \[4, 6\]"),
    ([((0, 0), (4, 3)), ((1, 3), (3, 3))], r"\[0:1, 3:6\] is covered by no chunk"),
    ([((0,), (4,))], r"chunk 0 has 1 offsets and 1 sizes for a tensor of 2 dimensions"),
])
def test_chunk_tiling(chunks, problem):
    found = tiling_problem([4, 6], chunks)
    assert found is None if problem is None else re.search(problem, found), found


def test_chunk_tiling_of_scalars_and_fragmented_grids():
    assert tiling_problem([], [((), ())]) is None
    assert tiling_problem([], []) == "its only element is covered by no chunk (it would keep whatever memory it held)"
    # A diagonal of 1x1 chunks in a 4096x4096 tensor: 4096 chunks, 16M grid cells; refused
    # without counting them.
    diagonal = [((i, 4095 - i), (1, 1)) for i in range(4096)]
    assert "not a grid of shards" in tiling_problem([4096, 4096], diagonal)


# ---- 40.2: a zip bomb in a data file ---------------------------------------------------------


def _bomb(genuine_slice: bytes, inflated: int) -> bytes:
    """The slice's torch.save archive with its data record replaced by ``inflated`` zero
    bytes, deflated (torch.save never compresses; a crafted file can)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(genuine_slice)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                entry = zipfile.ZipInfo(info.filename)
                entry.compress_type = zipfile.ZIP_DEFLATED
                with dst.open(entry, "w", force_zip64=True) as w:
                    for _ in range(inflated >> 20):
                        w.write(bytes(1 << 20))
            else:
                dst.writestr(info, src.read(info))
    return out.getvalue()


def _bombed_checkpoint(saved, tmp_path, inflated: int) -> tuple[pathlib.Path, int]:
    """The embedding's slice replaced by a bomb appended to the data file; returns the
    checkpoint and the bomb's offset in that file."""
    ck = _copy(saved, tmp_path)
    step = ck / STEP
    md = safe_dcp.read_metadata(str(step))
    index = next(i for i in md.storage_data if i.fqn == EMBEDDING)
    info = md.storage_data[index]
    data = (step / info.relative_path).read_bytes()
    bomb = _bomb(data[info.offset:info.offset + info.length], inflated)
    md.storage_data[index] = dcp_fs._StorageInfo(info.relative_path, len(data), len(bomb))
    _rewrite_manifest(step, **{".metadata": pickle.dumps(md), info.relative_path: data + bomb})
    return ck, len(data)


@pytest.fixture
def loads_seen(monkeypatch):
    """Offsets (in their data file) of the slices torch.load was given."""
    seen = []
    real = torch.load

    def spy(f, *args, **kwargs):
        seen.append(getattr(f, "_start", getattr(f, "offset", None)))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return seen


def test_a_slice_longer_than_its_chunk_is_refused_from_the_metadata(saved, tmp_path, loads_seen):
    ck, offset = _bombed_checkpoint(saved, tmp_path, 256 << 20)  # ~260 kB of deflate, 256 MiB inflated
    with pytest.raises(CheckpointError, match=rf"storage of '{EMBEDDING}' at offsets \[0, 0, 0\] is \d+ bytes "
                                              r"long, more than the 131072 its chunk of \[1, 256, 64\] "
                                              r"torch\.float32 can take"):
        _resume(ck, tmp_path)
    assert loads_seen == []  # refused before any tensor was read


def test_a_slice_that_inflates_beyond_its_chunk_is_never_loaded(saved, tmp_path, loads_seen):
    ck, offset = _bombed_checkpoint(saved, tmp_path, 64 << 20)  # ~65 kB: fits the slice limit
    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp at offset {offset}: the slice of tensor '{EMBEDDING}': "
                                              r"its records declare \d+ bytes \(record 'data/0': 67108864\), more than "
                                              r"the 131072 its chunk can hold"):
        _resume(ck, tmp_path)
    assert offset not in loads_seen  # torch.load never saw the bomb (so never inflated it)


# ---- 39.7a/c: planted lock files -------------------------------------------------------------


def test_a_lock_file_planted_as_a_hard_link_never_writes_its_target(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.link(victim, ck / LOCK_FILE)
    said = []
    lock = acquire(str(ck), job="job", say=said.append)
    lock.set_run_id("a" * 32)
    assert victim.read_text() == "precious\n"
    assert os.stat(ck / LOCK_FILE).st_ino != os.stat(victim).st_ino
    assert json.loads((ck / LOCK_FILE).read_text())["run_id"] == "a" * 32
    assert said == [f"checkpoint.dir lock file {ck / LOCK_FILE} had 2 links (a hard link to another file: planted?); "
                    "replaced it with a new file, the other file is unchanged"]
    lock.release()
    assert victim.read_text() == "precious\n" and not (ck / LOCK_FILE).exists()


@pytest.mark.parametrize("field, value, why", [("since", 1e300, "not a time"), ("since", float("nan"), "not a time"),
                                               ("since", -1e18, "not a time"), ("pid", "1; rm", "not a process id"),
                                               ("host", "h\n[tp-fuse] all fine", "not one line of text")])
@pytest.mark.parametrize("held", [True, False], ids=["held", "left_behind"])
def test_a_crafted_lock_record_is_one_clear_error(tmp_path, field, value, why, held):
    ck = tmp_path / "ck"
    ck.mkdir()
    path = ck / LOCK_FILE
    record = {"run_id": "r" * 32, "job": "other", "host": "h", "pid": 1, "since": 1.7e9, field: value}
    path.write_text(json.dumps(record))
    fd = os.open(path, os.O_RDWR)
    try:
        if held:  # a live holder (flock is per open file: this descriptor conflicts with acquire's)
            fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(CheckpointError) as info:
            acquire(str(ck), job="job")
    finally:
        os.close(fd)
    msg = str(info.value)
    assert msg.startswith(f"checkpoint.dir lock file {path}: field '{field}' is ") and why in msg, msg
    assert "\n" not in msg


# ---- 39.7b: a checkpoint that trains to NaN --------------------------------------------------


def _huge_embedding_rows(saved, tmp_path) -> pathlib.Path:
    """Half of the embedding rows set to 3e38 (finite: the load's range check passes), rehashed."""
    ck = _copy(saved, tmp_path)
    step = ck / STEP
    md = safe_dcp.read_metadata(str(step))
    info = next(v for i, v in md.storage_data.items() if i.fqn == EMBEDDING)
    data = bytearray((step / info.relative_path).read_bytes())
    record = torch._C.PyTorchFileReader(io.BytesIO(bytes(data[info.offset:info.offset + info.length])))
    start = info.offset + record.get_record_offset("data/0")
    rows = torch.full((128, 64), 3e38, dtype=torch.float32)
    data[start:start + rows.numel() * 4] = rows.numpy().tobytes()
    _rewrite_manifest(step, **{info.relative_path: bytes(data)})
    return ck


@pytest.mark.parametrize("max_steps, ending", [(6, "it would be saved as the newest checkpoint"),
                                               (5, "it is the run's last step")])
def test_a_run_that_trains_to_nan_stops_and_saves_nothing(saved, tmp_path, max_steps, ending):
    ck = _huge_embedding_rows(saved, tmp_path)
    with pytest.raises(TrainingDivergedError, match=rf"step {max_steps} is not finite \(.*NaN/inf.*\) and {ending}"):
        train([*SMALL, f"trainer.max_steps={max_steps}", "checkpoint.interval=2", "checkpoint.resume=true",
               f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert _newest(ck) == STEP  # nothing newer was saved


# ---- 40.5: a live lock deleted while its job runs --------------------------------------------


def test_the_owner_of_a_deleted_lock_stops_at_its_next_checkpoint(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    real = CheckpointManager.save

    def save_then_delete_the_lock(self, state, extra=None):
        path = real(self, state, extra)
        if state.step == 1:
            os.remove(ck / LOCK_FILE)  # someone deletes the live lock
        return path

    monkeypatch.setattr(CheckpointManager, "save", save_then_delete_the_lock)
    with pytest.raises(CheckpointError, match=rf"saving checkpoint step 2 in {ck} failed: the lock file "
                                              rf"{ck / LOCK_FILE} of this job's checkpoint.dir is gone: it was "
                                              r"deleted or replaced while the job ran.*step_00000001 is intact"):
        train([*SMALL, "trainer.max_steps=3", "checkpoint.interval=1", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert _newest(ck) == "step_00000001"


def _running_job(ck) -> tuple[object, str]:
    """Job A as it looks while it runs: it holds the lock and has claimed the run."""
    lock = acquire(str(ck), job="job-A")
    decision = decide_start(str(ck), "auto", restarted=False, job="job-A", overwrite=False)
    lock.set_run_id(decision.run_id)
    return lock, decision.run_id


def test_a_second_job_does_not_adopt_a_running_jobs_run(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    lock, run_id = _running_job(ck)
    try:
        os.remove(ck / LOCK_FILE)  # deleted while job A runs
        before = sorted(os.listdir(ck))
        with pytest.raises(CheckpointError, match=rf"run\.json says run {run_id} of job job-A \(host \S+, pid "
                                                  rf"{os.getpid()}\) is still running, but the directory's lock file "
                                                  r"is gone .*Not adopting"):
            _resume(ck, tmp_path, "checkpoint.resume=auto")
        assert sorted(os.listdir(ck)) == before
        assert json.loads((ck / IDENTITY_FILE).read_text())["job"] == "job-A"
        assert "is gone" in lock.lost()
    finally:
        lock.release()


def test_a_run_whose_job_is_gone_is_resumed(saved, tmp_path):
    """No false refusals: run.json still says "active" (its job was killed, and its lock file
    then removed by hand), but that process no longer exists on this host."""
    ck = _copy(saved, tmp_path)
    lock, run_id = _running_job(ck)
    lock.release()  # the lock file goes, run.json stays active (release does not end the run)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    identity = json.loads((ck / IDENTITY_FILE).read_text())
    assert identity["active"] is True
    (ck / IDENTITY_FILE).write_text(json.dumps({**identity, "pid": int(gone.stdout)}))
    result = _resume(ck, tmp_path, "checkpoint.resume=auto")
    assert result.start_step == 4 and sorted(result.losses) == [5]
    assert json.loads((ck / IDENTITY_FILE).read_text())["active"] is False  # ended cleanly
