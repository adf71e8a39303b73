"""``prepare_data``'s output directory: its lock, its progress record and its meta record.

Everything in ``--out`` is untrusted on the next run: another job, a crash or a person may
have left anything there. So:

* :func:`lock_output_dir` -- one ``prepare_data`` per ``--out`` at a time: an exclusive
  ``flock`` on the ``--out`` directory itself (never deleted, so two runs cannot lock two
  different inodes), taken *before* any output is read, removed or written (``--restart``
  deleted the outputs first and lost a running job's ``train.bin``);
* :class:`PartialOutput` -- ``prepare.partial/`` (``tokens.bin``, ``state.json``): the
  state is checked field by field (:func:`check_state`: types, ranges) before a number of
  it is used as a file offset or a size;
* :func:`read_meta` -- ``meta.json`` of a finished output, checked the same way, and the
  ``train.bin``/``val.bin`` it describes must be there with the sizes it records (a run
  that lost ``train.bin`` is not "already prepared");
* :func:`writing` -- a failed write (full disk, ``ulimit -f``) is one line naming the file.

Every error is a ``ValueError`` naming the file and the field.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from typing import Any, Optional

from tp_fuse.safe_files import describe_kind, read_regular_file, write_atomic

__all__ = ["OUTPUTS", "PARTIAL", "PartialOutput", "check_state", "lock_output_dir", "open_tokens", "read_meta",
           "writing"]

PARTIAL = "prepare.partial"
OUTPUTS = ("train.bin", "val.bin", "meta.json")
#: state.json and meta.json are a few kB (the inputs listed once).
_RECORD_LIMIT = 1 << 20
#: Token counts and file offsets: anything a file system can hold (2**62 bytes is 4 EiB).
_MAX_COUNT = 1 << 62
_RESTART = "rerun with --restart to start over"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _count(value: Any, key: str, path: str, upper: int = _MAX_COUNT) -> int:
    if type(value) is not int or not 0 <= value <= upper:  # bool is an int: not a count
        raise ValueError(f"{path}: field {key!r} is {_short(value)}, expected an integer from 0 to {upper}; "
                         f"not a record prepare_data wrote (damaged or crafted?): {_RESTART}")
    return value


def _flag(value: Any, key: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path}: field {key!r} is {_short(value)}, expected true or false; not a record "
                         f"prepare_data wrote (damaged or crafted?): {_RESTART}")
    return value


def _read_record(path: str, what: str) -> dict[str, Any]:
    """A JSON object from ``path`` (bounded, regular file, no link followed)."""
    raw = read_regular_file(path, _RECORD_LIMIT, what)
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not JSON ({type(exc).__name__}); not a record prepare_data wrote: "
                         f"{_RESTART}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: a JSON {type(record).__name__}, expected an object; not a record prepare_data "
                         f"wrote: {_RESTART}")
    if not isinstance(record.get("identity" if what == "prepare_data state" else "inputs"), (dict, list)):
        raise ValueError(f"{path}: no {'identity' if what == 'prepare_data state' else 'inputs'} field; not a "
                         f"record prepare_data wrote: {_RESTART}")
    return record


def check_state(state: dict[str, Any], path: str, n_inputs: int) -> None:
    """The fields of a progress record that are used as offsets and counts are in range."""
    _count(state.get("input"), "input", path, n_inputs)
    pos = state.get("pos")
    if not (isinstance(pos, list) and len(pos) == 2):
        raise ValueError(f"{path}: field 'pos' is {_short(pos)}, expected [offset, line]; not a record "
                         f"prepare_data wrote (damaged or crafted?): {_RESTART}")
    _count(pos[0], "pos[0]", path)
    _count(pos[1], "pos[1]", path)
    _count(state.get("tokens"), "tokens", path)
    _flag(state.get("sep_due"), "sep_due", path)
    _flag(state.get("prefix"), "prefix", path)


def read_meta(out: str, itemsize_of: dict[str, int]) -> dict[str, Any]:
    """``<out>/meta.json`` of a finished output, checked; its ``train.bin``/``val.bin``
    must have the sizes it records (``itemsize_of``: bytes per token of each dtype)."""
    path = os.path.join(out, "meta.json")
    meta = _read_record(path, "prepare_data meta.json")
    dtype = meta.get("dtype")
    if dtype not in itemsize_of:
        raise ValueError(f"{path}: field 'dtype' is {_short(dtype)}, expected one of {sorted(itemsize_of)}; "
                         f"not a record prepare_data wrote: {_RESTART}")
    tokens = _count(meta.get("tokens"), "tokens", path)
    train = _count(meta.get("train_tokens"), "train_tokens", path)
    if train + _count(meta.get("val_tokens"), "val_tokens", path) != tokens:
        raise ValueError(f"{path}: train_tokens + val_tokens is not tokens; not a record prepare_data wrote: "
                         f"{_RESTART}")
    for name, key in (("train.bin", "train_tokens"), ("val.bin", "val_tokens")):
        file = os.path.join(out, name)
        want = meta[key] * itemsize_of[dtype]
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            raise ValueError(f"{file} is missing although {path} records {meta[key]} tokens there: "
                             f"{_RESTART}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != want:
            what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else describe_kind(st.st_mode)
            raise ValueError(f"{file} is {what}, but {path} records {want} bytes ({meta[key]} tokens): {_RESTART}")
    return meta


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Turn a failed write into one line naming ``path`` and the cause (a full disk, the
    ``ulimit -f`` file-size limit); progress recorded so far is kept."""
    try:
        yield
    except OSError as exc:
        why = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "the file-size limit (ulimit -f) was reached"}.get(exc.errno, exc.strerror or str(exc))
        raise ValueError(f"cannot write {path}: {why}; free space (or raise the limit) and rerun the same "
                         "command to continue") from None


def lock_output_dir(out: str) -> int:
    """Create ``out`` if needed and lock it for this run; returns the descriptor holding the lock."""
    if os.path.lexists(out) and not os.path.isdir(out):
        st = os.stat(out) if os.path.exists(out) else os.lstat(out)
        kind = "a file" if stat.S_ISREG(st.st_mode) else describe_kind(st.st_mode)
        raise ValueError(f"--out {out} is {kind}, not a directory; give a directory (it is created if missing)")
    try:
        os.makedirs(out, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create or open the directory: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ValueError(f"{out}: another prepare_data is writing there") from None
        raise
    return fd


def open_tokens(path: str) -> int:
    """The partial token file for reading and appending: never through a link, never a special file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; refusing to follow it (prepare_data never writes one "
                             "there: planted?); rerun with --restart") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{path} is {describe_kind(mode)}, not a regular file; refusing to use it")
    return fd


class PartialOutput:
    """The partial output: ``tokens.bin`` (all tokens so far) and ``state.json`` (where the input stands).

    The caller holds :func:`lock_output_dir`'s lock on the parent directory.
    """

    def __init__(self, out: str) -> None:
        self.dir = os.path.join(out, PARTIAL)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.dir)
        st = os.lstat(self.dir)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{self.dir} is {describe_kind(st.st_mode)}, not the directory prepare_data keeps its "
                             "progress in; refusing to use it")
        self.tokens_path = os.path.join(self.dir, "tokens.bin")
        self.state_path = os.path.join(self.dir, "state.json")

    def read_state(self, n_inputs: int) -> Optional[dict[str, Any]]:
        """The recorded progress (checked: :func:`check_state`), or None when there is none."""
        if not os.path.lexists(self.state_path):
            return None
        state = _read_record(self.state_path, "prepare_data state")
        check_state(state, self.state_path, n_inputs)
        return state

    def write_state(self, state: dict[str, Any]) -> None:
        with writing(self.state_path):
            write_atomic(self.state_path, json.dumps(state, sort_keys=True))

    def remove(self) -> None:
        for name in ("tokens.bin", "state.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)
