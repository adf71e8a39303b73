"""``prepare_data``'s inputs, read in bounded pieces: text files, JSONL lines, Parquet rows.

Each reader starts at a recorded position (so that an interrupted run resumes where it
stopped) and yields its pieces with the position after each. A JSONL line over
:data:`MAX_LINE_BYTES` is refused (a damaged or crafted file); a failed read names the
input. Used by :mod:`tp_fuse.launch.prepare_data` (the corpus a BPE is trained on) and
:mod:`tp_fuse.launch.prepare_tokens` (the token stream).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from tp_fuse.safe_files import open_regular_file

__all__ = ["CHUNK_BYTES", "FORMATS", "SEP", "documents", "format_of", "pyarrow_parquet", "text_chunks"]

#: Input read per step (and progress recorded after each): small enough to lose little on
#: an interruption, large enough that the fsync per step costs nothing.
CHUNK_BYTES = 4 << 20
#: Longest JSONL line; a longer one is refused (a damaged or crafted file).
MAX_LINE_BYTES = 64 << 20
PARQUET_BATCH_ROWS = 1024
FORMATS = ("text", "jsonl", "parquet")
#: What joins documents, and what splits the stream into paragraphs: a blank line.
SEP = b"\n\n"


def format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(f"reading Parquet files needs pyarrow ({exc}): pip install pyarrow") from None
    return pq


@contextlib.contextmanager
def _reading(path: str) -> Iterator[None]:
    """A failed read of an input (``/proc/self/mem``: EIO; a disk error) as one line naming it."""
    try:
        yield
    except OSError as exc:
        raise ValueError(f"input {path}: cannot read it: {exc.strerror or exc}") from None


def text_chunks(path: str, offset: int) -> Iterator[tuple[bytes, int]]:
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
    pq = pyarrow_parquet()
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


def documents(spec: dict[str, Any], field: str, pos: tuple[int, int]) -> Iterator[tuple[bytes, tuple[int, int]]]:
    """``(document, position after it)`` of a JSONL or Parquet input from ``pos``."""
    if spec["format"] == "jsonl":
        return _jsonl_documents(spec["path"], field, pos)
    return _parquet_documents(spec["path"], field, pos)
