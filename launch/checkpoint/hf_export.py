"""``checkpoint.export_hf``: the trained Hugging Face model as a new directory, atomically.

An export used to be written straight into the target directory: a SIGTERM, a Ctrl-C or a
full disk in the middle left it empty or half written, and the same command then refused
it ("already exists"). Now:

* the target is checked before training (:func:`check_export_target`, from the config
  check: not there yet, no partial export next to it, its parent creatable and writable)
  and again right before the export and right before the rename;
* the export is written into ``<target>.partial`` (a new directory, created exclusively
  next to the target, on the same file system) and renamed to the target only when every
  file is written and synced: the target is complete or absent;
* a failure (``OSError`` such as a full disk, a lost peer) or a stop signal (SIGTERM,
  SIGINT, SIGUSR1: raised as :class:`ExportInterrupted` while the export runs) removes
  the partial directory and is one :class:`ExportError` line naming what happened and
  what to run next (the checkpoint is kept: the same command with
  ``checkpoint.resume=auto`` exports it). Only a partial directory that could not be
  removed (or one left by SIGKILL) needs a person: the error, and the next config check,
  name it with the command that removes it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.layers.wrap.export import save_pretrained

from ..preemption import STOP_SIGNALS, signal_name
from .errors import CheckpointError

__all__ = ["ExportError", "ExportInterrupted", "check_export_target", "export_hf_directory", "partial_path"]


class ExportError(CheckpointError):
    """The export failed or was interrupted; the message is one line; ``exit_status`` is the
    process's (128 + the signal for a stop signal, like a shell)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class ExportInterrupted(BaseException):
    """A stop signal arrived while the export ran (a BaseException, like KeyboardInterrupt:
    nothing on the way may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def partial_path(path: str) -> str:
    """Where the export of ``path`` is written before it is renamed into place."""
    return os.path.abspath(path).rstrip(os.sep) + ".partial"


def check_export_target(path: str) -> None:
    """The target can be created as a new directory now; ValueError (one line) otherwise."""
    partial = partial_path(path)
    if os.path.lexists(path):
        raise ValueError(f"checkpoint.export_hf: {path} already exists; expected a new path (an export never "
                         "writes into an existing one)")
    if os.path.lexists(partial):
        raise ValueError(f"checkpoint.export_hf: {partial} is left from an export that was killed (or one running "
                         f"now); remove it (rm -r {partial}) and run the same command again")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"checkpoint.export_hf: {path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint.export_hf: {path} cannot be created: {parent} is not writable for this user")


@contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """While the export runs, a stop signal raises :class:`ExportInterrupted` (once: torchrun
    forwards a signal that already reached the process group, so it can come twice)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def handle(signum: int, frame: Optional[FrameType]) -> None:
        if not seen:
            seen.append(signum)
            raise ExportInterrupted(signum)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _sync_tree(directory: str) -> None:
    """fsync every file in ``directory`` and the directory: on disk before the rename."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _sync_dir(directory)


def _sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_WRITE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EFBIG: "the file-size limit (ulimit -f) was reached"}


def _cause(exc: BaseException) -> str:
    """What went wrong, in a few words: the signal, the write error, else the exception."""
    if isinstance(exc, ExportInterrupted):
        return f"interrupted by {signal_name(exc.signum)}"
    if isinstance(exc, OSError) and exc.errno is not None:
        why = _WRITE_ERRORS.get(exc.errno, exc.strerror or str(exc))
        return why + (f" ({exc.filename})" if exc.filename else "")
    # safetensors writes in Rust and reports an I/O error as text: "... (os error 27)".
    code = re.search(r"\(os error (\d+)\)", str(exc))
    if code is not None and int(code.group(1)) in _WRITE_ERRORS:
        return _WRITE_ERRORS[int(code.group(1))]
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _agree(problem: str, tp_group: Any) -> str:
    """The TP ranks agree whether any of them has a problem (a ValueError on every rank, not
    a hang in the gather); returns this rank's problem or a note naming TP rank 0's."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return problem
    flag = torch.tensor([1 if problem else 0], dtype=torch.int32,
                        device="cuda" if dist.get_backend(tp_group) == "nccl" else "cpu")
    dist.all_reduce(flag, group=tp_group)  # MAX via SUM of 0/1 flags
    if flag.item() and not problem:
        return "checkpoint.export_hf: TP rank 0 could not prepare the export (see its error)"
    return problem


def export_hf_directory(model: torch.nn.Module, tp_group: Any, write: bool, path: str, *, next_step: str = "") -> None:
    """Write the wrapped Hugging Face ``model`` (the unwrapped original's layout, gathered
    over ``tp_group``) as the new directory ``path`` that ``from_pretrained`` loads
    (``tp_fuse.layers.wrap.export.save_pretrained``), through ``<path>.partial`` (see the
    module docstring). ``write``: this rank's TP group writes (one per run: the first
    data-parallel replica); collective over ``tp_group``. ``next_step``: what the error
    tells the user to do (the checkpoint that holds the model).

    Raises:
        ExportError: on every rank of the group, one line; nothing is left at ``path``.
    """
    if not write:
        return
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    partial = partial_path(path)
    problem = ""
    if rank == 0:
        try:
            check_export_target(path)  # again: created or planted during training?
            os.makedirs(os.path.dirname(partial), exist_ok=True)
            os.mkdir(partial, 0o755)  # fails on any existing entry, links included
        except (OSError, ValueError) as e:
            problem = (str(e) if isinstance(e, ValueError) else
                       f"checkpoint.export_hf: cannot create {partial} as a new directory: {e.strerror or e}")
    problem = _agree(problem, tp_group)
    if problem:
        raise ExportError(problem)
    try:
        with _stop_signals_raise():
            save_pretrained(model, tp_group, partial, safe_serialization=True)
            if rank == 0:
                _sync_tree(partial)
                if os.path.lexists(path):  # created (or planted) while the export was written
                    raise FileExistsError(errno.EEXIST, "created by someone else during the export", path)
                # A rename onto an absent name; an empty directory created in the instant
                # between the check and the rename would be replaced (it held nothing).
                os.rename(partial, path)
                _sync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException as exc:
        left = ""
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            if os.path.lexists(partial):
                left = f"; could not remove {partial}: remove it (rm -r {partial})"
            else:
                left = f"; removed the partial {partial}"
        status = 128 + exc.signum if isinstance(exc, ExportInterrupted) else 1
        raise ExportError(f"checkpoint.export_hf: writing {path} failed: {_cause(exc)}{left}; nothing was "
                          f"written to {path}" + (f"; {next_step}" if next_step else ""), status) from None
