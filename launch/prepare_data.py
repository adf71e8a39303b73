"""Tokenize text, JSONL or Parquet files into the launcher's ``data=bin`` format.

::

    python -m tp_fuse.launch.prepare_data book1.txt book2.txt --out data/books
    python -m tp_fuse.launch.prepare_data docs.jsonl --field text --tokenizer bpe --vocab-size 2048 --out data/docs
    python launch/train.py +model=gpt data=bin data.paths=[data/books/train.bin,data/books/val.bin]

Writes ``<out>/train.bin`` and ``<out>/val.bin`` (flat little-endian ``uint16`` token ids, or
``uint32`` for vocabularies over 65,536: nanoGPT's format, what ``data=bin`` reads) and
``<out>/meta.json`` (inputs, tokenizer, dtype, token counts, the ``train.py`` arguments).

The token stream is the one the launcher builds for ``data=text``: inputs in the given order,
documents (a text file; one JSONL line's or Parquet row's ``--field``) joined by a blank
line (``"\\n\\n"``) and tokenized paragraph by paragraph like ``data.tokenizer`` does (a text
file with the byte tokenizer gives exactly its bytes). The last ``--val-fraction`` of it is
``val.bin``: with ``data.paths=[train.bin,val.bin]`` and the same ``data.val_fraction`` the
launcher splits at the same token (unless ``data.seq_len + 1`` is more than ``val.bin`` has).

Tokenizers (``--tokenizer``, as ``data.tokenizer``): ``byte`` (default, 256 ids), ``bpe`` (a
byte-level BPE of ``--vocab-size`` trained on the first ``1 - val_fraction`` of the corpus,
cached like the launcher's), ``auto`` (``byte`` for ``--vocab-size 256``, else ``bpe``), or a
``tokenizer.json`` (or a model directory holding one, as ``+model=hf`` uses).

Resumable: progress is recorded in ``<out>/prepare.partial/`` after every few MiB of input;
rerunning the same command continues where it stopped (a run with other inputs, other
input sizes or times, or another tokenizer is refused; ``--restart`` starts over). One run per
``--out`` at a time: the directory is locked before anything in it is read, removed or
written, and what an earlier run left there is checked before it is used
(:mod:`tp_fuse.launch.prepare_output`). Output is
deterministic: the same inputs and tokenizer give the same bytes, interrupted or not. Files
are written through exclusive temporary files renamed into place (a symbolic link planted
in ``<out>`` is replaced or refused, never written through); inputs are read in bounded
pieces (a JSONL line over 64 MiB, a paragraph without a blank line over 8 MiB, is cut or
refused, see :data:`MAX_LINE_BYTES`, :data:`MAX_PARAGRAPH_BYTES`).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional

# Before any other import: `python launch/prepare_data.py` puts launch/ on sys.path, where
# launch/logging/ would stand in for the standard library's logging; _tp_fuse_checkout takes
# it off and imports tp_fuse from this checkout (see its docstring).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_fuse_checkout import use_checkout  # noqa: E402

use_checkout()

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

from tp_fuse.launch.tokenizer import ByteTokenizer, FileTokenizer, Tok, build_tokenizer, resolve_kind  # noqa: E402
from tp_fuse.launch.prepare_output import (OUTPUTS, PARTIAL, PartialOutput, lock_output_dir, open_tokens,  # noqa: E402
                                           read_meta, writing)
from tp_fuse.safe_files import atomic_writer, describe_kind, open_regular_file, write_atomic  # noqa: E402

__all__ = ["PrepareJob", "main", "prepare"]

#: Input read per step (and progress recorded after each): small enough to lose little on
#: an interruption, large enough that the fsync per step costs nothing.
CHUNK_BYTES = 4 << 20
#: Longest JSONL line; a longer one is refused (a damaged or crafted file).
MAX_LINE_BYTES = 64 << 20
#: A text paragraph (no blank line) longer than this is tokenized in pieces of this size,
#: cut at a line break where there is one (byte tokenizer: exactly the same tokens anyway).
MAX_PARAGRAPH_BYTES = 8 << 20
#: ``--tokenizer bpe`` trains on the whole corpus in memory, as the launcher does.
MAX_BPE_CORPUS_BYTES = 2 << 30
PARQUET_BATCH_ROWS = 1024
FORMATS = ("text", "jsonl", "parquet")
_SEP = b"\n\n"
_STATE_VERSION = 1
#: Bytes per token of each output dtype.
_ITEMSIZE = {"uint16": 2, "uint32": 4}


def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(f"reading Parquet files needs pyarrow ({exc}): pip install pyarrow") from None
    return pq


def _tokenizer_file(choice: str) -> str:
    # A model directory (+model=hf's model.path) stands for its tokenizer.json.
    if os.path.isdir(choice):
        path = os.path.join(choice, "tokenizer.json")
        if not os.path.lexists(path):  # a FIFO or a link to a device: FileTokenizer names it
            raise ValueError(f"--tokenizer {choice}: a directory without tokenizer.json")
        return path
    return choice


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open_regular_file(path, "tokenizer file", follow_symlinks=True) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class PrepareJob:
    """What one ``prepare_data`` run does: inputs, tokenizer, output dtype and split.

    Raises ValueError for a missing or special input file, an unknown format, a tokenizer
    that does not fit the chosen dtype, or a bad ``val_fraction``.
    """

    def __init__(self, inputs: list[str], out: str, *, fmt: str = "auto", field: str = "text",
                 tokenizer: str = "byte", vocab_size: Optional[int] = None, val_fraction: float = 0.05,
                 dtype: str = "auto") -> None:
        if not inputs:
            raise ValueError("no input files; expected text, JSONL or Parquet files")
        if fmt not in ("auto", *FORMATS):
            raise ValueError(f"--format {fmt!r}: expected auto, text, jsonl or parquet")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"--val-fraction {val_fraction}: expected a fraction in (0, 1) (0.05: the last 5% "
                             "of the tokens are validation)")
        if dtype not in ("auto", "uint16", "uint32"):
            raise ValueError(f"--dtype {dtype!r}: expected auto, uint16 or uint32 (data.bin_dtype)")
        self.inputs = []
        for path in inputs:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise ValueError(f"input {path!r}: no such file") from None
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"input {path!r} is {describe_kind(st.st_mode)}, not a regular file")
            self.inputs.append({"path": os.path.abspath(path), "format": _format_of(path, fmt),
                                "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        if any(i["format"] == "parquet" for i in self.inputs):
            _pyarrow_parquet()  # fail before any work when pyarrow is missing
        self.out = out
        self.field = field
        self.val_fraction = val_fraction
        self.tokenizer_choice = tokenizer
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.tok: Optional[Tok] = None

    def load_tokenizer(self, progress: Callable[[str], None] = lambda s: None) -> Tok:
        """The tokenizer (a BPE is trained on the corpus, or read from the launcher's cache)."""
        choice = self.tokenizer_choice
        if choice in ("auto", "bpe"):
            if self.vocab_size is None:
                raise ValueError(f"--tokenizer {choice} needs --vocab-size (model.vocab_size of the run)")
            if resolve_kind(choice, self.vocab_size) == "bpe" and self.vocab_size <= 256:
                raise ValueError(f"--tokenizer bpe needs --vocab-size > 256 (256 byte tokens plus merges), "
                                 f"got {self.vocab_size}; use --tokenizer byte")
            if resolve_kind(choice, self.vocab_size) == "bpe":
                progress("training the BPE tokenizer on the corpus (cached for the next run)")
            self.tok = build_tokenizer(choice, self.vocab_size, self._bpe_corpus,
                                       [i["path"] for i in self.inputs])
        elif choice == "byte":
            self.tok = ByteTokenizer()
        else:
            self.tok = FileTokenizer(_tokenizer_file(choice))
        n = self.tok.vocab_size
        if self.dtype == "auto":
            self.dtype = "uint16" if n <= 1 << 16 else "uint32"
        elif self.dtype == "uint16" and n > 1 << 16:
            raise ValueError(f"--dtype uint16 holds ids below 65536 but the tokenizer has {n} tokens; use --dtype "
                             "uint32 (and data.bin_dtype=uint32)")
        return self.tok

    def _bpe_corpus(self) -> bytes:
        # The launcher trains data=text's BPE on the first 1 - val_fraction of the corpus bytes.
        too_large = (f"over {MAX_BPE_CORPUS_BYTES} bytes, too large to train a BPE on in memory; train a "
                     "tokenizer.json separately and pass --tokenizer path/to/tokenizer.json")
        if sum(i["size"] for i in self.inputs) > MAX_BPE_CORPUS_BYTES:
            raise ValueError(f"--tokenizer bpe: the inputs are {too_large}")
        parts: list[bytes] = []
        total = 0
        for spec in self.inputs:
            pieces = ((chunk for chunk, _ in _text_chunks(spec["path"], 0)) if spec["format"] == "text"
                      else (doc for doc, _ in _records(self, spec, (0, 0))))
            text = []
            for piece in pieces:
                # Counted as read too: a file's size can understate what it yields (procfs
                # files are size 0; a file can grow after it was listed).
                total += len(piece)
                if total > MAX_BPE_CORPUS_BYTES:
                    raise ValueError(f"--tokenizer bpe: the inputs up to {spec['path']} are {too_large}")
                text.append(piece)
            if spec["format"] == "text":
                parts.append(b"".join(text))
            else:
                parts.extend(text)
        data = _SEP.join(parts)
        return data[: max(1, int(len(data) * (1.0 - self.val_fraction)))]

    def identity(self) -> dict[str, Any]:
        """What a partial or finished output must have been made with to be continued or kept."""
        assert self.tok is not None
        tok = {"kind": "byte"} if isinstance(self.tok, ByteTokenizer) else {
            "kind": "tokenizer.json", "path": self.tok.path, "sha256": _sha256_file(self.tok.path)}  # type: ignore[attr-defined]
        return {"version": _STATE_VERSION, "inputs": self.inputs, "field": self.field,
                "tokenizer": {**tok, "vocab_size": self.tok.vocab_size}, "dtype": self.dtype,
                "val_fraction": self.val_fraction}


class _Encoder:
    """Token ids of paragraphs (bytes split at blank lines) as the launcher's tokenizers make them."""

    def __init__(self, tok: Tok, dtype: str) -> None:
        self.tok = tok
        # array typecodes of the token width ("I" is a C unsigned int: 4 bytes on every platform torch runs on)
        self.code = "H" if dtype == "uint16" else "I"
        assert array.array(self.code).itemsize == (2 if dtype == "uint16" else 4)
        self.sep = self._ids(_SEP)

    def _ids(self, data: bytes) -> array.array:
        if isinstance(self.tok, ByteTokenizer):
            return array.array(self.code, iter(data))  # the byte tokenizer's ids are the bytes (iter: not raw memory)
        # FileTokenizer.encode splits at "\n\n" and joins with the separator's ids: the same
        # tokens as the launcher's encode of the whole corpus (a blank line is ASCII, so
        # decoding piece by piece replaces the same invalid bytes).
        ids = self.tok.encode(data.decode("utf-8", errors="replace"))
        return array.array(self.code, ids.tolist())

    def encode(self, paragraphs: list[bytes]) -> array.array:
        return self._ids(_SEP.join(paragraphs))


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """A failed read of an input (``/proc/self/mem``: EIO; a disk error) as one line naming it."""
    try:
        yield
    except OSError as exc:
        raise ValueError(f"input {path}: cannot read it: {exc.strerror or exc}") from None


def _text_chunks(path: str, offset: int) -> Iterator[tuple[bytes, int]]:
    """``(chunk, file offset after it)`` of a text file from ``offset``, :data:`CHUNK_BYTES` at a time."""
    with open_regular_file(path, "input file", follow_symlinks=True) as f:
        f.seek(offset)
        while True:
            with _reading(path):
                chunk = f.read(CHUNK_BYTES)
            if not chunk:
                return
            yield chunk, f.tell()


def _jsonl_documents(path: str, field: str, pos: tuple[int, int]) -> Iterator[tuple[bytes, tuple[int, int]]]:
    with open_regular_file(path, "input file", follow_symlinks=True) as f:
        f.seek(pos[0])
        lineno = pos[1]
        while True:
            with _reading(path):
                raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES} bytes; expected one JSON "
                                 "object per line (JSONL)")
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({type(exc).__name__}: {exc}); expected one "
                                 f"JSON object per line with a string field {field!r}") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                got = (f"keys {sorted(record)[:10]}" if isinstance(record, dict) and field not in record
                       else f"{field!r}: {type(record.get(field)).__name__}" if isinstance(record, dict)
                       else type(record).__name__)
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field {field!r} (--field), "
                                 f"got {got}")
            yield record[field].encode("utf-8", errors="replace"), (f.tell(), lineno)


def _parquet_documents(path: str, field: str, pos: tuple[int, int]) -> Iterator[tuple[bytes, tuple[int, int]]]:
    pq = _pyarrow_parquet()
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise ValueError(f"{path}: not a Parquet file ({type(exc).__name__}: {exc})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path}: no column {field!r} (--field); it has: {', '.join(names)}")
    first_group, skip = pos
    for group in range(first_group, pf.num_row_groups):
        row = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if group == first_group and row <= skip:
                    continue
                if not isinstance(value, str):
                    raise ValueError(f"{path}: row {row} of row group {group}: column {field!r} is "
                                     f"{type(value).__name__}, expected a string")
                done = row == pf.metadata.row_group(group).num_rows
                yield value.encode("utf-8", errors="replace"), ((group + 1, 0) if done else (group, row))


def _records(job: PrepareJob, spec: dict[str, Any], pos: tuple[int, int]) -> Iterator[tuple[bytes, tuple[int, int]]]:
    """``(document, position after it)`` of a JSONL or Parquet input from ``pos``."""
    if spec["format"] == "jsonl":
        return _jsonl_documents(spec["path"], job.field, pos)
    return _parquet_documents(spec["path"], job.field, pos)


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(keys) or "nothing"


def _split(job: PrepareJob, output: PartialOutput, n_tokens: int, itemsize: int) -> dict[str, Any]:
    """``train.bin``/``val.bin`` from the token file, then ``meta.json`` (the completion mark)."""
    n_val = int(n_tokens * job.val_fraction)
    n_train = n_tokens - n_val
    if n_val < 1 or n_train < 1:
        raise ValueError(f"the inputs give {n_tokens} tokens: too few to split with --val-fraction "
                         f"{job.val_fraction} (each split needs at least one token)")
    with open_regular_file(output.tokens_path, "prepare_data token file") as src:
        for name, count in (("train.bin", n_train), ("val.bin", n_val)):
            left = count * itemsize
            with writing(os.path.join(job.out, name)), atomic_writer(os.path.join(job.out, name)) as dst:
                while left:
                    block = src.read(min(left, 16 << 20))
                    if not block:
                        raise ValueError(f"{output.tokens_path} ended early; rerun with --restart")
                    dst.write(block)
                    left -= len(block)
    paths = [os.path.join(job.out, "train.bin"), os.path.join(job.out, "val.bin")]
    meta = {**job.identity(), "tokens": n_tokens, "train_tokens": n_train, "val_tokens": n_val,
            "train_args": ["data=bin", f"data.paths=[{','.join(paths)}]", f"data.bin_dtype={job.dtype}",
                           f"data.val_fraction={job.val_fraction}"]}
    with writing(os.path.join(job.out, "meta.json")):
        write_atomic(os.path.join(job.out, "meta.json"), json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def _progress_bar(total: int, enabled: bool):
    """A rich progress bar over input bytes on stderr (a no-op object when disabled)."""
    if not enabled:
        return contextlib.nullcontext(None)
    return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _prepare_locked(job: PrepareJob, restart: bool, progress: bool,
                    log: Callable[[str], None]) -> tuple[dict[str, Any], bool]:
    """:func:`prepare` under the output directory's lock: the meta, and whether this run wrote it
    (False: the output was already there)."""
    tok = job.load_tokenizer(log)
    identity = job.identity()
    if restart:
        for name in OUTPUTS:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(job.out, name))
    elif os.path.lexists(os.path.join(job.out, "meta.json")):
        meta = read_meta(job.out, _ITEMSIZE)
        old = {k: meta.get(k) for k in identity}
        if old == identity:
            log(f"{job.out}: already prepared from these inputs ({meta['tokens']:,} tokens); nothing to do")
            return meta, False
        raise ValueError(f"{job.out} holds data prepared with other settings ({_differences(old, identity)} differ); "
                         "use another --out, or --restart to replace it")
    else:
        stray = [n for n in OUTPUTS[:2] if os.path.lexists(os.path.join(job.out, n))]
        if stray and not os.path.lexists(os.path.join(job.out, PARTIAL)):
            raise ValueError(f"{job.out} has {', '.join(stray)} but no meta.json: not written by prepare_data (or "
                             "from a run whose progress was deleted); use another --out, or --restart to replace them")
    output = PartialOutput(job.out)
    state = None if restart else output.read_state(len(job.inputs))
    if state is not None and state["identity"] != identity:
        raise ValueError(f"{output.dir}: a partial run with other settings ({_differences(state['identity'], identity)} "
                         "differ: inputs changed since?); rerun it as it was, or pass --restart to start over")
    if state is None:
        state = {"identity": identity, "input": 0, "pos": [0, 0], "tokens": 0, "sep_due": False, "prefix": False}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(output.tokens_path)
        output.write_state(state)
    else:
        log(f"{job.out}: resuming at input {state['input'] + 1}/{len(job.inputs)} with {state['tokens']:,} "
            "tokens written")
    enc = _Encoder(tok, job.dtype)
    itemsize = array.array(enc.code).itemsize
    fd = open_tokens(output.tokens_path)
    with os.fdopen(fd, "r+b") as tokens_file:
        have = os.fstat(fd).st_size
        want = state["tokens"] * itemsize
        if have < want:
            raise ValueError(f"{output.tokens_path} has {have} bytes, fewer than the {want} its state records; "
                             "rerun with --restart")
        tokens_file.truncate(want)  # tokens appended after the last recorded state: redone below
        tokens_file.seek(want)
        _tokenize(job, enc, state, tokens_file, output, progress)
    meta = _split(job, output, state["tokens"], itemsize)
    output.remove()
    return meta, True


def prepare(job: PrepareJob, *, restart: bool = False, progress: bool = True,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Tokenize ``job``'s inputs into ``<out>/train.bin``, ``val.bin``, ``meta.json``; returns the meta.

    Continues a partial output made with the same job; a finished output of the same job
    is returned as it is. ``restart``: discard an earlier partial or finished output first.
    """
    lock = lock_output_dir(job.out)  # before anything in --out is read, removed or written
    try:
        meta, written = _prepare_locked(job, restart, progress, log)
    finally:
        os.close(lock)
    if not written:
        return meta
    log(f"wrote {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens ({job.dtype}) to {job.out}; "
        f"train with: python launch/train.py +model=gpt {' '.join(meta['train_args'])}")
    return meta


def _cut(buf: bytes, byte_level: bool) -> int:
    """Where to cut a paragraph longer than :data:`MAX_PARAGRAPH_BYTES`: the cut depends only on
    its first ``MAX_PARAGRAPH_BYTES`` bytes (so not on how the input was read): at its last
    line break in their second half, else before a UTF-8 continuation byte."""
    end = MAX_PARAGRAPH_BYTES
    if byte_level:
        return end  # the byte tokenizer's pieces concatenate to the same tokens anyway
    nl = buf.rfind(b"\n", end // 2, end)
    if nl >= 0:
        return nl + 1
    while end > 1 and (buf[end] & 0xC0) == 0x80:
        end -= 1
    return end


class _Writer:
    """Appends tokens of paragraphs to the token file and records progress in the state."""

    def __init__(self, job: PrepareJob, enc: _Encoder, state: dict[str, Any], tokens_file, output: PartialOutput,
                 bar: Any, task: Any) -> None:
        self.job, self.enc, self.state = job, enc, state
        self.tokens_file, self.output, self.bar, self.task = tokens_file, output, bar, task
        self.byte_level = isinstance(enc.tok, ByteTokenizer)
        # The last paragraph of the document read last: how it splits depends on whether
        # another document follows (next_document / end). Progress is only recorded while
        # there is none, so a resumed run never needs it.
        self.pending: Optional[bytes] = None

    def _emit(self, groups: list[tuple[bool, list[bytes]]]) -> None:
        for sep, parts in groups:
            ids = self.enc.encode(parts)
            if sep:
                ids = self.enc.sep + ids
            if sys.byteorder == "big":  # the format is little-endian (nanoGPT's files)
                ids.byteswap()
            with writing(self.output.tokens_path):
                self.tokens_file.write(ids.tobytes())
            self.state["tokens"] += len(ids)

    def paragraphs(self, parts: list[bytes]) -> None:
        """Complete paragraphs of the stream (a separator before each but the stream's first).

        A paragraph over :data:`MAX_PARAGRAPH_BYTES` is tokenized in pieces (no separator
        between them); consecutive whole paragraphs are tokenized in one call (encode() joins
        them with the separator and the tokenizer splits there again).
        """
        groups: list[tuple[bool, list[bytes]]] = []
        for part in parts:
            sep = self.state["sep_due"]
            while len(part) > MAX_PARAGRAPH_BYTES:
                cut = _cut(part, self.byte_level)
                groups.append((sep, [part[:cut]]))
                part, sep = part[cut:], False
            if sep and groups:
                groups[-1][1].append(part)
            else:
                groups.append((sep, [part]))
            self.state["sep_due"] = True
        self._emit(groups)

    def next_document(self) -> None:
        """Another document follows: settle the previous one's last paragraph (``pending``).

        The stream is the documents joined by a blank line, split at blank lines. A last
        paragraph ``X + "\n"`` followed by ``"\n\n" + D`` splits as ``X`` and ``"\n" + D``:
        its newline moves to the next document (``state["prefix"]``), as in the launcher's
        split of files joined by ``"\n\n"``.
        """
        if self.pending is None:
            return
        last, self.pending = self.pending, None
        if last.endswith(b"\n"):
            self.paragraphs([last[:-1]])
            self.state["prefix"] = True
        else:
            self.paragraphs([last])
            self.state["prefix"] = False

    def end(self) -> None:
        """The stream ends: its last paragraph as it is."""
        if self.pending is not None:
            self.paragraphs([self.pending])
            self.pending = None

    def unfinished(self, carry: bytes) -> bytes:
        """Tokenize the start of a paragraph that is longer than :data:`MAX_PARAGRAPH_BYTES`
        whatever follows (the carry has no separator and more than MAX + 1 bytes: its last byte
        may start one); returns the rest."""
        while len(carry) > MAX_PARAGRAPH_BYTES + 1:
            cut = _cut(carry, self.byte_level)
            self._emit([(self.state["sep_due"], [carry[:cut]])])
            self.state["sep_due"] = False  # the paragraph goes on: no separator before its next piece
            carry = carry[cut:]
        return carry

    def checkpoint(self, input_index: int, pos: tuple[int, int]) -> None:
        """Record that the tokens so far cover the inputs before ``(input_index, pos)``."""
        assert self.pending is None
        with writing(self.output.tokens_path):
            self.tokens_file.flush()
            os.fsync(self.tokens_file.fileno())  # the tokens are on disk before the state that counts them
        self.state.update(input=input_index, pos=list(pos))
        self.output.write_state(self.state)
        if self.task is not None:
            inputs = self.job.inputs
            at = pos[0] if input_index < len(inputs) and inputs[input_index]["format"] != "parquet" else 0
            self.bar.update(self.task, completed=sum(i["size"] for i in inputs[:input_index]) + at)


def _tokenize(job: PrepareJob, enc: _Encoder, state: dict[str, Any], tokens_file, output: PartialOutput,
              progress: bool) -> None:
    """Append the tokens of every input from ``state``'s position, recording progress as it goes."""
    total = sum(i["size"] for i in job.inputs)
    with _progress_bar(total, progress and sys.stderr.isatty()) as bar:
        task = None
        if bar is not None:
            task = bar.add_task("tokenizing", total=total,
                                completed=sum(i["size"] for i in job.inputs[: state["input"]]) + state["pos"][0])
        writer = _Writer(job, enc, state, tokens_file, output, bar, task)
        while state["input"] < len(job.inputs):
            index = state["input"]
            spec = job.inputs[index]
            pos = (state["pos"][0], state["pos"][1])
            if spec["format"] == "text":
                _tokenize_text(spec["path"], pos[0], writer, index)
            else:
                read = 0
                for doc, after in _records(job, spec, pos):
                    writer.next_document()
                    if read >= CHUNK_BYTES:  # the tokens cover everything before this document
                        writer.checkpoint(index, pos)
                        read = 0
                    parts = ((b"\n" if state["prefix"] else b"") + doc).split(_SEP)
                    state["prefix"] = False
                    writer.pending = parts.pop()
                    writer.paragraphs(parts)
                    read += len(doc) + 1
                    pos = after
            state.update(input=index + 1, pos=[0, 0])
        writer.end()
        writer.checkpoint(len(job.inputs), (0, 0))


def _tokenize_text(path: str, offset: int, writer: _Writer, index: int) -> None:
    """A text file as one document: complete paragraphs are tokenized as the input streams in.

    The recorded position is where the unfinished paragraph (the carry) starts: a resumed
    run reads it again from there (with the newline moved in from the previous document,
    ``state["prefix"]``, while the carry still starts with it).
    """
    writer.next_document()
    state = writer.state
    prefix = b"\n" if state["prefix"] else b""
    if offset == 0:
        writer.checkpoint(index, (0, 0))
    carry = prefix if offset == 0 else b""
    for chunk, after in _text_chunks(path, offset):
        # split() finds separators left to right and the carry starts right after one (or
        # after a cut), so splitting carry + chunk finds the ones a split of the whole
        # stream finds, however the file was read.
        parts = (carry + chunk).split(_SEP)
        carry = parts.pop()
        if parts:
            writer.paragraphs(parts)
        carry = writer.unfinished(carry)
        start = after - len(carry)  # file offset of the carry; -1: it starts with the moved newline
        state["prefix"] = start < 0
        writer.checkpoint(index, (max(start, 0), 0))
    writer.pending = carry
    state["prefix"] = False


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tp_fuse.launch.prepare_data",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Example:\n  python -m tp_fuse.launch.prepare_data a.txt b.jsonl --out "
                                            "data/mine\n  python launch/train.py +model=gpt data=bin "
                                            "data.paths=[data/mine/train.bin,data/mine/val.bin]")
    parser.add_argument("inputs", nargs="+", help="text, JSONL (.jsonl/.ndjson/.json) or Parquet (.parquet) files")
    parser.add_argument("--out", required=True, help="output directory (train.bin, val.bin, meta.json)")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="input format (auto: by file extension, text otherwise)")
    parser.add_argument("--field", default="text", help="the JSONL field / Parquet column holding the text")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte | bpe | auto | path/to/tokenizer.json | a model directory (data.tokenizer)")
    parser.add_argument("--vocab-size", type=int, default=None, help="model.vocab_size (for bpe and auto)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="last fraction of tokens for val.bin")
    parser.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"),
                        help="token dtype (data.bin_dtype; auto: uint16 when the vocabulary fits)")
    parser.add_argument("--restart", action="store_true",
                        help="discard a partial or finished output in --out and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: errors are one line on stderr and exit status 1 (2 for bad usage)."""
    args = _parse_args(argv)
    try:
        job = PrepareJob(args.inputs, args.out, fmt=args.format, field=args.field, tokenizer=args.tokenizer,
                         vocab_size=args.vocab_size, val_fraction=args.val_fraction, dtype=args.dtype)
        prepare(job, restart=args.restart, progress=not args.no_progress)
    except ValueError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # one the steps above do not name more precisely (permission denied, ...)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"prepare_data: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prepare_data: interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
