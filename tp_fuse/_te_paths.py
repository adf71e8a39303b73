"""Transformer Engine's module paths under ``tp_fuse``, served from the TE room (``tp_fuse.te``).

TE code and TE's own tests (through ``tools/run_te_tests.py``) import
``transformer_engine.pytorch.module.base``, ``...pytorch.constants`` and so on; with
``import tp_fuse as te`` those are ``tp_fuse.module.base``, ``tp_fuse.constants``... The
classes live once, in ``tp_fuse.te``; this finder makes each TE path import the very same
module object (no copy, so classes compare identical), and only when asked: importing
``tp_fuse`` (or a lower floor such as ``tp_fuse.comm``) does not import ``tp_fuse.te``,
which sits on top of ``tp_fuse.layers``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Callable, Optional

#: TE's top-level names under ``tp_fuse`` that are modules of the TE room.
TE_MODULES = ("module", "attention", "transformer", "cpp_extensions", "constants", "fp8", "tensor", "router")

_PREFIX = "tp_fuse."


def te_target(fullname: str) -> Optional[str]:
    """``tp_fuse.te.<rest>`` for a TE path ``tp_fuse.<TE module>[.<sub>]``, else None."""
    if not fullname.startswith(_PREFIX):
        return None
    rest = fullname[len(_PREFIX):]
    if rest.split(".", 1)[0] not in TE_MODULES:
        return None
    return "tp_fuse.te." + rest


class _AliasLoader(importlib.abc.Loader):
    """Hands out the real module (imported once, under its own name) under the alias: no
    second copy, so classes compare identical."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        # The module ran once, under its own name in tp_fuse.te; nothing to run again.
        return None


class AliasFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that serves existing modules under a second name: ``target(name)``
    is the real module's name, or None for names it does not serve (the TE room's paths
    here, ``transformer_engine`` in :mod:`tp_fuse.te.te_alias`)."""

    def __init__(self, target: Callable[[str], Optional[str]]) -> None:
        self.target = target

    def find_spec(self, fullname: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        real = self.target(fullname)
        if real is None:
            return None
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            return None
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real),
                                              is_package=spec.submodule_search_locations is not None)


class TEPathFinder(AliasFinder):
    """Meta-path finder of the TE paths (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(te_target)


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once. First: a submodule such as
    ``tp_fuse.module.base`` must be answered here, not found again as a file by the path
    finder through its parent's ``__path__`` (that would load a second copy)."""
    if not any(isinstance(f, TEPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TEPathFinder())
