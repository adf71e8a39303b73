"""Tokenizers for text corpora: bytes, a byte-level BPE trained on the corpus, or a tokenizer.json.

``data.tokenizer``:

* ``byte`` -- UTF-8 bytes, vocabulary 256 (:class:`ByteTokenizer`);
* ``bpe`` -- a byte-level BPE with ``model.vocab_size`` tokens trained on the training
  corpus with the Hugging Face ``tokenizers`` library (GPT-2's byte-level pre-tokenizer,
  all 256 byte symbols in the alphabet, so any text encodes). Training is deterministic
  (same corpus and size: the same merges, whatever the thread count) and cached beside
  the data: ``<dir of the first data file>/tp_fuse_tokenizers/bpe-<vocab>-<corpus hash>.json``
  (for ``data.source=stdlib``, or a directory that is not writable:
  ``$XDG_CACHE_HOME/tp-fuse/tokenizers``). A small corpus can end with fewer tokens than
  asked (no pair left to merge); the rest of the embedding rows stay unused;
* ``<path>.json`` -- a Hugging Face ``tokenizer.json``: a JSON description, parsed by
  ``tokenizers`` (no code runs, unlike ``trust_remote_code`` model directories);
* ``auto`` (default) -- ``byte`` when ``model.vocab_size`` is 256, else ``bpe``: each model
  preset trains on a vocabulary of its own size.

:func:`check_tokenizer_choice` validates the choice against ``model.vocab_size`` before start-up:
a tokenizer with more tokens than the embedding has rows is an error, and so is one that
leaves more than 127 rows unused (128 = the usual padding multiple), except a trained BPE
whose corpus ran out of merges.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Optional, Protocol

import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tp_fuse.safe_files import read_regular_file, write_atomic

__all__ = [
    "BPE_RECIPE",
    "MAX_TOKENIZER_BYTES",
    "ByteTokenizer",
    "FileTokenizer",
    "Tok",
    "bpe_cache_path",
    "build_tokenizer",
    "check_tokenizer_choice",
    "resolve_kind",
    "train_bpe",
]

#: Part of the cache key: bump when the training recipe below changes.
BPE_RECIPE = "bytelevel-bpe-v1"
_UNUSED_ROWS_ALLOWED = 127
#: The largest tokenizer.json files in use are tens of MB (a 256k-token vocabulary with its
#: merges: ~35 MB); a larger file is damaged or crafted, and is refused before it is read.
MAX_TOKENIZER_BYTES = 256 * 2**20


class Tok(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary of 256, lossless for any text."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()

    def decode(self, tokens: torch.Tensor) -> str:
        return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` (JSON only: no code runs).

    Raises ValueError naming the file when it is missing or not a tokenizer description.
    """

    def __init__(self, path: str, name: Optional[str] = None) -> None:
        if not os.path.lexists(path):
            raise ValueError(f"data.tokenizer: no such file: {path!r} (expected a tokenizer.json, 'bpe', 'byte' or 'auto')")
        # Read here, bounded (Tokenizer.from_file reads any size, and blocks on a FIFO): a
        # link to /dev/zero, a FIFO or a directory is named as what it is, a 20 GiB file
        # is refused by its size.
        try:
            raw = read_regular_file(path, MAX_TOKENIZER_BYTES, "tokenizer file", follow_symlinks=True)
        except OSError as exc:  # a dangling link, no permission
            raise ValueError(f"data.tokenizer={path}: cannot read it: {exc.strerror or exc}") from None
        try:
            self.tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type for malformed JSON
            raise ValueError(f"data.tokenizer={path}: not a valid tokenizer.json "
                             f"({' '.join(str(exc).split())[:300]})") from None
        self.path = path
        self.name = name or path
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> torch.Tensor:
        # Paragraph batches: encode_batch runs them in parallel; tokens never span "\n\n".
        parts = text.split("\n\n")
        sep = self.tokenizer.encode("\n\n", add_special_tokens=False).ids
        ids: list[int] = []
        for i, enc in enumerate(self.tokenizer.encode_batch(parts, add_special_tokens=False)):
            if i:
                ids.extend(sep)
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, tokens: torch.Tensor) -> str:
        return self.tokenizer.decode(tokens.tolist())


def resolve_kind(choice: str, vocab_size: int) -> str:
    """``byte``, ``bpe`` or a path, for ``data.tokenizer=choice`` (``auto`` by the vocabulary)."""
    if choice == "auto":
        return "byte" if vocab_size == 256 else "bpe"
    return choice


def check_tokenizer_choice(choice: str, source: str, vocab_size: int) -> None:
    """Before start-up: the choice is valid and its vocabulary fits ``model.vocab_size``."""
    if source == "bin":
        return  # pre-tokenized: token ids are checked against model.vocab_size when loaded
    kind = resolve_kind(choice, vocab_size)
    if kind == "bpe":
        if vocab_size <= 256:
            raise ValueError(f"data.tokenizer=bpe needs model.vocab_size > 256 (byte-level BPE: 256 byte "
                             f"tokens plus merges), got {vocab_size}; use data.tokenizer=byte")
        return
    if kind == "byte":
        n, what = ByteTokenizer.vocab_size, "data.tokenizer=byte"
    else:
        if not kind.endswith(".json"):
            raise ValueError(f"data.tokenizer: expected auto, byte, bpe or a path to a tokenizer.json, got {choice!r}")
        n, what = FileTokenizer(kind).vocab_size, f"data.tokenizer={kind}"
    if n > vocab_size:
        raise ValueError(f"{what} has {n} tokens but model.vocab_size is {vocab_size}: "
                         f"set model.vocab_size >= {n}")
    if vocab_size - n > _UNUSED_ROWS_ALLOWED:
        hint = "data.tokenizer=bpe (or auto)" if kind == "byte" else "a tokenizer of that size"
        raise ValueError(f"{what} has {n} tokens but model.vocab_size is {vocab_size}: {vocab_size - n} "
                         f"embedding rows would never be used; set model.vocab_size={n} (or a multiple of "
                         f"128 just above it), or use {hint}")


def _cache_dir(data_paths: list[str]) -> str:
    if data_paths:
        beside = os.path.join(os.path.dirname(os.path.abspath(data_paths[0])), "tp_fuse_tokenizers")
        parent = os.path.dirname(beside)
        if os.access(parent, os.W_OK):
            return beside
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tp-fuse", "tokenizers")


def bpe_cache_path(corpus: bytes, vocab_size: int, data_paths: list[str]) -> str:
    """Where the BPE for this corpus and size is cached (the key includes the recipe and
    the ``tokenizers`` version, which could change the merges)."""
    h = hashlib.sha256()
    h.update(f"{BPE_RECIPE}/{tokenizers.__version__}/{vocab_size}/".encode())
    h.update(corpus)
    return os.path.join(_cache_dir(data_paths), f"bpe-{vocab_size}-{h.hexdigest()[:16]}.json")


def train_bpe(text: str, vocab_size: int, path: str) -> None:
    """Train the byte-level BPE on ``text`` and write it to ``path`` atomically."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # An exclusively created temporary file, not "<path>.tmp-<pid>" (a guessable name a
    # planted link could redirect), renamed into place.
    write_atomic(path, tok.to_str(pretty=True), fsync=False)


def build_tokenizer(
    choice: str,
    vocab_size: int,
    corpus: Callable[[], bytes],
    data_paths: list[str],
    is_rank0: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Tok:
    """The tokenizer for ``data.tokenizer=choice``; a BPE is trained by rank 0 (others wait at
    ``barrier``) unless cached. ``corpus()`` returns the training text as UTF-8 bytes."""
    kind = resolve_kind(choice, vocab_size)
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        return FileTokenizer(kind)
    data = corpus()
    path = bpe_cache_path(data, vocab_size, data_paths)
    if is_rank0 and not os.path.exists(path):
        train_bpe(data.decode("utf-8", errors="replace"), vocab_size, path)
    barrier()
    return FileTokenizer(path, name=f"bpe ({os.path.basename(path)})")
