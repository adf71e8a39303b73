"""Training data: tokenizer, corpora, train/validation split, deterministic batches.

Sources (``data.source``):

* ``stdlib`` -- needs no download: the English text of the Python language
  reference that ships with the standard library as ``pydoc_data.topics`` (what
  ``help("assert")`` prints; about 460 kB on CPython 3.11), byte-tokenized.
* ``text`` -- your UTF-8 text files, concatenated, byte-tokenized.
* ``bin`` -- pre-tokenized flat ``uint16``/``uint32`` token arrays (nanoGPT's
  ``train.bin``, Megatron's ``.bin`` without the index), concatenated.

The token stream is split once: the last ``val_fraction`` is validation. Training
samples are windows of ``seq_len + 1`` tokens at a stride of ``seq_len``; every
epoch visits them in a fresh permutation drawn from ``(seed, epoch)``. The loader's
only state is ``consumed_samples``: step ``s`` uses global samples
``[consumed, consumed + global_batch_size)`` and DP rank ``d`` / micro-batch ``m``
takes rows ``(m * dp + d) * micro_batch_size ...`` of them. Batches therefore depend
on the step, not on how many processes there are, and resuming only needs
``consumed_samples``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from .config import DataConfig
from .tokenizer import ByteTokenizer, Tok, build_tokenizer

__all__ = ["ByteTokenizer", "TokenData", "BatchLoader", "corpus_bytes", "load_tokens", "make_tokenizer", "stdlib_corpus"]


def stdlib_corpus() -> str:
    """The default corpus: ``pydoc_data.topics`` (Python reference text), keys sorted."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip it; say what to do instead
        raise ValueError(
            "data.source=stdlib needs the standard-library module pydoc_data "
            f"({exc}); use data=text data.paths=[...] instead"
        ) from exc
    return "\n\n".join(topics[key] for key in sorted(topics))


_BIN_DTYPES = {"uint16": (torch.uint16, 2), "uint32": (torch.uint32, 4)}


def _read_bin(path: str, dtype_name: str) -> torch.Tensor:
    dtype, itemsize = _BIN_DTYPES[dtype_name]
    size = os.path.getsize(path)
    if size % itemsize:
        raise ValueError(
            f"data.paths: {path} has {size} bytes, not a multiple of {itemsize} "
            f"(data.bin_dtype={dtype_name}); wrong dtype?"
        )
    # Read as raw bytes, then reinterpret: works for uint16/uint32 on every torch >= 2.3.
    raw = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    return raw.view(dtype).to(torch.int64)


def corpus_bytes(cfg: DataConfig) -> bytes:
    """The text corpus of ``data.source=stdlib|text`` as UTF-8 bytes (files joined by a blank line)."""
    for i, path in enumerate(cfg.paths):
        if not os.path.isfile(path):
            raise ValueError(f"data.paths[{i}]: no such file: {path!r}")
    if cfg.source == "stdlib":
        return stdlib_corpus().encode("utf-8")
    parts = []
    for p in cfg.paths:
        with open(p, "rb") as f:
            parts.append(f.read())
    return b"\n\n".join(parts)


def make_tokenizer(cfg: DataConfig, vocab_size: int, is_rank0: bool = True,
                   barrier: Callable[[], None] = lambda: None) -> Optional[Tok]:
    """The tokenizer of ``data.tokenizer`` (None for pre-tokenized ``bin`` data).

    A BPE is trained on the training part of the corpus (the first ``1 - val_fraction``
    of its bytes) by rank 0 and cached (``tp_fuse.launch.tokenizer``).
    """
    if cfg.source == "bin":
        return None

    def training_text() -> bytes:
        data = corpus_bytes(cfg)
        return data[: max(1, int(len(data) * (1.0 - cfg.val_fraction)))]

    return build_tokenizer(cfg.tokenizer, vocab_size, training_text, list(cfg.paths), is_rank0, barrier)


def load_tokens(cfg: DataConfig, vocab_size: int, tokenizer: Optional[Tok] = None) -> torch.Tensor:
    """The whole token stream (int64) for ``cfg``; ValueError for bad files or ids.

    ``tokenizer`` None: :func:`make_tokenizer` (for text sources).
    """
    for i, path in enumerate(cfg.paths):
        if not os.path.isfile(path):
            raise ValueError(f"data.paths[{i}]: no such file: {path!r}")
    if cfg.source == "bin":
        tokens = torch.cat([_read_bin(p, cfg.bin_dtype) for p in cfg.paths])
    else:
        if tokenizer is None:
            tokenizer = make_tokenizer(cfg, vocab_size)
        text_bytes = corpus_bytes(cfg)
        if isinstance(tokenizer, ByteTokenizer):
            # The byte tokenizer's tokens of UTF-8 text are its bytes: no decode/encode round trip.
            tokens = torch.frombuffer(bytearray(text_bytes), dtype=torch.uint8).to(torch.int64)
        else:
            tokens = tokenizer.encode(text_bytes.decode("utf-8", errors="replace")).to(torch.int64)
    if tokens.numel() == 0:
        raise ValueError(f"data: the {cfg.source} corpus is empty")
    # The one check of the ids, on the host, before any batch reaches the device (the
    # model's own check is device-side: it fails the step later, without naming the file).
    low, top = (int(v) for v in torch.aminmax(tokens))
    if top >= vocab_size:
        raise ValueError(
            f"data: token id {top} in the {cfg.source} corpus is >= model.vocab_size ({vocab_size})"
        )
    if low < 0:
        raise ValueError(f"data: token id {low} in the {cfg.source} corpus is negative")
    return tokens


@dataclass
class TokenData:
    """Train and validation token streams plus the sample geometry."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int

    @classmethod
    def build(cls, cfg: DataConfig, seq_len: int, vocab_size: int, tokenizer: Optional[Tok] = None) -> "TokenData":
        tokens = load_tokens(cfg, vocab_size, tokenizer)
        n_val = max(int(tokens.numel() * cfg.val_fraction), seq_len + 1)
        n_train = tokens.numel() - n_val
        if n_train < 2 * (seq_len + 1):
            raise ValueError(
                f"data: the {cfg.source} corpus has {tokens.numel()} tokens; too few for "
                f"data.seq_len={seq_len} with data.val_fraction={cfg.val_fraction}"
            )
        return cls(train=tokens[:n_train], val=tokens[n_train:], seq_len=seq_len)

    @property
    def num_train_windows(self) -> int:
        return (self.train.numel() - 1) // self.seq_len

    @property
    def num_val_windows(self) -> int:
        return (self.val.numel() - 1) // self.seq_len


class BatchLoader:
    """Deterministic micro-batches for one DP rank.

    Args:
        data: the token streams.
        global_batch_size: sequences per optimizer step over all DP ranks.
        micro_batch_size: sequences per micro-batch on one rank.
        dp_rank, dp_size: this rank's place in the data-parallel group.
        seed: seeds the per-epoch permutations.
        device: where batches go.

    State: ``consumed_samples`` (global samples of finished steps).
    """

    def __init__(
        self,
        data: TokenData,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        device: torch.device,
    ) -> None:
        assert global_batch_size % (micro_batch_size * dp_size) == 0
        self.data = data
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.device = device
        self.consumed_samples = 0
        self._perm_epoch: Optional[int] = None
        self._perm: Optional[torch.Tensor] = None

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def _window_index(self, sample: int) -> int:
        n = self.data.num_train_windows
        epoch, pos = divmod(sample, n)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(n, generator=gen)
            self._perm_epoch = epoch
        assert self._perm is not None
        return int(self._perm[pos])

    def _rows(self, stream: torch.Tensor, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.data.seq_len
        # Token ids were checked against the vocabulary on the host when loaded (load_tokens):
        # the device copy needs no check that would read it back.
        pieces = [stream[w * s : w * s + s + 1] for w in windows]
        if self.device.type == "cuda":
            # Pinned staging: the copy is asynchronous (from pageable memory non_blocking
            # would wait); the caching host allocator keeps the buffer until it is done.
            staging = torch.empty((len(windows), s + 1), dtype=stream.dtype, pin_memory=True)
            rows = torch.stack(pieces, out=staging)
        else:
            rows = torch.stack(pieces)  # [micro, seq+1]
        rows = rows.to(self.device, non_blocking=True)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # tokens, labels: [micro, seq]

    def micro_batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, labels)`` of micro-batch ``micro`` of the current step."""
        if not 0 <= micro < self.grad_accum_steps:
            raise ValueError(f"micro-batch index {micro} out of range [0, {self.grad_accum_steps})")
        first = self.consumed_samples + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
        windows = [self._window_index(first + i) for i in range(self.micro_batch_size)]
        return self._rows(self.data.train, windows)

    def advance(self) -> None:
        """The step is done: move to the next global batch."""
        self.consumed_samples += self.global_batch_size

    def val_windows(self, val_tokens: int) -> int:
        """How many ``seq_len`` windows the validation set has: ``val_tokens // seq_len``
        (at least 1), at most the whole validation split."""
        return max(1, min(self.data.num_val_windows, val_tokens // self.data.seq_len))

    def val_batches(self, val_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's share of the fixed validation set (same every call).

        The set is the first :meth:`val_windows` windows of the validation split, whatever
        the layout: DP rank ``d`` takes windows ``d, d + dp, d + 2 dp, ...`` in micro-batches
        of up to ``micro_batch_size`` rows (the last one may be shorter; a rank may get
        none). Callers weight each batch's mean loss by its rows and sum over DP ranks.
        """
        mine = list(range(self.dp_rank, self.val_windows(val_tokens), self.dp_size))
        step = self.micro_batch_size
        return [self._rows(self.data.val, mine[i : i + step]) for i in range(0, len(mine), step)]

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
