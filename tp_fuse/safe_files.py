"""Files in directories that other people and jobs can write to (checkpoint and run dirs).

A checkpoint or run directory is untrusted: anyone who can write to it can plant a
symbolic link, a FIFO or a device under a name tp-fuse reads or writes. Three rules,
each one function here, used by every reader and writer of those directories:

* :func:`read_regular_file` -- open without following a symbolic link (``O_NOFOLLOW``;
  ``run.json -> /dev/zero`` would otherwise exhaust memory), without blocking
  (``O_NONBLOCK``: opening a FIFO for reading waits for a writer forever), check with
  ``fstat`` *after* opening that it is a regular file (no FIFO, device or directory; a
  check before opening could be raced), and read at most ``limit`` bytes
  (``os.path.getsize`` is 0 for ``/dev/zero``, so a size check before reading is no
  limit). :func:`open_regular_file` is the same open for callers that stream.
* :func:`atomic_writer` / :func:`write_atomic` -- a new file's bytes go to a temporary
  file created *exclusively* in the same directory (``O_CREAT | O_EXCL | O_NOFOLLOW``,
  a random name) and renamed over the target. A fixed temporary name (``run.json.tmp``)
  planted as a symbolic link would make ``open(tmp, "w")`` overwrite its target outside
  the directory; an exclusive create fails on anything already there instead.
* :func:`open_append` -- append to a log (``metrics.jsonl``, ``train.log``) without
  following a planted symbolic link and only if it is a regular file.

Errors are raised as ``error`` (a caller's ``ValueError`` subclass such as
``CheckpointError``) naming the file and what it is; a missing file is the usual
``FileNotFoundError`` (callers decide whether that is an error).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Union

__all__ = ["atomic_writer", "describe_kind", "open_append", "open_regular_file", "read_regular_file", "write_atomic"]

# How many random temporary names to try before giving up (a collision needs 2**-64 luck
# or a directory that is being filled with guesses).
_TEMP_ATTEMPTS = 16


def describe_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``, ... for an ``st_mode`` (the messages name it)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _check_regular(fd: int, path: str, what: str, error: type[Exception]) -> None:
    """Close ``fd`` and raise unless it is a regular file (checked on the open file)."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{what} {path} is {describe_kind(mode)}, not a regular file; refusing to use it")


def _open_checked(path: str, flags: int, what: str, error: type[Exception], *, follow_symlinks: bool,
                  mode: int = 0o666) -> int:
    """``os.open`` + regular-file check; a symbolic link (when not followed) is ``error``."""
    flags |= os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise error(f"{what} {path} is a symbolic link; refusing to follow it (tp-fuse never writes one "
                        "there: planted?)") from None
        if exc.errno == errno.EISDIR:
            raise error(f"{what} {path} is a directory, not a regular file; refusing to use it") from None
        if exc.errno == errno.ENXIO:  # O_NONBLOCK|O_WRONLY on a FIFO without a reader
            raise error(f"{what} {path} is a FIFO, not a regular file; refusing to use it") from None
        raise
    _check_regular(fd, path, what, error)
    # O_NONBLOCK only kept the open itself from waiting; regular files ignore it, but
    # clear it so nothing downstream sees a non-blocking descriptor.
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def open_regular_file(path: Union[str, os.PathLike], what: str, *, error: type[Exception] = ValueError,
                      follow_symlinks: bool = False) -> IO[bytes]:
    """``path`` opened for binary reading, checked to be a regular file (see module docstring).

    Args:
        path: the file.
        what: how messages name it (``"checkpoint manifest"``).
        error: the exception class raised for a symbolic link or a special file.
        follow_symlinks: True where a link is not the attack (the file must still be regular).
    """
    path = os.fspath(path)
    return os.fdopen(_open_checked(path, os.O_RDONLY, what, error, follow_symlinks=follow_symlinks), "rb")


def read_regular_file(path: Union[str, os.PathLike], limit: int, what: str, *,
                      error: type[Exception] = ValueError, follow_symlinks: bool = False) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``; more is ``error``.

    Never blocks on a FIFO, never follows a planted symbolic link (unless
    ``follow_symlinks``), never reads a device: each is ``error`` naming ``path``.
    """
    path = os.fspath(path)
    with open_regular_file(path, what, error=error, follow_symlinks=follow_symlinks) as f:
        # A regular file's size is known (unlike a device's): a 20 GiB sparse file is
        # refused without reading limit bytes of it. read(limit + 1) still bounds a file
        # that grows after this check.
        too_large = os.fstat(f.fileno()).st_size > limit
        data = b"" if too_large else f.read(limit + 1)
    if too_large or len(data) > limit:
        raise error(f"{what} {path} is larger than {limit} bytes, more than such a file can hold; "
                    "refusing to read it (damaged or crafted?)")
    return data


def _create_exclusive(directory: str, prefix: str) -> tuple[int, str]:
    """A new empty file ``<directory>/<prefix><random>.tmp``, created with O_EXCL|O_NOFOLLOW."""
    for _ in range(_TEMP_ATTEMPTS):
        tmp = os.path.join(directory, f"{prefix}{secrets.token_hex(8)}.tmp")
        try:
            # Mode 0o666 minus the umask, like open(path, "w"): others keep the access
            # they had to the file this one replaces (mkstemp would make it 0600).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return fd, tmp
    raise FileExistsError(errno.EEXIST, f"no free temporary name after {_TEMP_ATTEMPTS} tries", directory)


@contextlib.contextmanager
def atomic_writer(path: Union[str, os.PathLike], *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """A binary file whose content replaces ``path`` atomically when the block ends without error.

    The temporary file is created exclusively in ``path``'s directory (``.<name>.<random>.tmp``)
    and renamed over ``path`` (a rename replaces a planted symbolic link itself, never its
    target); on an error it is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = _create_exclusive(directory, f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Union[str, os.PathLike], data: Union[str, bytes], *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` (str: UTF-8) atomically, through an exclusive temporary file."""
    with atomic_writer(path, fsync=fsync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def open_append(path: Union[str, os.PathLike], what: str, *, error: type[Exception] = ValueError) -> IO[str]:
    """``path`` opened for appending text (line-buffered, UTF-8), created if missing.

    A symbolic link at ``path`` is not followed and a special file is refused (``error``),
    so a planted ``metrics.jsonl -> ~/.bashrc`` is never written through.
    """
    path = os.fspath(path)
    fd = _open_checked(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what, error, follow_symlinks=False)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")
