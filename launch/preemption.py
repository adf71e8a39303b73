"""Stopping on a signal without losing work: SIGTERM, SIGUSR1 and SIGINT.

Schedulers send SIGTERM (Slurm, Kubernetes) or a user-chosen signal such as SIGUSR1
(``sbatch --signal=USR1@120``) some time before they kill a job; Ctrl-C sends SIGINT.
The default actions end the process at once (SIGINT with a ``KeyboardInterrupt``
traceback) and everything since the last ``checkpoint.interval`` save is lost.

While :class:`StopSignals` is installed (the training loop), each of these signals only
records that a stop was asked for. The trainer passes :attr:`StopSignals.requested` into
the step's health all-reduce (``tp_fuse.launch.health``), so every rank learns of it at the
same step even if only one rank got the signal; that step is finished, a checkpoint is
saved and the run ends with one line naming the signal, the step and the checkpoint,
and exit status 0 (a stop that saved is not a failure; torchrun does not restart it).

Repeated signals are ignored: torchrun forwards the signal it gets to its workers, so a
Ctrl-C or a SIGTERM to the whole process group reaches each worker twice. torchrun's
agent kills workers that have not exited 30 s after it forwarded the signal; the step
and the save must fit in that (or in the scheduler's grace period).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Optional

__all__ = ["STOP_SIGNALS", "StopSignals", "signal_name"]

#: The signals that stop a run after the current step, with a checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15 (the number itself for an unknown one)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Records stop signals between :meth:`install` and :meth:`uninstall` (or as a context
    manager). Python installs handlers in the main thread only; elsewhere (``tp_fuse.launch.api.train``
    called from a worker thread) nothing is installed and :attr:`signum` stays 0.
    """

    def __init__(self) -> None:
        self.signum = 0  # number of the first stop signal received (0: none)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only a flag: the handler runs between bytecodes of the main thread, maybe in
        # the middle of a collective's Python wrapper, so it must not act by itself.
        if not self.signum:
            self.signum = signum

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
