"""Which rank did not arrive: a readable message for a collective that timed out.

gloo's own error is ``Timed out waiting 30000ms for recv operation to complete`` with a
traceback, on the ranks that waited; it names neither the rank that did not come nor the
setting that bounds the wait. Which ranks were waiting is known only to each of them, so
they say so through the process group's store (the key-value store every rank already
shares: torchrun's agent store, or rank 0's TCPStore):

1. a rank whose collective timed out writes ``waiting/<rank>``;
2. it gives the other ranks blocked in the same collective a moment (``GRACE_S``, at
   most ``parallel.timeout_s``) to time out and write theirs -- they entered at about the
   same time, so they time out at about the same time;
3. the ranks that did not write are those that did not arrive (they were not waiting in
   any collective); the first such report is stored once (``compare_set``), so every
   rank prints the same lists;
4. a rank that fails later -- typically the late rank itself, whose next collective
   finds its peers gone, or times out in turn -- finds that report and prints it too.

Every rank that sees the failure prints one line naming the ranks and
``parallel.timeout_s``. Nothing else changes: the run still stops with an error
(checkpoints are what they were). Best effort: if the store is unreachable (rank 0
hosted it and has exited; not so under torchrun, whose agent hosts it) the original
error stands.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "GRACE_S", "comm_failure_kind", "explain_comm_failure"]

#: How long a timed-out rank waits for the others blocked with it to say so (seconds).
GRACE_S = 10.0
_PREFIX = "tp_fuse/collective_timeout/"
_TIMEOUT_NEEDLES = ("timed out", "socket timeout")
_PEER_NEEDLES = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out because some ranks did not arrive (the message names them
    and ``parallel.timeout_s``); raised by ``tp_fuse.launch.api.train``."""


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo += [e.__cause__, e.__context__]
    return out


def comm_failure_kind(exc: BaseException) -> Optional[str]:
    """``"timeout"`` for a collective that timed out, ``"peer"`` for one whose peer closed
    its connection, None for anything else (by the messages of the exception chain)."""
    texts = [str(e).lower() for e in _chain(exc) if isinstance(e, (RuntimeError, OSError))]
    if any(n in t for t in texts for n in _TIMEOUT_NEEDLES):
        return "timeout"
    if any(n in t for t in texts for n in _PEER_NEEDLES):
        return "peer"
    return None


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _report(store: Any) -> Optional[dict[str, Any]]:
    key = _PREFIX + "report"
    if not store.check([key]):
        return None
    return json.loads(store.get(key).decode())


def _message(rank: int, report: dict[str, Any], timeout_s: float) -> str:
    missing, waiting = report["missing"], report["waiting"]
    s = "" if len(missing) == 1 else "s"
    if rank in missing:
        return (f"rank {rank}: rank{s} {missing} (this one included) did not arrive at a collective within "
                f"parallel.timeout_s={timeout_s:g} s; rank(s) {waiting} waited for it and gave up. Raise "
                f"parallel.timeout_s if this rank was slow but alive (a long data load, checkpoint write or "
                f"compilation)")
    return (f"rank {rank}: a collective timed out after parallel.timeout_s={timeout_s:g} s: rank{s} {missing} "
            f"did not arrive (rank(s) {waiting} were waiting in it). Raise parallel.timeout_s if rank{s} "
            f"{missing} {'were' if s else 'was'} slow but alive (a long data load, checkpoint write or "
            f"compilation); otherwise see {'their' if s else 'its'} output for why {'they' if s else 'it'} stopped")


def explain_comm_failure(exc: BaseException, rank: int, world_size: int, timeout_s: float,
                         grace_s: float = GRACE_S) -> Optional[str]:
    """The one-line explanation of a collective failure caused by ranks that did not
    arrive, agreed through the store (see the module docstring), or None when ``exc`` is
    not such a failure or the store cannot tell. Call it on every rank that fails, before
    tearing the process group down (the store must still be reachable)."""
    kind = comm_failure_kind(exc)
    if kind is None or world_size < 2 or not dist.is_initialized():
        return None
    try:
        store = _store()
        report = _report(store)  # a failure after an earlier timeout: that one is the cause
        if report is None and kind == "timeout":
            store.set(_PREFIX + f"waiting/{rank}", "1")
            waiting = [rank]
            deadline = time.monotonic() + min(grace_s, timeout_s)
            while True:
                waiting = [r for r in range(world_size) if store.check([_PREFIX + f"waiting/{r}"])]
                if len(waiting) == world_size or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            missing = [r for r in range(world_size) if r not in waiting]
            if not missing:  # every rank waited: not a missing rank (a slow network?); gloo's message stands
                return None
            mine = json.dumps({"missing": missing, "waiting": waiting})
            # The first report wins, so that every rank prints the same lists.
            store.compare_set(_PREFIX + "report", "", mine)
            report = _report(store)
        if report is None:
            return None
    except Exception:  # noqa: BLE001 - the store is gone (its host exited): keep the original error
        return None
    return _message(rank, report, timeout_s)
