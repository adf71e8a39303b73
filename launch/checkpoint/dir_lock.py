"""One job per checkpoint directory: an exclusive lock held by rank 0 for the job's life.

Two jobs writing one ``checkpoint.dir`` (a duplicate submission, two people picking the
same path) silently overwrite each other's checkpoints and temporary directories. Before
it reads or writes anything in the directory, rank 0 takes an exclusive ``flock`` on
``<checkpoint.dir>/tp_fuse.lock`` and keeps it until the job ends; a second job is refused
on every rank with ``checkpoint.dir is in use by run X (host h, pid p, since t)`` and
changes nothing in the directory.

Why ``flock`` on an open file, not "the file exists": the kernel releases the lock when
the holder's process dies, however it dies (crash, ``kill -9``, OOM killer, node
reboot for a local disk), so a stale lock cannot block the next job. A lock file left by
a dead job still holds its record; the next job takes the lock over and says whose it was.

The file holds a small JSON record (run id, job, host, pid, start time) for the refusal
message; it is informational only: ownership is the ``flock``. On release the holder
unlinks the file *while still holding the lock*; a job that opened the old file before
the unlink and then gets its lock notices that the path now names another file (or
none) and starts over, so two holders can never coexist.

Shared filesystems: NFSv4 and Lustre (mounted with ``-o flock``) support ``flock``
across nodes. Where the filesystem refuses it (``ENOLCK``, ``EOPNOTSUPP``), the job runs
without the lock and says so in one warning line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from typing import Any, Callable, Optional

from tp_fuse.safe_files import describe_kind

from .safe_dcp import CheckpointError

__all__ = ["LOCK_FILE", "DirLock", "acquire"]

LOCK_FILE = "tp_fuse.lock"
_RECORD_LIMIT = 64 << 10
# The holder writes its record right after taking the lock and names its run a moment
# later (after the start-up decision); a refused job waits this long for the name.
_RECORD_WAIT_S, _READ_PAUSE_S = 3.0, 0.05
# An elastic restart (same job key) waits this long for its previous attempt's rank 0 to
# be gone: torchrun stops the old workers before starting new ones, so this is a margin.
_SAME_JOB_WAIT_S = 60.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def _since(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def describe_holder(record: Optional[dict[str, Any]]) -> str:
    """``run X (host h, pid p, since t)`` from a lock record (``None``: unknown holder)."""
    if not record:
        return "another job (its lock record is not readable)"
    run = record.get("run_id") or "(still starting: no run id yet)"
    return f"run {run} (host {record.get('host', '?')}, pid {record.get('pid', '?')}, since {_since(record.get('since'))})"


def _open_lock_file(path: str) -> int:
    """The lock file, created if missing; never through a link, never a special file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint.dir lock file {path} is a symbolic link; refusing to follow it "
                                  "(tp-fuse never writes one: planted?)") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise CheckpointError(f"checkpoint.dir lock file {path} is not a regular file; move it away") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"checkpoint.dir lock file {path} is {describe_kind(mode)}, not a regular file; "
                              "move it away")
    return fd


def _read_record(fd: int) -> Optional[dict[str, Any]]:
    """The JSON record in the lock file (None if empty or not JSON)."""
    raw = os.pread(fd, _RECORD_LIMIT, 0)
    try:
        record = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _read_record_of_holder(fd: int) -> Optional[dict[str, Any]]:
    """The holder's record, waiting briefly until it names the run (see _RECORD_WAIT_S)."""
    deadline = time.monotonic() + _RECORD_WAIT_S
    record = _read_record(fd)
    while (record is None or not record.get("run_id")) and time.monotonic() < deadline:
        time.sleep(_READ_PAUSE_S)
        record = _read_record(fd) or record
    return record


class DirLock:
    """The held lock of one checkpoint directory (rank 0). :meth:`release` is idempotent."""

    def __init__(self, path: str, fd: int, record: dict[str, Any]) -> None:
        self.path = path
        self._fd: Optional[int] = fd
        self.record = record
        self._write_record()

    def _write_record(self) -> None:
        assert self._fd is not None
        data = json.dumps(self.record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def set_run_id(self, run_id: str) -> None:
        """Name the run in the record, once the start-up decision knows it."""
        if self._fd is not None and run_id:
            self.record["run_id"] = run_id
            self._write_record()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlink the lock file (still holding the lock, see the module docstring) and unlock."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass  # the directory went away or became read-only: closing still unlocks
        finally:
            os.close(fd)  # closing the last descriptor releases the flock


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def acquire(directory: str, *, job: str, say: Callable[[str], None] = lambda line: None,
            same_job_wait_s: float = _SAME_JOB_WAIT_S) -> Optional[DirLock]:
    """Take the lock of ``directory`` (created if missing) for this job; rank 0 only.

    Returns the held :class:`DirLock`, or None where the filesystem has no ``flock`` (a
    warning is passed to ``say``). Raises :class:`CheckpointError` naming the holder when
    another job holds it. A lock left by a dead job is taken over (``say`` names it). A
    holder with the same ``job`` key is a previous attempt of this job being stopped by
    torchrun: it is waited for, up to ``same_job_wait_s``.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    deadline: Optional[float] = None
    while True:
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                os.close(fd)
                say(f"WARNING: the filesystem of checkpoint.dir {directory} does not support flock "
                    f"({exc.strerror}); running without the one-job-per-directory lock")
                return None
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            holder = _read_record_of_holder(fd)
            os.close(fd)
            if holder is not None and holder.get("job") == job:
                deadline = deadline if deadline is not None else time.monotonic() + same_job_wait_s
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
            raise CheckpointError(
                f"checkpoint.dir is in use by {describe_holder(holder)}: {directory} (lock {path}). Two jobs "
                "writing one checkpoint directory would overwrite each other's checkpoints; wait for that job "
                "to end, or give this one another checkpoint.dir. Nothing was changed"
            ) from None
        if not _same_file(fd, path):
            os.close(fd)  # the holder released (unlinked) it between our open and flock: try again
            continue
        break
    stale = _read_record(fd)
    if stale is not None:
        whose = "a previous attempt of this job" if stale.get("job") == job else describe_holder(stale)
        say(f"checkpoint.dir lock of {whose} was left behind (that job ended without releasing it: crashed or "
            "killed); taking it over")
    record = {"run_id": None, "job": job, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    return DirLock(path, fd, record)
