"""``+model=hf``'s ``model.plan``: a built-in plan's name, a ``{module glob: style}`` mapping,
or ``<module>:<attribute>`` naming a mapping or a ``plan(config)`` function in the user's
own Python code; resolved into ``wrap``'s ``plan=`` for the model's transformers config.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, Optional

from tp_fuse.layers.wrap.convert import PLAN_STYLES
from tp_fuse.layers.wrap.hf_plans import FAMILIES
from tp_fuse.layers.wrap.plan_styles import FusedColumn

__all__ = ["check_plan_styles", "is_plan_object", "load_plan_object", "resolve_plan"]

#: ``model.plan=<module>:<attribute>``: a plan defined in the user's own Python code.
_PLAN_OBJECT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_plan_object(plan: Any) -> bool:
    """Whether ``model.plan`` names a plan in Python code (``my_plans:PLAN``)."""
    return isinstance(plan, str) and bool(_PLAN_OBJECT.match(plan))


def check_plan_styles(plan: Mapping, where: str) -> dict[str, Any]:
    """``plan`` as a dict after checking it is ``{module glob: style}`` with styles named in
    ``PLAN_STYLES`` or :class:`FusedColumn` objects; ValueError naming the bad entry."""
    if not plan:
        raise ValueError(f"{where}: the plan is empty; expected a mapping {{module glob: style}}")
    for glob_, style in plan.items():
        if not isinstance(glob_, str) or not glob_:
            raise ValueError(f"{where}: keys must be module-name globs (non-empty strings), got {glob_!r}")
        if not (isinstance(style, FusedColumn) or (isinstance(style, str) and style in PLAN_STYLES)):
            raise ValueError(f"{where}[{glob_!r}]: unknown style {style!r}; expected one of "
                             f"{', '.join(PLAN_STYLES)} or a tp_fuse.layers.FusedColumn")
    return dict(plan)


def load_plan_object(spec: str) -> Any:
    """Import ``<module>:<attribute>`` and return the attribute: a ``{module glob: style}``
    mapping (styles: ``PLAN_STYLES`` names or :class:`FusedColumn` objects) or a callable
    ``plan(config) -> mapping`` (given the model's transformers config, as the built-in
    family plans are). The module is the user's own code, named on their command line (not
    read from any model or run directory); it is imported from the current directory or
    ``PYTHONPATH``, once by the config check and once on every rank."""
    module_name, attr = spec.split(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # as ``python -m`` does: ``python launch/train.py`` puts launch/ first, not the cwd
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model.plan={spec}: cannot import module {module_name!r} ({e}); it must be importable "
                         f"from the current directory or PYTHONPATH") from None
    finally:
        if added:
            sys.path.remove(cwd)
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"model.plan={spec}: module {module_name!r} ({module.__file__}) has no attribute {attr!r}")
    if isinstance(obj, Mapping):
        check_plan_styles(obj, f"model.plan={spec}")
    elif not callable(obj):
        raise ValueError(f"model.plan={spec}: expected a mapping {{module glob: style}} or a callable "
                         f"plan(config) -> mapping, got {type(obj).__name__}")
    return obj


def resolve_plan(plan: Any, config: Any) -> Optional[dict[str, Any]]:
    """``model.plan`` as ``wrap``'s ``plan=``: None (the model's family plan), a built-in
    plan's name (its ``{glob: style}`` for this config), ``<module>:<attribute>`` (that
    mapping, or what that callable returns for this config), or the mapping itself."""
    if is_plan_object(plan):
        obj = load_plan_object(plan)
        return check_plan_styles(obj(config) if callable(obj) and not isinstance(obj, Mapping) else obj,
                                 f"model.plan={plan}")
    if isinstance(plan, str):
        return FAMILIES[plan].plan_for(config)  # the name was checked with the config
    return dict(plan) if plan is not None else None
