"""Whether the job that claimed a checkpoint directory is still running (issue 40, case 7).

The directory's lock (:mod:`tp_fuse.launch.checkpoint.dir_lock`) keeps a second job out
while the first holds it. If someone deletes the lock file of a running job, the next job
creates a new one, gets it, and would resume the running job's checkpoints under its run
id: two jobs then write one directory (issue 40 saw the owner continue from the
intruder's step with different losses). Two marks catch it:

* ``run.json`` says who claimed the run (job key, host, pid) and ``"active": true`` until
  that job ends (:func:`mark_ended`, run when the job gives up its lock). A job that ends
  without it (crash, ``kill -9``) leaves its lock *file* behind too, which the next job
  takes over with a message.
* So a new job that got the lock *without* taking over a dead job's lock file, and finds
  ``run.json`` active for another job, is looking at a job whose lock file was deleted:
  :func:`live_owner_problem` refuses to adopt its run, unless that job's process is known
  to be gone (same host, no such pid).

The running job notices separately, at its next checkpoint (:meth:`DirLock.lost`).
Only rank 0 reads and writes these files.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Optional

from tp_fuse.safe_files import read_regular_file, write_atomic

from .errors import CheckpointError
from .run_identity import IDENTITY_FILE, IDENTITY_LIMIT

__all__ = ["live_owner_problem", "mark_ended"]


def _read(root: str) -> Optional[dict[str, Any]]:
    """``run.json`` as a dict (None: missing or not a JSON object; a link or special file: CheckpointError)."""
    try:
        data = json.loads(read_regular_file(os.path.join(root, IDENTITY_FILE), IDENTITY_LIMIT, "run identity file",
                                            error=CheckpointError))
    except (OSError, ValueError, RecursionError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        return None
    return data if isinstance(data, dict) else None


def _process_gone(host: Any, pid: Any) -> bool:
    """True only when ``pid`` on ``host`` is known not to run (this host, no such process)."""
    if host != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False  # another host (or no pid): nothing here can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # another user's process (or a number no pid can be): treat it as running
    return False


def live_owner_problem(root: str, job: str) -> Optional[str]:
    """Why this job (key ``job``) must not adopt the run in ``root`` (None: it may).

    Call only after taking the directory's lock *without* taking over a dead job's lock
    file (see the module docstring).
    """
    data = _read(root)
    if data is None or data.get("active") is not True or data.get("job") == job:
        return None  # ended cleanly, written before this mark existed, or an elastic restart of this job
    host, pid = data.get("host"), data.get("pid")
    if _process_gone(host, pid):
        return None
    run = data.get("run_id")
    return (f"checkpoint.dir {root}: {IDENTITY_FILE} says run {str(run)[:40]} of job {str(data.get('job'))[:120]} "
            f"(host {str(host)[:80]}, pid {str(pid)[:20]}) is still running, but the directory's lock file is gone "
            "(deleted while that job ran?). Not adopting a run another job may still be writing: if that job has "
            f"ended, delete {os.path.join(root, IDENTITY_FILE)} and start again (checkpoint.resume=auto then "
            "continues from the newest checkpoint)")


def mark_ended(root: str, run_id: Optional[str], job: str) -> None:
    """Clear ``active`` in ``run.json`` if it is still this job's claim of ``run_id``
    (another job's claim is left alone). By job key, not pid: after an elastic restart
    rank 0 is another process of the same job."""
    data = _read(root)
    if data is None or data.get("active") is not True or data.get("run_id") != run_id or data.get("job") != job:
        return
    write_atomic(os.path.join(root, IDENTITY_FILE), json.dumps({**data, "active": False}))
