"""``<run dir>/train.log``: everything rank 0 prints, also in the run directory.

Hydra's job logging creates ``train.log`` but the launcher prints (progress lines,
``[tp-fuse]`` messages, warnings) instead of using ``logging``, so the file stayed empty.
:func:`tee_output` copies ``sys.stdout`` and ``sys.stderr`` into it for the duration of a
run; terminal-only output (the live progress bar) goes to :attr:`_Tee.terminal` and
stays out of the file.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from tp_fuse.safe_files import open_append

__all__ = ["tee_output"]


class _Tee:
    """A text stream writing to ``terminal`` and to the log file ``log``."""

    def __init__(self, terminal: TextIO, log: TextIO) -> None:
        self.terminal = terminal
        self.log = log

    def write(self, text: str) -> int:
        n = self.terminal.write(text)
        try:
            self.log.write(text)
        except (OSError, ValueError):  # a full disk or a closed file must not stop training
            pass
        return n

    def flush(self) -> None:
        self.terminal.flush()
        with contextlib.suppress(OSError, ValueError):
            self.log.flush()

    def isatty(self) -> bool:
        return self.terminal.isatty()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, errors, ...
        return getattr(self.terminal, name)


@contextlib.contextmanager
def tee_output(path: str, enabled: bool) -> Iterator[None]:
    """Copy stdout and stderr into ``path`` (appending) while the block runs, if ``enabled``."""
    if not enabled:
        yield
        return
    try:
        # Not open(path, "a"): a train.log planted as a link would be written through.
        log_file = open_append(path, "run log")
    except ValueError as exc:  # a link or a special file: the run goes on without its copy
        print(f"[tp-fuse] WARNING: {exc}; rank 0's output is not copied into it", file=sys.stderr, flush=True)
        yield
        return
    old_out, old_err = sys.stdout, sys.stderr
    with log_file as log:
        sys.stdout, sys.stderr = _Tee(old_out, log), _Tee(old_err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = old_out, old_err
