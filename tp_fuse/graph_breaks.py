"""The functions dynamo must not trace, wrapped with ``torch.compiler.disable``.

``torch.compiler.disable`` imports ``torch._dynamo``, about 1.7 s of CPU on the 2-core
test machine: as a decorator at import time it made every ``import tp_fuse`` (every rank,
every launcher start) pay for dynamo. This module is imported only from code that runs
while dynamo traces (dynamo is loaded then, and handles an ``import`` inside traced code
without a graph break), so eager programs never load it.

Each function here is a graph break: dynamo runs it eagerly and resumes tracing after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .distributed import checkpoint_eager


@torch.compiler.disable
def eager_fuser_call(fuser: Any, input_: torch.Tensor, extra_inputs: Sequence[torch.Tensor], kwargs: Any) -> Any:
    """The eager fuser, reached from compiled code (groups that cannot be traced)."""
    return fuser._eager_call(input_, *extra_inputs, basic_op_kwargs=kwargs)


#: :func:`tp_fuse.distributed.checkpoint` under compile: dynamo cannot trace
#: ``torch.utils.checkpoint`` with a custom ``context_fn``.
checkpoint = torch.compiler.disable(checkpoint_eager)
