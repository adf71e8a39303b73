"""A torn last line in metrics.jsonl (a crash or a full disk mid-write) on restart.

The restart into the same run directory used to die with ``JSONDecodeError``; now the cut
line is reported (file, line, bytes) and dropped, and the files hold one trajectory. A
damaged line that is *not* the last is an error naming the file and line: a crash cannot
produce it, and rewriting the file would destroy what is not ours to drop.
"""

from __future__ import annotations

import json

import pytest

from tp_fuse.launch.api import train
from tp_fuse.launch.logging.metrics import MetricsSink, read_jsonl
from test_checkpoint_resume import COMMON


def _write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


def test_torn_last_line_is_reported_and_dropped(tmp_path, capfd):
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}], b'{"step": 3, "lo')
    _write(tmp_path / "fp8_stats.jsonl", [{"step": 1}, {"step": 2}], b'{"step": 3, "fp8/a": 1.')
    sink = MetricsSink(str(tmp_path), True, None, resume_step=2)
    sink.log(3, {"loss": 3.0})
    sink.close()
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [
        {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 3.0}]
    assert [r["step"] for r in read_jsonl(str(tmp_path / "fp8_stats.jsonl"))] == [1, 2]
    err = capfd.readouterr().err
    assert "metrics.jsonl: line 3 (15 bytes) was cut short (a crash or a full disk while it was written); " \
           "dropped it" in err
    assert "fp8_stats.jsonl: line 3" in err


def test_a_complete_last_record_without_newline_is_kept(tmp_path, capfd):
    _write(tmp_path / "metrics.jsonl", [{"step": 1}], b'{"step": 2}')
    MetricsSink(str(tmp_path), True, None, resume_step=5).close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    assert "cut short" not in capfd.readouterr().err


def test_a_damaged_line_before_the_end_is_an_error_and_changes_nothing(tmp_path):
    raw = b'{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n'
    (tmp_path / "metrics.jsonl").write_bytes(raw)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record .*move the file away"):
        MetricsSink(str(tmp_path), True, None, resume_step=3)
    assert (tmp_path / "metrics.jsonl").read_bytes() == raw
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left behind


def test_restart_into_the_same_run_dir_after_a_torn_write(tmp_path, capfd):
    run, ck = tmp_path / "run", tmp_path / "ck"
    small = [*COMMON, "trainer.max_steps=4", "checkpoint.interval=2", f"checkpoint.dir={ck}"]
    train([*small, "trainer.exit_at_step=2"], str(run))
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "loss": 4.9')  # the crash: step 3's record half written
    result = train([*small, "checkpoint.resume=true"], str(run))
    assert result.start_step == 2
    assert [r["step"] for r in read_jsonl(str(run / "metrics.jsonl"))] == [1, 2, 3, 4]
    assert "metrics.jsonl: line 3 (23 bytes) was cut short" in capfd.readouterr().err
