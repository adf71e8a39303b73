"""Reading DCP checkpoints without unpickling arbitrary objects.

DCP stores tensors in ``.distcp`` files, which it reads with
``torch.load(weights_only=True)``, and its plan in ``.metadata``, which it reads with a
plain ``pickle.load`` -- a checkpoint from elsewhere could run code at load time.
:class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that admits only
DCP's metadata dataclasses, ``torch.Size``, dtypes/layouts, ``pathlib`` paths and plain
containers; anything else raises ``pickle.UnpicklingError``.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

__all__ = ["SafeFileSystemReader"]

_SAFE_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    # DCP records the checkpoint path it was saved to.
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch.Size/dtypes/layouts and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata unpickling is restricted (see module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = os.path.join(str(self.path), ".metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
