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

Untrusted contents: a lock file may be planted. A *hard link* to another file (same inode)
would make the record overwrite that file, so a lock file with more than one link is
never written: a fresh file is renamed over it first and the lock is taken on that one.
A crafted record (``since`` = 1e300, NaN, -1e18; a pid that is not a number; a host of
many lines) is one :class:`CheckpointError` naming the lock file and the field, not a
traceback from ``time.localtime``. A lock file deleted (or replaced) while its job runs is noticed by
the holder (:meth:`DirLock.lost`, checked before every save): another job may have
taken the directory meanwhile.

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

from tp_fuse.safe_files import describe_kind, write_atomic

from .errors import CheckpointError

__all__ = ["LOCK_FILE", "DirLock", "acquire", "check_record", "describe_holder"]

LOCK_FILE = "tp_fuse.lock"
_RECORD_LIMIT = 64 << 10
# The holder writes its record right after taking the lock and names its run a moment
# later (after the start-up decision); a refused job waits this long for the name.
_RECORD_WAIT_S, _READ_PAUSE_S = 3.0, 0.05
# An elastic restart (same job key) waits this long for its previous attempt's rank 0 to
# be gone: torchrun stops the old workers before starting new ones, so this is a margin.
_SAME_JOB_WAIT_S = 60.0
# Fresh lock files renamed over hard links before giving up (someone keeps planting them).
_MAX_REPLACEMENTS = 3
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


# The times a record's "since" may hold: the epoch to the end of year 9999 (time.localtime
# raises OverflowError, ValueError or OSError outside what the platform's time_t holds).
_LATEST_SINCE = 253402300799.0
# The longest run id, job key or host name a record may hold (they are a few dozen characters).
_TEXT_LIMIT = 1024


def _since(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def check_record(record: Optional[dict[str, Any]], path: str) -> Optional[dict[str, Any]]:
    """``record`` if its fields can be shown; a crafted or damaged one is CheckpointError.

    Only the fields messages format are checked: ``since`` (a time), ``pid`` (a number),
    and ``run_id``/``job``/``host`` (one-line text, so that a refusal stays one line).
    """
    if record is None:
        return None
    for field in ("run_id", "job", "host"):
        value = record.get(field)
        if value is not None and (not isinstance(value, str) or len(value) > _TEXT_LIMIT
                                  or not value.isprintable()):
            raise CheckpointError(f"checkpoint.dir lock file {path}: field {field!r} is {value!r:.60}, not one line "
                                  "of text (a damaged or crafted lock record); if no job uses this directory, remove "
                                  "the file")
    since, pid = record.get("since"), record.get("pid")
    if since is not None and (not isinstance(since, (int, float)) or isinstance(since, bool)
                              or not 0 <= since <= _LATEST_SINCE):  # NaN fails both comparisons
        raise CheckpointError(f"checkpoint.dir lock file {path}: field 'since' is {since!r:.40}, not a time "
                              "(a damaged or crafted lock record); if no job uses this directory, remove the file")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid < 0):
        raise CheckpointError(f"checkpoint.dir lock file {path}: field 'pid' is {pid!r:.40}, not a process id "
                              "(a damaged or crafted lock record); if no job uses this directory, remove the file")
    return record


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
        # The record of a dead job's lock this one took over (None: the file was new or empty).
        self.took_over: Optional[dict[str, Any]] = None
        self._write_record()

    def _write_record(self) -> None:
        assert self._fd is not None
        data = json.dumps(self.record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def lost(self) -> Optional[str]:
        """Why this job no longer holds the directory (None: it does).

        The ``flock`` stays on the open file whatever happens to its name; but once the
        name is deleted or replaced, the next job creates a new lock file and gets it. The
        holder checks before it writes (each save) and stops instead of sharing the directory.
        """
        if self._fd is None or _same_file(self._fd, self.path):
            return None
        now = "is gone" if not os.path.lexists(self.path) else "is now another file"
        return (f"the lock file {self.path} of this job's checkpoint.dir {now}: it was deleted or replaced while "
                "the job ran, and another job may now be using the directory. Stopping so that two jobs never "
                "write one checkpoint directory; check who else uses it before resuming")

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
    replaced = 0  # fresh files renamed over a hard-linked lock file
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
            try:
                holder = check_record(_read_record_of_holder(fd), path)
            finally:
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
        links = os.fstat(fd).st_nlink
        if links > 1 and replaced < _MAX_REPLACEMENTS:
            # A hard link to another file (planted: tp-fuse never makes one): writing the
            # record would overwrite that file. Rename a fresh file over the name (the
            # other file keeps its content) and lock that one instead.
            os.close(fd)
            write_atomic(path, b"")
            replaced += 1
            say(f"checkpoint.dir lock file {path} had {links} links (a hard link to another file: planted?); "
                "replaced it with a new file, the other file is unchanged")
            continue
        if links > 1:
            os.close(fd)
            raise CheckpointError(f"checkpoint.dir lock file {path} keeps getting hard links to other files "
                                  f"({links} links after {replaced} fresh files); refusing to write it")
        break
    try:
        stale = check_record(_read_record(fd), path)
    except CheckpointError:
        os.close(fd)
        raise
    if stale is not None:
        whose = "a previous attempt of this job" if stale.get("job") == job else describe_holder(stale)
        say(f"checkpoint.dir lock of {whose} was left behind (that job ended without releasing it: crashed or "
            "killed); taking it over")
    record = {"run_id": None, "job": job, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    lock = DirLock(path, fd, record)
    lock.took_over = stale
    return lock
