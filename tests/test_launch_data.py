"""Launcher data: corpora, tokenization, deterministic DP-independent batches."""

from __future__ import annotations

import pytest
import torch

from tp_fuse.launch.config import DataConfig
from tp_fuse.launch.data import BatchLoader, ByteTokenizer, TokenData, load_tokens, stdlib_corpus


def _loader(data: TokenData, dp_rank: int, dp_size: int, global_batch: int = 8, micro: int = 2) -> BatchLoader:
    return BatchLoader(data, global_batch_size=global_batch, micro_batch_size=micro, dp_rank=dp_rank,
                       dp_size=dp_size, seed=3, device=torch.device("cpu"))


def test_stdlib_corpus_is_english_text_and_byte_tokenized():
    text = stdlib_corpus()
    assert len(text) > 100_000 and "statement" in text
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    data = TokenData.build(DataConfig(), seq_len=64, vocab_size=256)
    assert data.train.dtype == torch.int64 and int(data.train.max()) < 256
    assert data.val.numel() == pytest.approx(0.05 * (data.train.numel() + data.val.numel()), rel=0.01)


def test_batches_do_not_depend_on_dp_size():
    data = TokenData.build(DataConfig(), seq_len=32, vocab_size=256)
    one = _loader(data, 0, 1)
    two = [_loader(data, r, 2) for r in range(2)]
    for _ in range(3):  # three steps
        ref = torch.cat([one.micro_batch(m)[0] for m in range(one.grad_accum_steps)])
        got = torch.cat([two[r].micro_batch(m)[0] for m in range(two[0].grad_accum_steps) for r in range(2)])
        # Same global batch, in the order (micro, dp_rank).
        assert torch.equal(ref, got)
        tokens, labels = one.micro_batch(0)
        assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next tokens
        for ld in (one, *two):
            ld.advance()
    assert one.state_dict() == {"consumed_samples": 24}
    # Resuming from the position reproduces the stream.
    fresh = _loader(data, 0, 1)
    fresh.load_state_dict(one.state_dict())
    assert torch.equal(fresh.micro_batch(1)[0], one.micro_batch(1)[0])
    # Validation batches are fixed.
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one.val_batches(2048), fresh.val_batches(2048)))


def test_epochs_visit_every_window_once():
    data = TokenData.build(DataConfig(), seq_len=128, vocab_size=256)
    loader = _loader(data, 0, 1, global_batch=4, micro=4)
    n = data.num_train_windows
    seen = {loader._window_index(i) for i in range(n)}
    assert seen == set(range(n))
    assert [loader._window_index(n + i) for i in range(5)] != [loader._window_index(i) for i in range(5)]


def test_text_and_bin_sources(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 100)
    tokens = load_tokens(DataConfig(source="text", paths=[str(text)]), 256)
    assert ByteTokenizer().decode(tokens[:11]) == "hello world"
    for dtype_name, dtype in (("uint16", torch.uint16), ("uint32", torch.uint32)):
        path = tmp_path / f"t_{dtype_name}.bin"
        values = torch.arange(0, 60000, 7, dtype=torch.int64)
        path.write_bytes(bytes(values.to(dtype).view(torch.uint8).tolist()))
        got = load_tokens(DataConfig(source="bin", paths=[str(path)], bin_dtype=dtype_name), 60000)
        assert torch.equal(got, values)
    with pytest.raises(ValueError, match=r"token id 59997 .* >= model.vocab_size \(50000\)"):
        load_tokens(DataConfig(source="bin", paths=[str(tmp_path / "t_uint16.bin")]), 50000)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a multiple of 2"):
        load_tokens(DataConfig(source="bin", paths=[str(odd)]), 256)
    with pytest.raises(ValueError, match=r"data.paths\[0\]: no such file"):
        load_tokens(DataConfig(source="text", paths=[str(tmp_path / "missing.txt")]), 256)
