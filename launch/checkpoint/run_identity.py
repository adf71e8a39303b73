"""Which checkpoint a run starts from, and whose checkpoints a directory holds.

Every run has a *run id* (a UUID), written into each checkpoint's manifest and into
``<checkpoint dir>/run.json`` together with a *job key* that is the same for every
attempt of one torchrun job (elastic restarts) and different for the next job. With
them the start-up decision is:

=========================  ===========================================================
first attempt, resume off  directory holds checkpoints: refuse (name them; say how to
                           resume, pick a new directory, or ``checkpoint.overwrite``);
                           otherwise a new run id
first attempt, resume on   the newest complete checkpoint, whatever run wrote it (you
                           asked to continue it); its run id is adopted
elastic restart            ``run.json`` has this job's key: the newest checkpoint *of
                           this run* (never another run's); otherwise as the first
                           attempt decided (an attempt that refused refuses again)
=========================  ===========================================================

The decision is printed with its reason: which checkpoint, and which newer directories
were skipped and why (no manifest: a save that did not finish, or a damaged one).
Only rank 0 reads and writes these files; :mod:`tp_fuse.launch.checkpoint.manager` broadcasts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import uuid
from typing import Any, Optional, Union

from tp_fuse.safe_files import read_regular_file, write_atomic

from .errors import CheckpointError

__all__ = ["IDENTITY_FILE", "StartDecision", "decide_start", "list_step_dirs", "read_manifest_run_id"]

IDENTITY_FILE = "run.json"
MANIFEST = "tp_fuse_checkpoint.json"
STEP_DIR = re.compile(r"step_([0-9]{8})")  # fullmatch: `$` would accept a trailing newline
LATEST = "latest"
#: Byte limits of the small files read here (they hold a few hundred bytes; a manifest
#: lists every data file of the checkpoint, a few hundred bytes per rank).
IDENTITY_LIMIT = 64 << 10
LATEST_LIMIT = 4 << 10
MANIFEST_LIMIT = 64 << 20


@dataclasses.dataclass
class StartDecision:
    """What rank 0 decided; broadcast to every rank."""

    run_id: str
    resume_from: Optional[str]  # checkpoint directory to load, None = start at step 0
    messages: list[str]  # printed by rank 0: what was chosen and why
    error: Optional[str] = None  # set: every rank raises CheckpointError(error)


def list_step_dirs(root: str) -> list[tuple[int, str, bool]]:
    """``(step, path, complete)`` for every ``step_XXXXXXXX`` directory, oldest first."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        # No directory, or one that went between a check and the listing (rank 0 removes an
        # empty checkpoint directory at the end of a run while other ranks finish theirs).
        return []
    out = []
    for name in names:
        m = STEP_DIR.fullmatch(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            # lexists, not isfile: a manifest that is a FIFO or a link to a device counts as
            # present, so that reading it names the problem instead of skipping it silently.
            out.append((int(m.group(1)), path, os.path.lexists(os.path.join(path, MANIFEST))))
    return sorted(out)


def read_manifest_run_id(checkpoint_dir: str) -> Optional[str]:
    """The run id a manifest records (None: missing, not JSON, or written before run ids existed).

    A manifest that is a symbolic link, a FIFO, a device or too large is a
    :class:`CheckpointError` (it would hang or exhaust memory), not "no run id".
    """
    try:
        raw = read_regular_file(os.path.join(checkpoint_dir, MANIFEST), MANIFEST_LIMIT, "checkpoint manifest",
                                error=CheckpointError)
        value = json.loads(raw).get("run_id")
    # RecursionError: JSON nested thousands deep, malformed like any other bad JSON.
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        return None
    return value if isinstance(value, str) else None


def _read_identity(root: str) -> Optional[dict[str, str]]:
    """``run.json`` (None: missing or malformed; a special file or link: CheckpointError)."""
    try:
        raw = read_regular_file(os.path.join(root, IDENTITY_FILE), IDENTITY_LIMIT, "run identity file",
                                error=CheckpointError)
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
        if isinstance(exc, CheckpointError):
            raise
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("run_id", "job")):
        return None
    return {"run_id": data["run_id"], "job": data["job"]}


def _write_identity(root: str, run_id: str, job: str) -> None:
    """Claim ``root`` for ``run_id``: also who runs it and that it is running
    (``active``, cleared when the job ends: :mod:`tp_fuse.launch.checkpoint.run_owner`)."""
    os.makedirs(root, exist_ok=True)
    write_atomic(os.path.join(root, IDENTITY_FILE), json.dumps(
        {"run_id": run_id, "job": job, "host": socket.gethostname(), "pid": os.getpid(), "active": True}))


def _skipped_newer(dirs: list[tuple[int, str, bool]], chosen_step: int) -> list[str]:
    return [
        f"{os.path.basename(p)} is newer but has no {MANIFEST} (a save that did not finish, or a damaged "
        "checkpoint): not used"
        for step, p, complete in dirs if not complete and step > chosen_step
    ]


def _delete_checkpoints(root: str, dirs: list[tuple[int, str, bool]]) -> None:
    for _, path, _ in dirs:
        shutil.rmtree(path)
    for name in os.listdir(root):
        if name.startswith((".tmp-step_", ".old-step_")) or name == LATEST:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def decide_start(
    root: str, resume: Union[bool, str], *, restarted: bool, job: str, overwrite: bool
) -> StartDecision:
    """Rank 0: choose the checkpoint to start from (see the module docstring); claims ``root``.

    Args:
        root: the checkpoint directory.
        resume: ``checkpoint.resume`` (True, False or ``"auto"``).
        restarted: this is an elastic restart (``TORCHELASTIC_RESTART_COUNT`` > 0).
        job: this job's key (same for all attempts of one torchrun job).
        overwrite: ``checkpoint.overwrite``: delete checkpoints of another run.
    """
    dirs = list_step_dirs(root)
    complete = [(s, p) for s, p, ok in dirs if ok]
    identity = _read_identity(root)
    messages: list[str] = []

    if restarted and identity is not None and identity["job"] == job:
        run_id = identity["run_id"]
        own = [(s, p) for s, p in complete if read_manifest_run_id(p) == run_id]
        if not own:
            messages.append(f"elastic restart of run {run_id}: no checkpoint of this run yet, starting at step 0")
            return StartDecision(run_id, None, messages)
        step, path = own[-1]
        messages.append(f"elastic restart of run {run_id}: resuming from its newest checkpoint {path}")
        messages += _skipped_newer(dirs, step)
        return StartDecision(run_id, path, messages)

    if resume is False:
        if dirs:
            if not overwrite:
                newest = dirs[-1][1]
                owner = read_manifest_run_id(newest) if dirs[-1][2] else None
                return StartDecision("", None, messages, error=(
                    f"checkpoint.dir {root} already holds {len(dirs)} checkpoint(s) of "
                    f"{'run ' + owner if owner else 'another run'} (newest: {os.path.basename(newest)}) and "
                    "checkpoint.resume=false. Continue that run with checkpoint.resume=true, start a new run "
                    "with another checkpoint.dir, or delete them with checkpoint.overwrite=true"
                ))
            _delete_checkpoints(root, dirs)
            messages.append(f"checkpoint.overwrite=true: deleted {len(dirs)} checkpoint(s) of an earlier run in {root}")
        run_id = uuid.uuid4().hex
        _write_identity(root, run_id, job)
        return StartDecision(run_id, None, messages)

    if not complete:
        if resume is True:
            skipped = f" ({len(dirs)} incomplete step director{'y' if len(dirs) == 1 else 'ies'} without " \
                      f"{MANIFEST})" if dirs else ""
            return StartDecision("", None, messages, error=(
                f"checkpoint.resume=true but there is no complete checkpoint in {root}{skipped} "
                "(set checkpoint.dir to the directory of the run to resume)"
            ))
        if dirs:
            return StartDecision("", None, messages, error=(
                f"checkpoint.resume=auto found no complete checkpoint in {root}, only {len(dirs)} incomplete "
                f"one(s) (no {MANIFEST}); move them away or use checkpoint.overwrite=true with resume=false"
            ))
        run_id = uuid.uuid4().hex
        _write_identity(root, run_id, job)
        messages.append(f"checkpoint.resume=auto: no checkpoint in {root}, starting run {run_id} at step 0")
        return StartDecision(run_id, None, messages)

    step, path = complete[-1]
    run_id = read_manifest_run_id(path) or uuid.uuid4().hex
    _write_identity(root, run_id, job)
    messages.append(f"checkpoint.resume={str(resume).lower()}: resuming run {run_id} from its newest complete "
                    f"checkpoint {path}")
    messages += _skipped_newer(dirs, step)
    latest = _read_latest(root)
    if latest is not None and latest != os.path.basename(path):
        messages.append(f"note: {root}/latest names {latest[:80]!r}, which is not a complete checkpoint")
    return StartDecision(run_id, path, messages)


def _read_latest(root: str) -> Optional[str]:
    """The step directory ``latest`` names (None: missing or not text; a special file: CheckpointError)."""
    try:
        raw = read_regular_file(os.path.join(root, LATEST), LATEST_LIMIT, "checkpoint pointer", error=CheckpointError)
        return raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def decision_to_box(d: StartDecision) -> list[Any]:
    """Plain values for ``broadcast_object_list`` (strings and lists only)."""
    return [d.run_id, d.resume_from, list(d.messages), d.error]


def decision_from_box(box: list[Any]) -> StartDecision:
    return StartDecision(run_id=box[0], resume_from=box[1], messages=box[2], error=box[3])
