"""Reading DCP checkpoints without running code from them.

A checkpoint directory is untrusted input: it may come from another machine, another
user or an attacker. DCP itself has two places where loading one can execute code:

* ``.metadata`` is a pickle, which DCP reads with a plain ``pickle.load``. Here it is
  read by :class:`_MetadataUnpickler`, which resolves exactly the (module, name) pairs in
  :data:`ALLOWED_GLOBALS` -- DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts,
  paths -- and nothing else. Pairs are matched exactly, so protocol 4's dotted names
  (``module="torch.distributed.checkpoint.metadata", name="os.system"``) do not reach
  other objects through an allowed module.
* An entry of kind ``BytesStorageMetadata`` makes ``DefaultLoadPlanner.load_bytes`` call
  ``torch.load(weights_only=False)`` on bytes from a ``.distcp`` file. tp-fuse stores only
  tensors, so :func:`validate_metadata` refuses every entry that is not a tensor, and
  :class:`SafeLoadPlanner` refuses to load bytes should one get through anyway.

Tensors themselves are read by DCP with ``torch.load(weights_only=True)``.
Every refusal is a :class:`CheckpointError` naming the file and what was wrong.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import re
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from tp_fuse.safe_files import open_regular_file, read_regular_file

__all__ = [
    "ALLOWED_GLOBALS",
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_metadata",
    "validate_metadata",
]

METADATA_FILE = ".metadata"
#: A few hundred bytes per tensor entry: even a 100B-parameter model stays far below this.
MAX_METADATA_BYTES = 256 << 20
#: The data files DCP's FileSystemWriter writes: ``__<rank>_<index>.distcp``.
# Matched with fullmatch: `$` also matches before a trailing newline, so "__0_0.distcp\n"
# passed; [0-9], not \d, which also matches non-ASCII digits.
DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or incompatible with the config."""


def _layout_by_name(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a ``torch.<name>`` layout, nothing else."""
    # torch pickles a layout as its repr, "torch.strided".
    attr = name[len("torch."):] if isinstance(name, str) and name.startswith("torch.") else None
    value = getattr(torch, attr, None) if attr is not None and attr.isidentifier() else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"checkpoint metadata names layout {name!r}, which is not a torch layout")
    return value


def _allowed_globals() -> dict[tuple[str, str], Any]:
    md, fs = dcp_metadata, dcp_filesystem
    allowed: dict[tuple[str, str], Any] = {
        (md.__name__, cls.__name__): cls
        for cls in (md.Metadata, md.MetadataIndex, md.StorageMeta, md.TensorProperties,
                    md.TensorStorageMetadata, md.ChunkStorageMetadata, md._MEM_FORMAT_ENCODING)
    }
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout_by_name
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    # DCP records the path it saved to; pathlib's module name differs across Pythons.
    for module in ("pathlib", "pathlib._local"):
        for cls in (pathlib.Path, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
                    pathlib.PureWindowsPath):
            allowed[(module, cls.__name__)] = cls
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


#: (module, qualified name) -> the object a ``.metadata`` pickle may refer to.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed_globals()


class _MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the pure-Python unpickler, on purpose
    """Resolves exactly the pairs in :data:`ALLOWED_GLOBALS` (no module-wide or dotted lookups).

    Built on pickle's pure-Python unpickler: the C one allocates the length a BINBYTES8 /
    BINUNICODE8 opcode *declares* before reading, so 20 crafted bytes could ask for
    16 GiB (found by the fuzz test: the kernel's OOM killer ended the test run). The
    Python one reads what is there and fails on the truncated stream.
    """

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            ) from None


def _fail(path: str, what: str) -> None:
    raise CheckpointError(f"{path}: {what}; refusing to load it (tp-fuse never writes this: damaged or crafted?)")


def _check_size(path: str, where: str, value: Any) -> None:
    if not isinstance(value, torch.Size) or any(not isinstance(v, int) or v < 0 for v in value):
        _fail(path, f"{where} is {value!r}, expected a torch.Size of non-negative ints")


def validate_metadata(metadata: Any, path: str) -> dcp_metadata.Metadata:
    """Check that unpickled DCP metadata has exactly the shape tp-fuse writes.

    Only tensor entries (``TensorStorageMetadata``), data files named
    ``__<rank>_<index>.distcp`` inside the checkpoint directory, non-negative offsets and
    lengths, no storage transforms. Raises :class:`CheckpointError` naming ``path``.
    """
    if not isinstance(metadata, dcp_metadata.Metadata):
        _fail(path, f"holds a {type(metadata).__name__}, expected DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        _fail(path, f"state_dict_metadata is a {type(entries).__name__}, expected a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            _fail(path, f"state key {key!r} is not a string")
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            _fail(path, f"entry {key!r} is a {type(entry).__name__}, expected TensorStorageMetadata (tensors only)")
        if not isinstance(entry.properties, dcp_metadata.TensorProperties) or not isinstance(
            entry.properties.dtype, torch.dtype
        ):
            _fail(path, f"entry {key!r} has properties {entry.properties!r}, expected TensorProperties with a dtype")
        _check_size(path, f"entry {key!r} size", entry.size)
        if not isinstance(entry.chunks, list):
            _fail(path, f"entry {key!r} chunks is a {type(entry.chunks).__name__}, expected a list")
        for chunk in entry.chunks:
            if not isinstance(chunk, dcp_metadata.ChunkStorageMetadata):
                _fail(path, f"entry {key!r} has a chunk of type {type(chunk).__name__}")
            _check_size(path, f"entry {key!r} chunk offsets", chunk.offsets)
            _check_size(path, f"entry {key!r} chunk sizes", chunk.sizes)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        _fail(path, f"storage_data is a {type(storage).__name__}, expected a dict")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or index.fqn not in entries:
            _fail(path, f"storage_data key {index!r} names no tensor entry")
        if not isinstance(info, dcp_filesystem._StorageInfo):
            _fail(path, f"storage of {index.fqn!r} is a {type(info).__name__}, expected _StorageInfo")
        rel = info.relative_path
        if not isinstance(rel, str) or not DATA_FILE.fullmatch(rel):
            _fail(path, f"storage of {index.fqn!r} points at {rel!r}, expected a __<rank>_<n>.distcp file")
        for field in ("offset", "length"):
            value = getattr(info, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(path, f"storage of {index.fqn!r} has {field} {value!r}, expected an int >= 0")
        if getattr(info, "transform_descriptors", None):
            _fail(path, f"storage of {index.fqn!r} has transforms {info.transform_descriptors!r}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, dcp_metadata.StorageMeta):
        _fail(path, f"storage_meta is a {type(metadata.storage_meta).__name__}")
    return metadata


def read_metadata(checkpoint_dir: str) -> dcp_metadata.Metadata:
    """Unpickle (restricted) and validate ``<checkpoint_dir>/.metadata``."""
    path = os.path.join(str(checkpoint_dir), METADATA_FILE)
    try:
        # Not getsize + read: getsize is 0 for /dev/zero, and open() waits forever on a FIFO.
        raw = read_regular_file(path, MAX_METADATA_BYTES, "DCP metadata file", error=CheckpointError)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: {exc}; refusing to load it (damaged or crafted?)") from exc
    except Exception as exc:  # truncated or malformed pickle streams raise many types
        raise CheckpointError(f"{path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from exc
    return validate_metadata(metadata, path)


class _NoFollowFileSystem(dcp_filesystem.FileSystem):
    """DCP's local file system, whose reads open only regular ``__<rank>_<n>.distcp`` files
    and never follow a symbolic link.

    The manifest check (``verify_files``) lstat's the data files, but on rank 0 only and
    before DCP opens them: the other ranks, or a link swapped in after the check, would
    still make ``Path.open`` read a file outside the checkpoint. ``O_NOFOLLOW`` on the open
    itself leaves no such gap, on every rank.
    """

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":  # the reader only reads; keep DCP's behaviour for anything else
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))
        if not DATA_FILE.fullmatch(name):
            raise CheckpointError(f"{path}: DCP asked to read {name!r}, expected a __<rank>_<n>.distcp file")
        with open_regular_file(path, "checkpoint data file", error=CheckpointError) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by :func:`read_metadata` and whose
    data files are opened without following links (:class:`_NoFollowFileSystem`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.path = self.fs.init_path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(str(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses non-tensor entries instead of unpickling them.

    DCP's default ``load_bytes`` calls ``torch.load(weights_only=False)``; tp-fuse never
    stores bytes, so any request to load some comes from a crafted checkpoint.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is stored as pickled bytes; tp-fuse stores only "
            "tensors and never unpickles checkpoint data (damaged or crafted checkpoint?)"
        )
