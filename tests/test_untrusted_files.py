"""Files in checkpoint and run directories as an attacker (or a confused operator) leaves them.

Every file the launcher reads from a checkpoint or run directory, planted as a FIFO (used
to hang start-up: opening one for reading waits for a writer) or as a symbolic link to
``/dev/zero`` (used to exhaust memory: its size reads as 0, so size checks passed), gets a
clear error naming the file, at once. Temporary files are created exclusively, so symbolic
links planted at the old fixed temporary names (``run.json.tmp``, ``latest.tmp``,
``metrics.jsonl.tmp``) never redirect a write outside the directory.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tp_fuse.launch.logging import metrics as metrics_mod
from tp_fuse.launch.checkpoint import safe_dcp
from tp_fuse.launch.api import train
from tp_fuse.launch.checkpoint.manager import MANIFEST, CheckpointError
from tp_fuse.launch.checkpoint.files import read_manifest, verify_files
from tp_fuse.launch.checkpoint.dir_lock import LOCK_FILE
from tp_fuse.launch.checkpoint.dir_lock import acquire as acquire_lock
from tp_fuse.launch.logging.metrics import MetricsSink, read_jsonl
from tp_fuse.launch.checkpoint.run_identity import IDENTITY_FILE, decide_start, read_manifest_run_id
from tp_fuse.launch.logging.runlog import tee_output
from tp_fuse.launch.logging.wandb_safe import run_id_for
from test_checkpoint_resume import COMMON
from tp_fuse.overlap.auto import load_choice_file, save_choice_file

SMALL = [*COMMON, "trainer.max_steps=4"]
STEP = "step_00000004"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory and its checkpoint directory (steps 2 and 4)."""
    run = tmp_path_factory.mktemp("files_run")
    ck = run / "ck"
    train([*SMALL, "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(run))
    save_choice_file(str(run / "overlap_choices.json"), [])
    run_id_for(str(run))  # wandb/run_id
    return run


def _plant(path, kind: str) -> None:
    """Replace ``path`` with a FIFO or a symbolic link to /dev/zero."""
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


def _expect(kind: str) -> str:
    return "is a FIFO, not a regular file" if kind == "fifo" else "is a symbolic link; refusing to follow it"


# file (relative to the run dir) -> the launcher code that reads it; must raise, naming the file.
READERS = {
    f"ck/{IDENTITY_FILE}": lambda run: decide_start(str(run / "ck"), "auto", restarted=False, job="j",
                                                    overwrite=False),
    "ck/latest": lambda run: decide_start(str(run / "ck"), True, restarted=False, job="j", overwrite=False),
    f"ck/{STEP}/{MANIFEST}": lambda run: decide_start(str(run / "ck"), True, restarted=False, job="j",
                                                      overwrite=False),
    f"ck/{STEP}/.metadata": lambda run: safe_dcp.read_metadata(str(run / "ck" / STEP)),
    f"ck/{LOCK_FILE}": lambda run: acquire_lock(str(run / "ck"), job="j"),
    "overlap_choices.json": lambda run: load_choice_file(str(run / "overlap_choices.json")),
    "metrics.jsonl": lambda run: MetricsSink(str(run), True, None, resume_step=2),
    "fp8_stats.jsonl": lambda run: MetricsSink(str(run), True, None, resume_step=2),
    "wandb/run_id": lambda run: run_id_for(str(run)),
}


@pytest.mark.timeout(60)  # the old code waited on a FIFO forever
@pytest.mark.parametrize("kind", ["fifo", "devzero"])
@pytest.mark.parametrize("name", sorted(READERS))
def test_special_file_is_refused_naming_it(saved, tmp_path, name, kind):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    _plant(run / name, kind)
    with pytest.raises(ValueError, match=rf"{os.path.basename(name)} {_expect(kind)}"):
        READERS[name](run)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_checkpoint_data_file_and_manifest_are_checked_before_reading(saved, tmp_path, kind):
    ck = tmp_path / "ck"
    shutil.copytree(saved / "ck", ck)
    manifest = read_manifest(str(ck / STEP))
    data = next(n for n in manifest["files"] if n.endswith(".distcp"))
    _plant(ck / STEP / data, kind)
    what = "a FIFO" if kind == "fifo" else "a symbolic link"
    assert verify_files(str(ck / STEP), manifest, verify_hashes=True) == (
        f"file {data} is {what}, not a regular file (tp-fuse writes none)")
    _plant(ck / STEP / MANIFEST, kind)
    with pytest.raises(CheckpointError, match=rf"checkpoint manifest .*{MANIFEST} {_expect(kind)}"):
        read_manifest(str(ck / STEP))


@pytest.mark.timeout(120)
def test_a_fifo_run_json_stops_a_resume_with_one_error(saved, tmp_path):
    """End to end: the launcher names the file instead of hanging (the other ranks used to
    wait parallel.timeout_s for rank 0, which waited on the FIFO forever)."""
    ck = tmp_path / "ck"
    shutil.copytree(saved / "ck", ck)
    _plant(ck / IDENTITY_FILE, "fifo")
    with pytest.raises(CheckpointError, match=rf"run identity file .*{IDENTITY_FILE} is a FIFO"):
        train([*SMALL, "checkpoint.resume=auto", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert not (ck / LOCK_FILE).exists()  # the lock was given back


def test_oversized_files_are_refused(saved, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    (run / "ck" / "latest").write_bytes(b"step_00000004" + b" " * (8 << 10))
    with pytest.raises(CheckpointError, match=r"checkpoint pointer .*latest is larger than 4096 bytes"):
        decide_start(str(run / "ck"), True, restarted=False, job="j", overwrite=False)
    monkeypatch.setattr(metrics_mod, "MAX_LINE_BYTES", 1000)
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "x": "' + b"a" * 2000 + b'"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: a line longer than 1000 bytes"):
        read_jsonl(str(run / "metrics.jsonl"))


@pytest.mark.timeout(60)
def test_a_planted_train_log_is_not_written_through(tmp_path, capfd):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    log = tmp_path / "train.log"
    os.symlink(outside, log)
    with tee_output(str(log), True):
        print("a line of the run")
    assert outside.read_text() == "precious\n"
    assert "run log" in capfd.readouterr().err


# ---- temporary files ------------------------------------------------------------------


def test_planted_temp_file_links_write_nothing_outside(tmp_path):
    """A restart into the same run dir rewrites run.json, latest and metrics.jsonl; the old
    code wrote each through ``<name>.tmp``, which a planted link redirected."""
    run, ck, outside = tmp_path / "run", tmp_path / "run" / "ck", tmp_path / "outside"
    outside.mkdir()
    first = train([*SMALL, "trainer.max_steps=2", "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(run))
    planted = {ck / "run.json.tmp": outside / "a", ck / "latest.tmp": outside / "b",
               run / "metrics.jsonl.tmp": outside / "c", run / "wandb" / "run_id.tmp": outside / "d"}
    (run / "wandb").mkdir(exist_ok=True)
    for link, target in planted.items():
        target.write_text("precious\n")
        os.symlink(target, link)
    second = train([*SMALL, "checkpoint.resume=true", "checkpoint.interval=2", f"checkpoint.dir={ck}"], str(run))
    run_id_for(str(run))
    assert second.start_step == 2 and first.checkpoint
    for link, target in planted.items():
        assert target.read_text() == "precious\n", link
        assert os.path.islink(link), link  # untouched: neither followed nor replaced
    assert [r["step"] for r in read_jsonl(str(run / "metrics.jsonl"))] == [1, 2, 3, 4]
    assert (ck / "latest").read_text() == "step_00000004\n"
    leftovers = [n for d in (run, ck) for n in os.listdir(d) if n.endswith(".tmp") and not os.path.islink(d / n)]
    assert leftovers == []


#: 20 000 levels: far past the JSON parser's recursion limit, 40 kB (under run.json's 64 KiB cap).
_DEEP_JSON = b"[" * 20_000 + b"]" * 20_000


def test_deeply_nested_json_is_malformed_not_recursion_error(tmp_path):
    """Issue 24 item 8: run.json (read on every start) and a manifest's run id raised
    RecursionError out of the launcher; nested too deep they are malformed like bad JSON."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / IDENTITY_FILE).write_bytes(_DEEP_JSON)
    decision = decide_start(str(ck), "auto", restarted=False, job="j", overwrite=False)
    assert decision is not None
    step = ck / STEP
    step.mkdir()
    (step / MANIFEST).write_bytes(_DEEP_JSON)
    assert read_manifest_run_id(str(step)) is None
