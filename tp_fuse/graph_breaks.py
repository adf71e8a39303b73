"""The functions dynamo must not trace, wrapped with ``torch.compiler.disable``.

``torch.compiler.disable`` imports ``torch._dynamo``, about 1.7 s of CPU on the 2-core
test machine: as a decorator at import time it made every ``import tp_fuse`` (every rank,
every launcher start) pay for dynamo. This module is imported only from code that runs
while dynamo traces (dynamo is loaded then, and handles an ``import`` inside traced code
without a graph break), so eager programs never load it.

Each function here is a graph break: dynamo runs it eagerly and resumes tracing after.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


@torch.compiler.disable
def eager_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, run eagerly: a graph break.

    Used for the eager fuser reached from compiled code (groups that cannot be traced) and
    for :func:`tp_fuse.distributed.checkpoint` (dynamo cannot trace
    ``torch.utils.checkpoint`` with a custom ``context_fn``). The caller passes the function,
    so this module imports nothing of tp_fuse and sits below every user.
    """
    return function(*args, **kwargs)
