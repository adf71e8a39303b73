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
refused: :mod:`tp_fuse.launch.prepare_inputs` reads the inputs, :mod:`tp_fuse.launch.prepare_tokens`
writes the token stream).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import hashlib
import json
import os
import stat
import sys
from collections.abc import Callable
from typing import Any, Optional

# Before any other import: `python launch/prepare_data.py` puts launch/ on sys.path, where
# launch/logging/ would stand in for the standard library's logging; _tp_fuse_checkout takes
# it off and imports tp_fuse from this checkout (see its docstring).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_fuse_checkout import use_checkout  # noqa: E402

use_checkout()

from tp_fuse.launch.prepare_inputs import FORMATS, SEP, documents, format_of, pyarrow_parquet, text_chunks  # noqa: E402
from tp_fuse.launch.prepare_output import (OUTPUTS, PARTIAL, PartialOutput, lock_output_dir, open_tokens,  # noqa: E402
                                           read_meta, writing)
from tp_fuse.launch.prepare_tokens import Encoder, tokenize  # noqa: E402
from tp_fuse.launch.tokenizer import ByteTokenizer, FileTokenizer, Tok, build_tokenizer, resolve_kind  # noqa: E402
from tp_fuse.safe_files import atomic_writer, describe_kind, open_regular_file, write_atomic  # noqa: E402

__all__ = ["PrepareJob", "main", "prepare"]

#: ``--tokenizer bpe`` trains on the whole corpus in memory, as the launcher does.
MAX_BPE_CORPUS_BYTES = 2 << 30
_STATE_VERSION = 1
#: Bytes per token of each output dtype.
_ITEMSIZE = {"uint16": 2, "uint32": 4}


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
            self.inputs.append({"path": os.path.abspath(path), "format": format_of(path, fmt),
                                "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        if any(i["format"] == "parquet" for i in self.inputs):
            pyarrow_parquet()  # fail before any work when pyarrow is missing
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
            pieces = ((chunk for chunk, _ in text_chunks(spec["path"], 0)) if spec["format"] == "text"
                      else (doc for doc, _ in documents(spec, self.field, (0, 0))))
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
        data = SEP.join(parts)
        return data[: max(1, int(len(data) * (1.0 - self.val_fraction)))]

    def identity(self) -> dict[str, Any]:
        """What a partial or finished output must have been made with to be continued or kept."""
        assert self.tok is not None
        tok = {"kind": "byte"} if isinstance(self.tok, ByteTokenizer) else {
            "kind": "tokenizer.json", "path": self.tok.path, "sha256": _sha256_file(self.tok.path)}  # type: ignore[attr-defined]
        return {"version": _STATE_VERSION, "inputs": self.inputs, "field": self.field,
                "tokenizer": {**tok, "vocab_size": self.tok.vocab_size}, "dtype": self.dtype,
                "val_fraction": self.val_fraction}


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
    enc = Encoder(tok, job.dtype)
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
        tokenize(job.inputs, job.field, enc, state, tokens_file, output, progress)
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
