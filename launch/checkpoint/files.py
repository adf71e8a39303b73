"""Checkpoint files: the names DCP writes, the manifest (untrusted JSON), file hashes, atomic
writes, and one-line causes for failed writes. Used by :mod:`tp_fuse.launch.checkpoint.manager`.

Nothing here imports ``torch.distributed.checkpoint``: what needs DCP's classes (its
exceptions, ``.metadata``) is in :mod:`tp_fuse.launch.checkpoint.dcp_io`."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import stat
from typing import Any, Optional

import re

from tp_fuse.safe_files import describe_kind, open_regular_file, read_regular_file
from tp_fuse.safe_files import write_atomic as _write_atomic

from .errors import CheckpointError
from .run_identity import MANIFEST, MANIFEST_LIMIT

__all__ = [
    "DATA_FILE",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "describe_os_error",
    "file_size_limit",
    "file_table",
    "read_manifest",
    "verify_files",
    "write_atomic",
]

FORMAT_VERSION = 1
METADATA_FILE = ".metadata"
#: The data files DCP's FileSystemWriter writes: ``__<rank>_<index>.distcp``.
# Matched with fullmatch: `$` also matches before a trailing newline, so "__0_0.distcp\n"
# passed; [0-9], not \d, which also matches non-ASCII digits.
DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")


def sha256(path: str) -> str:
    """SHA-256 of the regular file ``path`` (a link or special file: CheckpointError)."""
    h = hashlib.sha256()
    with open_regular_file(path, "checkpoint file", error=CheckpointError) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_table(directory: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and name != MANIFEST:
            out[name] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    return out


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` through an exclusively created temporary file
    (never a fixed ``<path>.tmp``, which a planted symbolic link could redirect)."""
    _write_atomic(path, text)


def describe_os_error(exc: OSError, directory: str) -> str:
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device of {directory}"
    if exc.errno == errno.EFBIG:
        return f"a file in {directory} reached this process's file-size limit ({_file_size_limit_text()})"
    return f"{exc.strerror or exc} ({exc.filename or directory})"


def file_size_limit() -> Optional[int]:
    """The process's ``RLIMIT_FSIZE`` soft limit in bytes (``ulimit -f``), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _file_size_limit_text() -> str:
    limit = file_size_limit()
    return "ulimit -f: unlimited" if limit is None else f"ulimit -f: {limit} bytes"


_MANIFEST_FIELDS: dict[str, Any] = {
    "step": int, "world_size": int, "tp": int, "dp": int, "consumed_samples": int, "model": dict, "files": dict,
}


def _check_manifest_fields(mpath: str, manifest: dict[str, Any]) -> None:
    """A manifest is untrusted JSON: check the fields loading relies on (types, file names)."""
    for key, tp in _MANIFEST_FIELDS.items():
        value = manifest.get(key)
        if not isinstance(value, tp) or isinstance(value, bool):
            raise CheckpointError(f"{mpath}: field {key!r} is {value!r}, expected a {tp.__name__}")
    for name, info in manifest["files"].items():
        if not (name == METADATA_FILE or DATA_FILE.fullmatch(name)):
            raise CheckpointError(f"{mpath}: files lists {name!r}, expected .metadata or __<rank>_<n>.distcp")
        ok = isinstance(info, dict) and all(
            isinstance(info.get(k), t) and not isinstance(info.get(k), bool) for k, t in (("size", int), ("sha256", str))
        )
        if not ok:
            raise CheckpointError(f"{mpath}: files[{name!r}] is {info!r}, expected {{size: int, sha256: str}}")
    if manifest.get("fp8_recipe") is not None and not isinstance(manifest["fp8_recipe"], str):
        raise CheckpointError(f"{mpath}: field 'fp8_recipe' is {manifest['fp8_recipe']!r}, expected a string or null")
    hist = manifest.get("amax_history_len")
    if hist is not None and (not isinstance(hist, int) or isinstance(hist, bool) or hist < 1):
        raise CheckpointError(f"{mpath}: field 'amax_history_len' is {hist!r}, expected an int >= 1 or null")
    for key in ("step", "consumed_samples", "world_size", "tp", "dp"):
        if manifest[key] < (0 if key in ("step", "consumed_samples") else 1):
            raise CheckpointError(f"{mpath}: field {key!r} is {manifest[key]!r}, out of range")


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, checked field by field (it is untrusted JSON)."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not os.path.lexists(mpath):
        raise CheckpointError(
            f"checkpoint {path} is incomplete or not a tp-fuse checkpoint (no {MANIFEST}); "
            "it may be a save that crashed"
        )
    try:
        manifest = json.loads(read_regular_file(mpath, MANIFEST_LIMIT, "checkpoint manifest", error=CheckpointError))
    except CheckpointError:
        raise
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {type(exc).__name__}: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    _check_manifest_fields(mpath, manifest)
    return manifest

def verify_files(path: str, manifest: dict[str, Any], *, verify_hashes: bool) -> Optional[str]:
    """What is wrong with the files the manifest of the checkpoint at ``path`` lists (None:
    nothing); that ``.metadata`` names no other file is :func:`dcp_io.unlisted_file`'s check."""
    files = manifest["files"]
    for name, info in files.items():
        fpath = os.path.join(path, name)
        try:
            st = os.lstat(fpath)
        except FileNotFoundError:
            return f"file {name} is missing"
        # lstat: a data file that is a symbolic link (to a file outside the checkpoint, or to
        # /dev/zero) or a FIFO is refused here, before DCP or the hash opens it.
        if not stat.S_ISREG(st.st_mode):
            return f"file {name} is {describe_kind(st.st_mode)}, not a regular file (tp-fuse writes none)"
        size = st.st_size
        if size != info["size"]:
            return f"file {name} has {size} bytes, the manifest says {info['size']}"
        if verify_hashes and sha256(fpath) != info["sha256"]:
            return f"file {name} does not match its SHA-256 in the manifest (corrupt)"
    return None

