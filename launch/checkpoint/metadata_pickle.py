"""The restricted unpickler of DCP's ``.metadata``: it builds DCP's data classes, nothing else.

``.metadata`` is a pickle, and a checkpoint directory is untrusted. Restricting which
globals a pickle may name (``find_class``) is not enough: pickle's opcodes *act* on the
objects they name. ``BUILD`` with a slot state calls ``setattr(obj, name, value)`` on the
object below it on the stack, and that object may be an allowed **class**: the attacker
round of issue 39 put ``setattr(pathlib.PosixPath, "rename", pathlib.PosixPath)`` (every
later ``Path.rename`` in the process did nothing) and ``setattr(pathlib.PosixPath, "_str",
"/x")`` (every path stringified to the attacker's) in front of genuine metadata.
``APPEND(S)``/``SETITEM(S)``/``ADDITEMS`` likewise call ``append``/``extend``/``__setitem__``/
``add`` on whatever is below them.

So each opcode that changes an existing object is checked here before it runs:

* ``BUILD`` only on an instance whose type is *exactly* one of DCP's metadata data classes
  (:data:`BUILDABLE`: never a class, module, function, enum member or path), and only
  with that class's own fields (names checked) -- or, for ``TensorProperties``, the
  5-tuple its own ``__setstate__`` takes. Such instances can only have been created by
  this very pickle (no allowed global is one), so nothing outside it changes.
* ``APPEND(S)`` only on a ``list``, ``SETITEM(S)`` only on a ``dict``/``OrderedDict``,
  ``ADDITEMS`` only on a ``set``: objects the pickle itself made.

Everything else (a global not in :data:`ALLOWED_GLOBALS`, any other target) is a
``pickle.UnpicklingError`` that :func:`tp_fuse.launch.checkpoint.safe_dcp.read_metadata`
reports naming the file. Built on the pure-Python unpickler on purpose (see
:class:`MetadataUnpickler`).
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

__all__ = ["ALLOWED_GLOBALS", "BUILDABLE", "MetadataUnpickler", "layout_by_name"]


def layout_by_name(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a ``torch.<name>`` layout, nothing else."""
    # torch pickles a layout as its repr, "torch.strided".
    attr = name[len("torch."):] if isinstance(name, str) and name.startswith("torch.") else None
    value = getattr(torch, attr, None) if attr is not None and attr.isidentifier() else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"checkpoint metadata names layout {name!r}, which is not a torch layout")
    return value


_MD, _FS = dcp_metadata, dcp_filesystem
#: DCP's metadata records: the only types whose instances ``BUILD`` may fill, by field name.
BUILDABLE: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls))
    for cls in (_MD.Metadata, _MD.MetadataIndex, _MD.StorageMeta, _MD.TensorProperties,
                _MD.TensorStorageMetadata, _MD.ChunkStorageMetadata, _FS._StorageInfo)
}
# TensorProperties pickles as (dtype, layout, requires_grad, memory format code, pin_memory).
_TENSOR_PROPERTIES_STATE = 5


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        (cls.__module__, cls.__name__): cls for cls in (*BUILDABLE, _MD._MEM_FORMAT_ENCODING)
    }
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = layout_by_name
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    # DCP records the path it saved to; pathlib's module name differs across Pythons.
    for module in ("pathlib", "pathlib._local"):
        for cls in (pathlib.Path, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
                    pathlib.PureWindowsPath):
            allowed[(module, cls.__name__)] = cls
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


#: (module, qualified name) -> the object a ``.metadata`` pickle may refer to.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed_globals()


def _describe(obj: Any) -> str:
    """How a refusal names the object an opcode targeted (a class by its name, not its repr)."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


def _refuse(opcode: str, target: Any, why: str) -> None:
    raise pickle.UnpicklingError(
        f"checkpoint metadata uses pickle's {opcode} on {_describe(target)} ({why}); DCP metadata never does: "
        "it would change an object outside the metadata"
    )


class MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the pure-Python unpickler, on purpose
    """Resolves exactly the pairs in :data:`ALLOWED_GLOBALS` (no module-wide or dotted
    lookups) and applies state only to fresh DCP records (see the module docstring).

    Built on pickle's pure-Python unpickler: the C one allocates the length a BINBYTES8 /
    BINUNICODE8 opcode *declares* before reading, so 20 crafted bytes could ask for
    16 GiB (found by the fuzz test: the kernel's OOM killer ended the test run). The
    Python one reads what is there and fails on the truncated stream. It also lets the
    mutating opcodes be replaced one by one (its ``dispatch`` table).
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not allowed"
            ) from None

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = BUILDABLE.get(type(inst))  # exact type: a class object's type is its metaclass
        if fields is None:
            _refuse("BUILD", inst, "state may only fill a DCP metadata record")
        if type(inst) is _MD.TensorProperties:
            if not isinstance(state, tuple) or len(state) != _TENSOR_PROPERTIES_STATE:
                _refuse("BUILD", inst, f"state {type(state).__name__}, expected its 5-tuple")
            inst.__setstate__(state)  # DCP's own: assigns the instance's fields
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:  # (instance dict, slot dict), as pickle allows
            state, slots = state
        for what, part in (("state", state), ("slot state", slots)):
            if part is None:
                continue
            if not isinstance(part, dict) or not all(isinstance(k, str) for k in part):
                _refuse("BUILD", inst, f"{what} is a {type(part).__name__}, expected a dict of field names")
            unknown = sorted(set(part) - fields)
            if unknown:
                _refuse("BUILD", inst, f"{what} sets {', '.join(map(repr, unknown[:3]))}, which "
                                       f"{type(inst).__name__} has no field of")
            # The record's own __dict__ (MetadataIndex is frozen: no setattr), as pickle does.
            inst.__dict__.update(part)

    def load_append(self) -> None:
        if type(self.stack[-2]) is not list:
            _refuse("APPEND", self.stack[-2], "only a list made by the pickle may grow")
        super().load_append()

    def load_appends(self) -> None:
        target = self._below_mark()
        if type(target) is not list:
            _refuse("APPENDS", target, "only a list made by the pickle may grow")
        super().load_appends()

    def load_setitem(self) -> None:
        if type(self.stack[-3]) not in (dict, collections.OrderedDict):
            _refuse("SETITEM", self.stack[-3], "only a dict made by the pickle may be filled")
        super().load_setitem()

    def load_setitems(self) -> None:
        target = self._below_mark()
        if type(target) not in (dict, collections.OrderedDict):
            _refuse("SETITEMS", target, "only a dict made by the pickle may be filled")
        super().load_setitems()

    def load_additems(self) -> None:
        target = self._below_mark()
        if type(target) is not set:
            _refuse("ADDITEMS", target, "only a set made by the pickle may grow")
        super().load_additems()

    def _below_mark(self) -> Any:
        """The target of APPENDS/SETITEMS/ADDITEMS: the object below their MARK.

        The pure-Python unpickler saves the stack at a MARK on ``metastack`` and starts
        ``stack`` afresh, so the target is the top of the saved stack (None: there is none,
        and the unpickler's own check fails on the malformed stream).
        """
        return self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
