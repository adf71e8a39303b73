"""Progress display on rank 0: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
__all__ = ["Progress"]


class Progress:
    """Shows step, loss and tokens/s.

    On a terminal: a ``rich`` progress bar plus one printed line per log interval.
    Elsewhere (pipes, CI logs, tests): only the printed lines, so logs stay readable.

    Args:
        total: last step.
        start: first step - 1 (the resumed step).
        enabled: False on ranks != 0 (or ``trainer.progress=false``: lines only).
        bar: show the bar when the console is a terminal.
    """

    def __init__(self, total: int, start: int, enabled: bool, bar: bool = True) -> None:
        self.enabled = enabled
        self._bar = None
        self._task = None
        if not enabled:
            return
        from rich.console import Console

        # The bar's live refreshes go to the terminal only, not into train.log (tp_fuse.launch.logging.runlog).
        self.console = Console(file=getattr(sys.stdout, "terminal", sys.stdout))
        self._log = getattr(sys.stdout, "log", None)
        if bar and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self._bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console,
            )
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, highlight=False)
            if self._log is not None:
                self._log.write(text + "\n")
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
