"""Make a script in ``launch/`` import ``tp_fuse`` from this checkout.

The launcher's scripts (``launch/train.py``, ``launch/plot_fp8_stats.py``,
``launch/prepare_data.py``) start with::

    import os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _tp_fuse_checkout import use_checkout
    use_checkout()

This module is found as the top-level ``_tp_fuse_checkout`` (it must be importable before
``tp_fuse`` is, and whatever ran the script -- ``python``, ``torchrun``, ``runpy`` from
elsewhere -- may not have put ``launch/`` on ``sys.path``). It imports nothing but the
standard library's ``os``, ``sys`` and ``importlib``, so nothing can resolve to ``launch/``'s
own packages while ``launch/`` is still on the path. Installed, it is also
``tp_fuse.launch._tp_fuse_checkout`` (unused there).
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["use_checkout"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def use_checkout() -> None:
    """Take ``launch/`` off ``sys.path`` and import ``tp_fuse`` from this checkout if it is one.

    ``python launch/x.py`` puts ``launch/`` (not the repository root) on ``sys.path``:
    ``launch/logging/`` would then stand in for the standard library's ``logging``, so every
    entry naming ``launch/`` is removed. From a checkout, ``tp_fuse`` is imported from it,
    installed or not: ``tp_fuse/comm.py`` (``layers.py``, ``launch.py``) points its
    ``__path__`` at the root folder (``tp_fuse/_floors.py``), and the extra search location
    (the repository root) provides ``tp_fuse.configs``. Already imported ``tp_fuse``: left as it is.
    """
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    if "tp_fuse" in sys.modules or not os.path.isfile(os.path.join(_ROOT, "tp_fuse", "__init__.py")):
        return
    spec = importlib.util.spec_from_file_location(
        "tp_fuse", os.path.join(_ROOT, "tp_fuse", "__init__.py"),
        submodule_search_locations=[os.path.join(_ROOT, "tp_fuse"), _ROOT],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tp_fuse"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["tp_fuse"]  # a half-imported package would hide the real error next time
        raise
