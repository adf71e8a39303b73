"""python -m tp_fuse.launch.prepare_data: text/JSONL/Parquet -> data=bin files the launcher reads
back as the same tokens (byte tokenizer and a tokenizer.json), resume after an interruption,
determinism, bad inputs and planted links."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tp_fuse.launch import prepare_data as pd
from tp_fuse.launch import prepare_inputs, prepare_tokens
from tp_fuse.launch.config import DataConfig
from tp_fuse.launch.data import TokenData, load_tokens
from tp_fuse.launch.tokenizer import FileTokenizer, train_bpe

TEXTS = {  # trailing newlines, runs of blank lines, an empty file, non-ASCII and invalid UTF-8
    "a.txt": "First paragraph.\nStill first.\n\nSecond paragraph.\n",
    "b.txt": "\n\n\nAfter three newlines. Ünïcödé ✓\n\n\n\nEnd\n\n",
    "c.txt": "",
    "d.txt": "last one, no newline",
}


def _files(tmp_path, texts=TEXTS, extra: bytes = b"\xff\xfe broken \xe2\x82") -> list[str]:
    paths = []
    for name, text in texts.items():
        p = tmp_path / name
        p.write_bytes(text.encode("utf-8") + (extra if name == "a.txt" else b""))
        paths.append(str(p))
    return paths


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_bpe(("The quick brown fox jumps over the lazy dog.\n\nParagraphs and more text. " * 40), 300, path)
    return path


def _run(inputs, out, **kw) -> dict:
    restart = kw.pop("restart", False)
    return pd.prepare(pd.PrepareJob(inputs, str(out), **kw), restart=restart, progress=False, log=lambda s: None)


def _bin_tokens(out, meta) -> TokenData:
    """What the launcher's data=bin reader makes of the output (its split included)."""
    cfg = DataConfig(source="bin", paths=[str(out / "train.bin"), str(out / "val.bin")], bin_dtype=meta["dtype"],
                     val_fraction=meta["val_fraction"])
    return TokenData.build(cfg, seq_len=4, vocab_size=meta["tokenizer"]["vocab_size"])


@pytest.mark.parametrize("tokenizer", ["byte", "json"])
def test_text_round_trip_is_the_launchers_data_text_stream(tmp_path, monkeypatch, bpe_json, tokenizer):
    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 7)  # paragraphs and separators straddle reads
    paths = _files(tmp_path)
    choice = "byte" if tokenizer == "byte" else bpe_json
    meta = _run(paths, tmp_path / "out", tokenizer=choice, val_fraction=0.1)
    vocab = 256 if tokenizer == "byte" else FileTokenizer(bpe_json).vocab_size
    text_cfg = DataConfig(source="text", paths=paths, tokenizer=choice, val_fraction=0.1)
    want = TokenData.build(text_cfg, seq_len=4, vocab_size=vocab)
    got = _bin_tokens(tmp_path / "out", meta)
    assert torch.equal(got.train, want.train) and torch.equal(got.val, want.val)
    assert meta["tokens"] == want.train.numel() + want.val.numel() and meta["dtype"] == "uint16"
    assert meta["train_args"][:3] == ["data=bin", f"data.paths=[{tmp_path}/out/train.bin,{tmp_path}/out/val.bin]",
                                      "data.bin_dtype=uint16"]
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]  # progress removed


def test_jsonl_documents_are_joined_by_a_blank_line(tmp_path, bpe_json):
    docs = ["one\n", "two\n\nparagraphs", "", "trailing\n\n\n", "ëñd"]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" + ("\n" if i == 1 else "") for i, d in enumerate(docs)))
    joined = "\n\n".join(docs)
    meta = _run([str(src)], tmp_path / "byte", field="body")
    got = _bin_tokens(tmp_path / "byte", meta)
    assert bytes(torch.cat([got.train, got.val]).tolist()) == joined.encode("utf-8")
    meta = _run([str(src)], tmp_path / "bpe", field="body", tokenizer=bpe_json)
    got = _bin_tokens(tmp_path / "bpe", meta)
    assert torch.equal(torch.cat([got.train, got.val]), FileTokenizer(bpe_json).encode(joined))


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"row {i}\n\nsecond paragraph {i}" for i in range(50)]
    pq.write_table(pa.table({"content": docs, "n": list(range(50))}), tmp_path / "d.parquet", row_group_size=16)
    meta = _run([str(tmp_path / "d.parquet")], tmp_path / "out", field="content")
    got = _bin_tokens(tmp_path / "out", meta)
    assert bytes(torch.cat([got.train, got.val]).tolist()) == "\n\n".join(docs).encode()
    with pytest.raises(ValueError, match=r"no column 'text' \(--field\); it has: content, n"):
        _run([str(tmp_path / "d.parquet")], tmp_path / "o2")


class _Interrupt(KeyboardInterrupt):
    pass


def _interrupt_after(monkeypatch, n: int) -> None:
    real = prepare_tokens._Writer.checkpoint
    calls = {"n": 0}

    def checkpoint(self, *a):
        real(self, *a)
        calls["n"] += 1
        if calls["n"] == n:
            self.tokens_file.write(b"\x01\x00" * 5)  # tokens written after the last recorded state
            raise _Interrupt

    monkeypatch.setattr(prepare_tokens._Writer, "checkpoint", checkpoint)


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_resume_after_an_interruption_gives_the_same_bytes(tmp_path, monkeypatch, bpe_json, kind):
    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 5)
    monkeypatch.setattr(prepare_tokens, "MAX_PARAGRAPH_BYTES", 12)  # long paragraphs are cut the same way on resume
    if kind == "text":
        paths = _files(tmp_path, extra=b"")
    else:
        (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS.values()))
        paths = [str(tmp_path / "d.jsonl")]
    clean = _run(paths, tmp_path / "clean", tokenizer=bpe_json)
    for n in (1, 2, 3):
        out = tmp_path / f"cut{n}"
        _interrupt_after(monkeypatch, n)
        with pytest.raises(_Interrupt):
            _run(paths, out, tokenizer=bpe_json)
        assert os.path.isdir(out / "prepare.partial") and not os.path.exists(out / "meta.json")
        monkeypatch.undo()
        monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 11)  # other read sizes: still the same output
        monkeypatch.setattr(prepare_tokens, "MAX_PARAGRAPH_BYTES", 12)
        meta = _run(paths, out, tokenizer=bpe_json)
        assert {**meta, "train_args": None} == {**clean, "train_args": None}  # the paths in train_args differ
        for name in ("train.bin", "val.bin"):
            assert (out / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()
        monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 5)


def test_resume_refuses_changed_inputs_and_restart_starts_over(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 5)
    paths = _files(tmp_path)
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Interrupt):
        _run(paths, tmp_path / "out")
    monkeypatch.undo()
    with open(paths[1], "a") as f:
        f.write("more")
    with pytest.raises(ValueError, match=r"a partial run with other settings \(inputs differ: inputs changed "
                                         r"since\?\); rerun it as it was, or pass --restart"):
        _run(paths, tmp_path / "out")
    meta = _run(paths, tmp_path / "out", restart=True)
    assert meta["tokens"] == sum(os.path.getsize(p) for p in paths) + 2 * (len(paths) - 1)
    # A finished output: the same job is a no-op, another one is refused.
    assert _run(paths, tmp_path / "out") == meta
    with pytest.raises(ValueError, match=r"holds data prepared with other settings \(val_fraction differ\)"):
        _run(paths, tmp_path / "out", val_fraction=0.2)


def test_bad_inputs_are_clear_errors(tmp_path, monkeypatch):
    good = _files(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "cut\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object .* expected one JSON object per line"):
        _run([str(bad)], tmp_path / "o1")
    bad.write_text('{"text": "ok"}\n\n{"body": "x", "id": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: expected a JSON object with a string field 'text' "
                                         r"\(--field\), got keys \['body', 'id'\]"):
        _run([str(bad)], tmp_path / "o2")
    bad.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .* got 'text': int"):
        _run([str(bad)], tmp_path / "o3")
    with pytest.raises(ValueError, match=r"input '.*nope.txt': no such file"):
        pd.PrepareJob([str(tmp_path / "nope.txt")], str(tmp_path / "o"))
    os.mkfifo(tmp_path / "fifo.txt")
    with pytest.raises(ValueError, match=r"fifo.txt' is a FIFO, not a regular file"):
        pd.PrepareJob([str(tmp_path / "fifo.txt")], str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"--val-fraction 0.0: expected a fraction in \(0, 1\)"):
        pd.PrepareJob(good, str(tmp_path / "o"), val_fraction=0.0)
    with pytest.raises(ValueError, match=r"--tokenizer bpe needs --vocab-size"):
        _run(good, tmp_path / "o4", tokenizer="bpe")
    with pytest.raises(ValueError, match=r"too few to split"):
        _run([good[2]], tmp_path / "o5")  # the empty file
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"reading Parquet files needs pyarrow .*: pip install pyarrow"):
        pd.PrepareJob([str(tmp_path / "x.parquet")], str(tmp_path / "o"))
    # The command line: one line, exit status 1.
    assert pd.main([str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o6")]) == 1


def test_planted_links_are_never_followed(tmp_path, monkeypatch):
    paths = _files(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / "prepare.partial")
    with pytest.raises(ValueError, match=r"prepare.partial is a symbolic link, not the directory"):
        _run(paths, out)
    os.unlink(out / "prepare.partial")
    _interrupt_after(monkeypatch, 1)
    with pytest.raises(_Interrupt):
        _run(paths, out)
    monkeypatch.undo()
    os.unlink(out / "prepare.partial" / "tokens.bin")
    os.symlink(victim, out / "prepare.partial" / "tokens.bin")
    with pytest.raises(ValueError, match=r"tokens.bin is a symbolic link; refusing to follow it"):
        _run(paths, out)
    _run(paths, out, restart=True)  # a fresh start removes the link itself
    assert victim.read_text() == "keep me"
    (out / "train.bin").unlink()
    (out / "meta.json").unlink()
    os.symlink(victim, out / "train.bin")  # replaced by the rename, not written through
    _run(paths, out, restart=True)
    assert victim.read_text() == "keep me" and not os.path.islink(out / "train.bin")


# ---- issue 40 points 5 and 8: the lock comes first; every failure is one line naming the file


def test_restart_takes_the_lock_before_touching_any_output(tmp_path, monkeypatch):
    """A --restart of the same --out while a run sits between writing train.bin and
    meta.json deleted that run's train.bin (then 'nothing to do' with the data lost)."""
    paths = _files(tmp_path)
    out = tmp_path / "out"
    real = pd.write_atomic  # _split writes meta.json with it, after train.bin and val.bin
    refused = []

    def meta_write(path, data, **kw):
        with pytest.raises(ValueError, match=rf"{out}: another prepare_data is writing there") as e:
            _run(paths, out, restart=True)
        refused.append(str(e.value))
        assert (out / "train.bin").exists() and (out / "val.bin").exists()
        real(path, data, **kw)

    monkeypatch.setattr(pd, "write_atomic", meta_write)
    meta = _run(paths, out)
    monkeypatch.undo()
    assert refused and _run(paths, out) == meta  # the finished output is whole: nothing to do
    (out / "train.bin").unlink()  # lost anyway: not "already prepared"
    with pytest.raises(ValueError, match=rf"{out / 'train.bin'} is missing although .*meta.json records"):
        _run(paths, out)


_STATE_SHAPES = {
    "non-dict": lambda s: [1, 2],
    "wrong type": lambda s: {**s, "input": "0"},
    "missing field": lambda s: {k: v for k, v in s.items() if k != "tokens"},
    "negative": lambda s: {**s, "pos": [-5, 0]},
    "huge": lambda s: {**s, "tokens": 10 ** 30},
}


@pytest.mark.parametrize("shape", sorted(_STATE_SHAPES))
def test_crafted_state_json_is_one_error_naming_it(tmp_path, monkeypatch, shape):
    monkeypatch.setattr(prepare_inputs, "CHUNK_BYTES", 5)
    paths = _files(tmp_path)
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(_Interrupt):
        _run(paths, tmp_path / "out")
    monkeypatch.undo()
    state_path = tmp_path / "out" / "prepare.partial" / "state.json"
    state_path.write_text(json.dumps(_STATE_SHAPES[shape](json.loads(state_path.read_text()))))
    with pytest.raises(ValueError, match=rf"{state_path}: .*rerun with --restart"):
        _run(paths, tmp_path / "out")
    _run(paths, tmp_path / "out", restart=True)


_META_SHAPES = {
    "non-dict": lambda m: [m],
    "wrong type": lambda m: {**m, "tokens": str(m["tokens"])},
    "missing field": lambda m: {k: v for k, v in m.items() if k != "val_tokens"},
    "negative": lambda m: {**m, "train_tokens": -1},
    "huge": lambda m: {**m, "tokens": 10 ** 30},
}


@pytest.mark.parametrize("shape", sorted(_META_SHAPES))
def test_crafted_meta_json_is_one_error_naming_it(tmp_path, shape):
    paths = _files(tmp_path)
    meta = _run(paths, tmp_path / "out")
    meta_path = tmp_path / "out" / "meta.json"
    meta_path.write_text(json.dumps(_META_SHAPES[shape](meta)))
    with pytest.raises(ValueError, match=rf"{meta_path}: .*rerun with --restart"):
        _run(paths, tmp_path / "out")
    assert _run(paths, tmp_path / "out", restart=True) == meta


def test_unreadable_input_and_a_file_as_out_are_one_line(tmp_path, capsys):
    good = _files(tmp_path)
    assert pd.main(["/proc/self/mem", "--out", str(tmp_path / "o1"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == "prepare_data: error: input /proc/self/mem: cannot read it: Input/output error\n", err
    (tmp_path / "afile").write_text("x")
    assert pd.main([*good, "--out", str(tmp_path / "afile"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == f"prepare_data: error: --out {tmp_path / 'afile'} is a file, not a directory; give a directory " \
                  "(it is created if missing)\n", err


def test_a_full_disk_is_one_line_and_the_same_command_continues(tmp_path):
    """A file-size limit (as a full disk) while tokens are written: one line naming the file,
    exit status 1; the same command without the limit finishes with the same bytes."""
    import resource
    import subprocess
    import sys

    src = tmp_path / "big.txt"
    src.write_bytes(b"".join(b"paragraph %d of a corpus\n\n" % i for i in range(40_000)))  # ~1 MB
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tp_fuse.launch.prepare_data", str(src), "--out", str(out), "--no-progress"]
    limit = 600_000  # bytes: tokens.bin (2 bytes per byte) passes it part of the way through

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (f"prepare_data: error: cannot write {out / 'prepare.partial' / 'tokens.bin'}: the "
                           "file-size limit (ulimit -f) was reached; free space (or raise the limit) and rerun the "
                           "same command to continue\n"), proc.stderr
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "resuming at input 1/1" in proc.stderr, proc.stderr
    tokens = (out / "train.bin").read_bytes() + (out / "val.bin").read_bytes()
    assert tokens == b"".join(bytes([b, 0]) for b in src.read_bytes())


def test_bpe_corpus_cap_counts_what_is_read_not_the_listed_size(tmp_path, monkeypatch):
    """A procfs file lists as 0 bytes: the in-memory BPE corpus cap must count the bytes read."""
    monkeypatch.setattr(pd, "MAX_BPE_CORPUS_BYTES", 200)
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(ValueError, match=r"--tokenizer bpe: the inputs up to /proc/self/status are over 200 bytes, "
                                         r"too large to train a BPE on in memory"):
        _run(["/proc/self/status"], tmp_path / "out", tokenizer="bpe", vocab_size=300)
