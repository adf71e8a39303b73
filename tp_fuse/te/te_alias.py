"""``import transformer_engine`` answered by tp_fuse, on request: :func:`install`.

For code written against Transformer Engine (Megatron-Core's TE layer spec) on a machine
without TE: after ``tp_fuse.te.te_alias.install()``,

========================================  ============================================
``transformer_engine``                    a package with ``__version__ = TE_API_VERSION``
``transformer_engine.pytorch[.X...]``     ``tp_fuse[.X...]`` (the same module objects;
                                          TE's module paths via :mod:`tp_fuse._te_paths`)
``transformer_engine.common.recipe``      ``tp_fuse.te.recipe`` (``tp_fuse.recipe`` with TE's
                                          ``DelayedScaling`` keywords)
========================================  ============================================

Strict: a TE module tp_fuse has no counterpart for raises ``ModuleNotFoundError`` and a
missing name ``ImportError`` / ``AttributeError``, exactly as with a TE build lacking them,
so code that probes for optional TE features (``try: from transformer_engine... import``)
takes its fallback, and code that needs them fails loudly. No placeholders (unlike
``tools/run_te_tests.py``'s shim, which runs TE's tests file by file).

Refused (ValueError) when a real ``transformer_engine`` is importable: the alias never
shadows an installed TE.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Optional

from .._te_paths import AliasFinder
from . import recipe
from .constants import TE_API_VERSION

__all__ = ["install", "is_installed"]

_ROOT = "transformer_engine"
#: TE prefix -> tp_fuse module, longest first.
_MAP = (("transformer_engine.pytorch", "tp_fuse"), ("transformer_engine.common.recipe", "tp_fuse.te.recipe"))


def _target(fullname: str) -> Optional[str]:
    for prefix, target in _MAP:
        if fullname == prefix or fullname.startswith(prefix + "."):
            return target + fullname[len(prefix):]
    return None


class TransformerEngineFinder(AliasFinder):
    """``transformer_engine.pytorch.X`` -> ``tp_fuse.X`` when that module exists, else not found."""

    def __init__(self) -> None:
        super().__init__(_target)


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return getattr(sys.modules.get(_ROOT), "__tp_fuse_alias__", False)


def install() -> None:
    """Register ``transformer_engine`` as tp_fuse (see the module docstring); idempotent."""
    if is_installed():
        return
    if _ROOT in sys.modules or importlib.util.find_spec(_ROOT) is not None:
        raise ValueError("tp_fuse.te.te_alias.install: a real transformer_engine is importable; "
                         "the alias never shadows it")
    root = ModuleType(_ROOT, "Transformer Engine's names served by tp_fuse (tp_fuse.te.te_alias).")
    root.__path__ = []  # a package: its submodules come from the finder
    root.__version__ = TE_API_VERSION
    root.__tp_fuse_alias__ = True
    common = ModuleType(_ROOT + ".common", "TE's common package: recipe (tp_fuse.te.recipe).")
    common.__path__ = []
    common.recipe = recipe
    root.common = common
    sys.meta_path.insert(0, TransformerEngineFinder())
    sys.modules[_ROOT] = root
    sys.modules[_ROOT + ".common"] = common
    root.pytorch = importlib.import_module(_ROOT + ".pytorch")
