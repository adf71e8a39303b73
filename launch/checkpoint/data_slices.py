"""Bounded reads of checkpoint data files: a slice may hold no more than its chunk declares.

Each tensor chunk of a DCP checkpoint is one ``torch.save`` archive (a zip file) at an
offset of a ``__<rank>_<n>.distcp`` file; DCP's reader hands that slice to ``torch.load``,
which allocates every record at the size the zip's central directory *declares* and
inflates compressed records into it. ``torch.save`` never compresses, but a crafted file
can: issue 40 made a 3.2 MB checkpoint inflate 2 GiB on the loading rank before anything
refused it. The limits here come from the metadata, which says what each chunk holds
(its shape and dtype: ``chunk bytes``):

* :func:`slice_limit`: a slice may be at most ``chunk bytes + SLICE_OVERHEAD`` long (the
  archive's own records -- pickle, version, byte order, alignment padding -- take about
  1.6 kB; the margin is generous). Checked on the metadata before any data is read.
* :func:`slice_problem`: before ``torch.load`` reads a slice, its records as torch's own
  zip reader sees them must be stored uncompressed and add up to no more than that
  limit; torch then allocates no more than the limit whatever the archive claims.

Python's ``zipfile`` checks the compression method (torch's reader does not expose it)
and must agree with torch's reader on every record's name and size: two readers that see
different central directories (a crafted archive with two) are refused.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Sequence
from typing import IO, Any, Optional

import torch

__all__ = ["SLICE_OVERHEAD", "SliceView", "chunk_nbytes", "slice_limit", "slice_problem"]

#: Bytes a slice may hold beyond its chunk's tensor data (``torch.save``'s own records).
SLICE_OVERHEAD = 64 << 10


class SliceView(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a seekable binary file, as a file of its own.

    DCP's own view (``torch.distributed.checkpoint.utils._ReaderView``) turns
    ``seek(-n, SEEK_END)`` into a seek *past* the end, which Python's ``zipfile`` needs to
    find the zip directory; torch.load only seeks to the end with offset 0, so it never
    noticed. Reads never go past ``length``.
    """

    def __init__(self, base: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._base, self._start, self._length = base, offset, length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        self._base.seek(self._start + self._pos)
        got = self._base.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def chunk_nbytes(sizes: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of tensor data in a chunk of shape ``sizes``."""
    return math.prod(sizes) * dtype.itemsize


def slice_limit(sizes: Sequence[int], dtype: torch.dtype) -> int:
    """The most bytes the ``torch.save`` archive of such a chunk may take (or declare)."""
    return chunk_nbytes(sizes, dtype) + SLICE_OVERHEAD


def slice_problem(stream: IO[bytes], limit: int) -> Optional[str]:
    """What makes the archive in ``stream`` (seekable, at its start) unsafe to ``torch.load``
    with at most ``limit`` bytes, or None. Reads only its zip directory; leaves the stream
    at its start."""
    try:
        torch_view = torch._C.PyTorchFileReader(stream)  # the reader torch.load will use
        declared = {name: torch_view.get_record_size(name) for name in torch_view.get_all_records()}
        stream.seek(0)
        with zipfile.ZipFile(stream) as archive:
            infos = archive.infolist()
    except (RuntimeError, zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        return f"not a readable torch.save archive ({type(exc).__name__}: {first_line})"
    finally:
        stream.seek(0)
    total = sum(declared.values())
    if total > limit:
        biggest = max(declared, key=declared.__getitem__)
        return (f"its records declare {total} bytes (record {biggest!r}: {declared[biggest]}), more than the "
                f"{limit} its chunk can hold")
    # Python's view: names without torch's "<archive>/" prefix, sizes, compression.
    python_view = {info.filename.split("/", 1)[-1]: info for info in infos}
    if set(python_view) != set(declared):
        return "its zip directory reads differently in two zip readers (a crafted archive?)"
    for name, info in python_view.items():
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != declared[name] \
                or info.compress_size != info.file_size:
            return (f"record {name!r} is compressed or misdeclared (method {info.compress_type}, "
                    f"{info.compress_size} -> {info.file_size} bytes; torch.save stores records uncompressed)")
    return None

