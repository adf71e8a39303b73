"""The checkpoint error, apart from the modules that read and write DCP files.

Validating a config, claiming a checkpoint directory and deciding what to resume raise it;
none of them needs ``torch.distributed.checkpoint`` (whose import also loads DTensor and
sympy), so they import the error from here, not from :mod:`tp_fuse.launch.checkpoint.safe_dcp`.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or incompatible with the config."""
