"""Where the modules of ``tp_fuse.comm``, ``tp_fuse.layers`` and ``tp_fuse.launch`` are.

Each of these packages is one file here (``tp_fuse/comm.py``...: its docstring and public
names) whose ``__path__`` names the folder holding its modules. A module with ``__path__`` is a
package: the import system finds ``tp_fuse.comm.topology`` in ``tp_fuse.comm.__path__``.

* In a checkout the folder is the repository's top-level ``comm/`` (``layers/``, ``launch/``),
  beside ``tp_fuse/``: the layout the user asked for.
* Installed, it is ``tp_fuse/comm/`` beside ``tp_fuse/comm.py`` (pyproject's ``package-dir``
  maps the repository folder there).

Why not an ``__init__.py`` in the folder: from the repository root (a notebook started in a
checkout, ``python -c``), ``sys.path[0]`` is the root, and a top-level folder with an
``__init__.py`` is a regular package named ``comm`` that shadows Jupyter's installed ``comm``.
Without one it is only a PEP 420 namespace portion, and an installed regular package of the
same name wins over it (tests/test_checkout_names.py).
"""

from __future__ import annotations

import os

__all__ = ["floor_path"]


def floor_path(package_file: str, name: str) -> list[str]:
    """``__path__`` of the package ``tp_fuse.<name>`` whose file is ``package_file``."""
    here = os.path.dirname(os.path.abspath(package_file))
    installed = os.path.join(here, name)
    if os.path.isdir(installed):
        return [installed]
    # A checkout: the repository root holds tp_fuse/ and the folder side by side.
    return [os.path.join(os.path.dirname(here), name)]
