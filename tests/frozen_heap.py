"""Keep the garbage collector off the import-time objects of a process that runs the
launcher many times.

``tp_fuse.launch.runtime.Runtime.shutdown`` collects garbage after every in-process
``train()`` (the run's process groups sit in reference cycles). A full collection walks
every tracked object: the ~320-420k that torch, hydra and transformers leave at import cost
0.2-0.25 CPU-s per collection, i.e. per run. ``launch/train.py`` freezes them for its one
run; the test modules that call ``train()`` many times in one process (a rank of
``run_distributed``, or the pytest process) do the same with :func:`frozen_heap`.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects that exist on entry are left out of every collection until the block ends
    (``gc.freeze``); objects created inside are collected as usual, so each run's cycles
    (its process groups) are still freed by the launcher's own collection."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
