"""data.tokenizer: byte, a byte-level BPE of model.vocab_size trained on the corpus (cached beside
the data, deterministic), or a tokenizer.json; presets get a tokenizer of their vocabulary size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tp_fuse.launch.api import compose
from tp_fuse.launch.config import DataConfig
from tp_fuse.launch.config_validate import validate
from tp_fuse.launch.data import TokenData, load_tokens, make_tokenizer
from tp_fuse.launch.tokenizer import ByteTokenizer, FileTokenizer, check_tokenizer_choice, resolve_kind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "\n\n".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog; tensor parallel FP8 training, step {i * 7}. "
    "Überall Grüße — 数据 ✓" for i in range(400)
)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "data" / "book.txt"
    path.parent.mkdir()
    path.write_text(TEXT, encoding="utf-8")
    return path


def _cfg(path, tokenizer="bpe") -> DataConfig:
    return DataConfig(source="text", paths=[str(path)], tokenizer=tokenizer)


def test_bpe_trained_on_the_corpus_cached_beside_it(corpus, monkeypatch):
    tok = make_tokenizer(_cfg(corpus), vocab_size=384)
    assert tok.vocab_size == 384
    (cached,) = os.listdir(corpus.parent / "tp_fuse_tokenizers")
    assert cached.startswith("bpe-384-") and cached.endswith(".json")
    tokens = tok.encode(TEXT)
    assert tok.decode(tokens) == TEXT  # byte-level: lossless, also for non-ASCII text
    assert tokens.numel() < len(TEXT.encode()) / 2  # it merges
    # The second build loads the cache (no training).
    monkeypatch.setattr("tp_fuse.launch.tokenizer.train_bpe", lambda *a: pytest.fail("trained again"))
    again = make_tokenizer(_cfg(corpus), vocab_size=384)
    assert torch.equal(again.encode(TEXT), tokens)
    stream = load_tokens(_cfg(corpus), 384, again)
    assert int(stream.max()) < 384 and stream.numel() == tokens.numel()


def test_bpe_is_deterministic_across_processes_and_threads(corpus, tmp_path):
    path = make_tokenizer(_cfg(corpus), vocab_size=320).path
    reference = open(path, "rb").read()
    os.remove(path)
    code = ("import sys; from tp_fuse.launch.config import DataConfig; from tp_fuse.launch.data import make_tokenizer; "
            f"print(make_tokenizer(DataConfig(source='text', paths=[{str(corpus)!r}], tokenizer='bpe'), 320).path)")
    env = {**os.environ, "PYTHONPATH": ROOT, "RAYON_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == path
    assert open(path, "rb").read() == reference


def test_tokenizer_json_path_and_vocabulary_checks(corpus, tmp_path):
    trained = make_tokenizer(_cfg(corpus), vocab_size=384)
    own = tmp_path / "tokenizer.json"
    trained.tokenizer.save(str(own))
    tok = make_tokenizer(_cfg(corpus, str(own)), vocab_size=384)
    assert isinstance(tok, FileTokenizer) and tok.vocab_size == 384
    check_tokenizer_choice(str(own), "text", 384)
    check_tokenizer_choice(str(own), "text", 512 - 1)  # padding rows up to 127 are fine
    with pytest.raises(ValueError, match=r"has 384 tokens but model.vocab_size is 256: set model.vocab_size >= 384"):
        check_tokenizer_choice(str(own), "text", 256)
    with pytest.raises(ValueError, match=r"data.tokenizer=byte has 256 tokens but model.vocab_size is 50304: "
                                         r"50048 embedding rows would never be used"):
        check_tokenizer_choice("byte", "text", 50304)
    with pytest.raises(ValueError, match=r"data.tokenizer=bpe needs model.vocab_size > 256"):
        check_tokenizer_choice("bpe", "text", 128)
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"bad.json: not a valid tokenizer.json"):
        check_tokenizer_choice(str(bad), "text", 384)
    with pytest.raises(ValueError, match=r"no such file"):
        check_tokenizer_choice(str(tmp_path / "missing.json"), "text", 384)
    with pytest.raises(ValueError, match=r"expected auto, byte, bpe or a path to a tokenizer.json"):
        check_tokenizer_choice("sentencepiece", "text", 384)
    check_tokenizer_choice("byte", "bin", 50304)  # pre-tokenized data: no tokenizer


def test_presets_use_a_tokenizer_of_their_vocabulary(tmp_path):
    for preset, kind in (("gpt", "byte"), ("llama", "byte"), ("gpt-125m", "bpe"), ("gpt-350m", "bpe"),
                         ("llama-1b", "bpe")):
        cfg = compose([f"+model={preset}"])
        assert resolve_kind(cfg.data.tokenizer, cfg.model.gpt.vocab_size) == kind, preset
    # The config check runs at validation, before anything starts.
    cfg = compose(["+model=gpt-125m", "data.tokenizer=byte"])
    with pytest.raises(ValueError, match=r"embedding rows would never be used"):
        validate(cfg, 4)


def test_byte_tokenizer_default_for_byte_models(corpus):
    tok = make_tokenizer(_cfg(corpus, "auto"), vocab_size=256)
    assert isinstance(tok, ByteTokenizer)
    data = TokenData.build(_cfg(corpus, "auto"), seq_len=32, vocab_size=256)
    assert data.train.numel() + data.val.numel() == len(TEXT.encode())


def test_tokenizer_json_is_read_bounded_and_special_files_are_named(tmp_path):
    """Issue 40 points 6 and 8: a 20 GiB sparse tokenizer.json was read whole (as
    data.tokenizer, prepare_data --tokenizer, and a +model=hf directory's tokenizer.json);
    a link to /dev/zero or a FIFO was "no such file"."""
    from tp_fuse.launch.models.hf import load_tokenizer
    from tp_fuse.launch.prepare_data import PrepareJob
    from tp_fuse.launch.tokenizer import MAX_TOKENIZER_BYTES

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    sparse = model_dir / "tokenizer.json"
    with open(sparse, "wb") as f:
        f.truncate(20 << 30)  # sparse: no disk space used
    too_large = rf"{sparse} is larger than {MAX_TOKENIZER_BYTES} bytes"
    with pytest.raises(ValueError, match=too_large):
        check_tokenizer_choice(str(sparse), "text", 384)
    with pytest.raises(ValueError, match=too_large):
        load_tokenizer(str(model_dir))
    with pytest.raises(ValueError, match=too_large):
        PrepareJob([str(sparse)], str(tmp_path / "out"), tokenizer=str(model_dir)).load_tokenizer()
    zero = tmp_path / "zero.json"
    os.symlink("/dev/zero", zero)
    with pytest.raises(ValueError, match=rf"{zero} is a character device, not a regular file"):
        FileTokenizer(str(zero))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=rf"{fifo} is a FIFO, not a regular file"):
        FileTokenizer(str(fifo))
    sparse.unlink()
    os.mkfifo(sparse)
    with pytest.raises(ValueError, match=rf"{sparse} is a FIFO, not a regular file"):
        load_tokenizer(str(model_dir))
    dangling = tmp_path / "dangling.json"
    os.symlink(tmp_path / "gone.json", dangling)
    with pytest.raises(ValueError, match=rf"{dangling}: cannot read it: No such file or directory"):
        FileTokenizer(str(dangling))
