"""Reading DCP checkpoints without running code from them.

A checkpoint directory is untrusted input: it may come from another machine, another
user or an attacker. DCP itself has two places where loading one can execute code:

* ``.metadata`` is a pickle, which DCP reads with a plain ``pickle.load``. Here it is
  read by :class:`~tp_fuse.launch.checkpoint.metadata_pickle.MetadataUnpickler`, which
  resolves exactly the (module, name) pairs in :data:`ALLOWED_GLOBALS` -- DCP's metadata
  dataclasses, ``torch.Size``, dtypes, layouts, paths -- and nothing else (pairs are
  matched exactly, so protocol 4's dotted names such as ``module="torch.distributed.
  checkpoint.metadata", name="os.system"`` do not reach other objects through an allowed
  module), and lets pickle's ``BUILD``/``APPEND``/``SETITEM`` opcodes fill only objects
  the pickle itself made (a ``BUILD`` on an allowed *class* would ``setattr`` on it).
* An entry of kind ``BytesStorageMetadata`` makes ``DefaultLoadPlanner.load_bytes`` call
  ``torch.load(weights_only=False)`` on bytes from a ``.distcp`` file. tp-fuse stores only
  tensors, so :func:`validate_metadata` refuses every entry that is not a tensor, and
  :class:`SafeLoadPlanner` refuses to load bytes should one get through anyway.

Tensors themselves are read by DCP with ``torch.load(weights_only=True)``.
Every refusal is a :class:`CheckpointError` naming the file and what was wrong.
"""

from __future__ import annotations

import io
import os
import pickle
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

from .chunk_tiling import tiling_problem
from .data_slices import SliceView, slice_limit, slice_problem
from .errors import CheckpointError
from .files import DATA_FILE, METADATA_FILE
from .metadata_pickle import ALLOWED_GLOBALS, MetadataUnpickler, layout_by_name

__all__ = [
    "ALLOWED_GLOBALS",
    "CheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_metadata",
    "validate_metadata",
]

#: A few hundred bytes per tensor entry: even a 100B-parameter model stays far below this.
MAX_METADATA_BYTES = 256 << 20


# The restricted unpickler lives in its own module; these names are part of this one's API.
_MetadataUnpickler = MetadataUnpickler
_layout_by_name = layout_by_name


def _fail(path: str, what: str) -> None:
    raise CheckpointError(f"{path}: {what}; refusing to load it (tp-fuse never writes this: damaged or crafted?)")


def _check_size(path: str, where: str, value: Any) -> None:
    if not isinstance(value, torch.Size) or any(not isinstance(v, int) or v < 0 for v in value):
        _fail(path, f"{where} is {value!r}, expected a torch.Size of non-negative ints")


def validate_metadata(metadata: Any, path: str) -> dcp_metadata.Metadata:
    """Check that unpickled DCP metadata has exactly the shape tp-fuse writes.

    Only tensor entries (``TensorStorageMetadata``), data files named
    ``__<rank>_<index>.distcp`` inside the checkpoint directory, non-negative offsets and
    lengths, no storage transforms; the chunks of every tensor tile it exactly (no gap,
    no overlap, inside bounds: :mod:`~tp_fuse.launch.checkpoint.chunk_tiling`), every
    chunk has its storage, and no storage is longer than its chunk's data allows
    (:func:`~tp_fuse.launch.checkpoint.data_slices.slice_limit`). Raises
    :class:`CheckpointError` naming ``path``.
    """
    if not isinstance(metadata, dcp_metadata.Metadata):
        _fail(path, f"holds a {type(metadata).__name__}, expected DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        _fail(path, f"state_dict_metadata is a {type(entries).__name__}, expected a dict")
    chunks: dict[tuple[str, tuple[int, ...]], tuple[Any, torch.dtype]] = {}  # (tensor, offsets) -> chunk, dtype
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
            chunks[(key, tuple(chunk.offsets))] = (chunk, entry.properties.dtype)
        problem = tiling_problem(entry.size, [(c.offsets, c.sizes) for c in entry.chunks])
        if problem is not None:
            _fail(path, f"the chunks of tensor {key!r} (size {list(entry.size)}) do not cover it exactly: {problem}")
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
        offsets = tuple(index.offset) if isinstance(index.offset, torch.Size) else None
        chunk, dtype = chunks.pop((index.fqn, offsets), (None, None))  # each chunk has one storage
        if chunk is None:
            _fail(path, f"storage_data key {index!r} names no chunk of tensor {index.fqn!r} (or one named before)")
        limit = slice_limit(chunk.sizes, dtype)
        if info.length > limit:
            _fail(path, f"storage of {index.fqn!r} at offsets {list(chunk.offsets)} is {info.length} bytes long, more "
                        f"than the {limit} its chunk of {list(chunk.sizes)} {dtype} can take")
    # DCP would stop at a KeyError for one, after loading the tensors before it. (An empty
    # chunk has nothing to read: DCP never asks for its storage.)
    unstored = [(key, offsets) for (key, offsets), (chunk, _) in chunks.items() if 0 not in chunk.sizes]
    if unstored:
        key, offsets = unstored[0]
        _fail(path, f"chunk {list(offsets)} of tensor {key!r} has no storage_data entry")
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
    """``FileSystemReader`` whose ``.metadata`` is read by :func:`read_metadata`, whose
    data files are opened without following links (:class:`_NoFollowFileSystem`), and
    whose every slice is checked before ``torch.load`` reads it: no more bytes than its
    chunk's shape and dtype allow, stored uncompressed (:mod:`~tp_fuse.launch.checkpoint.data_slices`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.path = self.fs.init_path(path)
        # id(storage info) -> (tensor, the most bytes its slice may hold); set per load.
        self._limits: dict[int, tuple[str, int]] = {}

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # Every rank, from the metadata it was given (rank 0 validated it): the limits the
        # slices are read with. Keyed by the storage records themselves, which _slice_file gets.
        limits = {(fqn, tuple(c.offsets)): slice_limit(c.sizes, entry.properties.dtype)
                  for fqn, entry in metadata.state_dict_metadata.items() for c in entry.chunks}
        self._limits = {id(info): (index.fqn, limits[(index.fqn, tuple(index.offset))])
                        for index, info in metadata.storage_data.items()}

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        fqn, limit = self._limits[id(sinfo)]
        where = f"{self.path}/{sinfo.relative_path} at offset {sinfo.offset}"
        if sinfo.length > limit:
            raise CheckpointError(f"{where}: the slice of tensor {fqn!r} is {sinfo.length} bytes, more than the "
                                  f"{limit} its chunk can take; refusing to read it (damaged or crafted?)")
        view = SliceView(file, sinfo.offset, sinfo.length)  # not DCP's view: see SliceView
        problem = slice_problem(view, limit)
        if problem is not None:
            raise CheckpointError(f"{where}: the slice of tensor {fqn!r}: {problem}; refusing to load it "
                                  "(damaged or crafted?)")
        return view

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
