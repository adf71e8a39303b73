"""Writing and reading a state dict with ``torch.distributed.checkpoint``, and one-line causes
for its failures.

This module and :mod:`~tp_fuse.launch.checkpoint.safe_dcp` (which it imports) are where the
checkpoint package imports DCP. :class:`~tp_fuse.launch.checkpoint.manager.CheckpointManager`
imports this one at its first save or load, so config validation (a CPU-second less: DCP
also loads DTensor and sympy) and runs that never checkpoint do not import DCP.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

from .files import METADATA_FILE, describe_os_error, file_size_limit
from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata

__all__ = ["FAILURES", "chain", "describe_dcp_failure", "describe_write_failure", "read_state_dict",
           "unlisted_file", "write_state_dict"]

#: What ``dcp.save``/``dcp.load`` raise: DCP's CheckpointException is a BaseException.
FAILURES = (Exception, DCPCheckpointException)


def write_state_dict(sd: dict[str, Any], directory: str, writer_factory: Optional[Callable[[str], Any]],
                     group: Optional[dist.ProcessGroup]) -> None:
    """``dcp.save`` of ``sd`` into ``directory`` (``writer_factory``: DCP's FileSystemWriter by default)."""
    writer = (writer_factory or FileSystemWriter)(directory)
    dcp.save(sd, storage_writer=writer, process_group=group)


def read_state_dict(sd: dict[str, Any], path: str, group: Optional[dist.ProcessGroup]) -> None:
    """``dcp.load`` into ``sd`` from the checkpoint at ``path``, through the reader and planner
    that run no code from it (:mod:`tp_fuse.launch.checkpoint.safe_dcp`)."""
    dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), process_group=group)


def unlisted_file(path: str, files: dict[str, Any]) -> Optional[str]:
    """A file the checkpoint's ``.metadata`` refers to that its manifest's ``files`` does not
    list (every file DCP will open must be one the manifest vouches for); None: none."""
    metadata = read_metadata(path)
    for info in metadata.storage_data.values():
        if info.relative_path not in files:
            return f"{METADATA_FILE} refers to {info.relative_path}, which the manifest does not list"
    return None


def chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes/contexts and, for DCP's CheckpointException, every rank's failure."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, DCPCheckpointException):
            todo += [pair[0] for pair in e.failures.values()]
    return out


def describe_dcp_failure(exc: BaseException) -> str:
    """One line for a failure raised by ``dcp.load``/``dcp.save``.

    DCP's ``CheckpointException`` prints ``CheckpointException ranks:dict_keys([0])``
    followed by each rank's traceback; the real error (``Size mismatch between saved
    torch.Size([64]) and current: torch.Size([128]) for model/...``) is at the end of it.
    This gives each rank's own error, ranks with the same error named together.
    """
    if not isinstance(exc, DCPCheckpointException):
        return " ".join(f"{type(exc).__name__}: {exc}".split())
    by_text: dict[str, list[int]] = {}
    for rank, failure in sorted(exc.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        text = describe_dcp_failure(inner) if isinstance(inner, BaseException) else repr(inner)
        by_text.setdefault(text, []).append(rank)
    if not by_text:
        return "DCP failed without naming a rank's error"
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
                     for text, ranks in by_text.items())


def describe_write_failure(exc: BaseException, directory: str, sd: dict[str, Any]) -> str:
    """One line naming the cause of a failed DCP write (DCP's own report is a traceback per rank)."""
    errors = chain(exc)
    for e in errors:
        if isinstance(e, OSError) and e.errno is not None:
            return describe_os_error(e, directory)
    # torch.save reports a full disk, or a file cut short by the file-size limit (ulimit -f,
    # which Python's ignored SIGXFSZ turns into a short write), as e.g. "unexpected pos 704
    # vs 598": check the limit, then the space.
    need = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
    limit = file_size_limit()
    if limit is not None and limit < need:
        return (f"this process's file-size limit (ulimit -f: {limit} bytes) is below this rank's part of the "
                f"checkpoint (about {need} bytes) in {directory}; raise the limit")
    try:
        st = os.statvfs(directory if os.path.isdir(directory) else os.path.dirname(directory))
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if free is not None and free < need:
        return (f"no space left on the device of {directory} ({free} bytes free, this rank's part of the "
                f"checkpoint needs about {need})")
    inner = errors[-1] if len(errors) > 1 else exc
    return f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
