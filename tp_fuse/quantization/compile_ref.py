"""``CompileRef``: a custom-op argument naming a Python object in ``torch.compile``'d graphs.

A custom op takes tensors and constants, not arbitrary objects: a :class:`CompileRef` (a
torch "opaque object" of reference type) names an object (an op's ``OpQuantizers``, its
debug hooks) as a graph *input*, so that one graph serves every layer. Copies of the owner
make their own ref. It needs torch's opaque objects (``torch._library.opaque_object``,
private API, present in the pinned torch 2.13); with an older torch
(:data:`HAVE_COMPILE_REFS` False) compiled FP8 GEMMs take the eager fuser behind a graph
break (not tested: only torch 2.13 is installed here).

Its own module, below the quantizers (which make refs) and :mod:`.compile_state` (which
builds on the quantizers): no import circle.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["HAVE_COMPILE_REFS", "NO_REF", "CompileRef", "live_targets"]


class _RefBase:  # replaced by torch's OpaqueBase where it exists (see below)
    pass


try:  # torch >= 2.10: Python objects as custom-op arguments ("opaque objects")
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase as _RefBase  # noqa: F811
except ImportError:  # pragma: no cover - older torch: compiled FP8 GEMMs take the eager fuser
    register_opaque_type = None

#: Whether custom ops can take a :class:`CompileRef` (the FP8 casts of compiled graphs need it).
HAVE_COMPILE_REFS = register_opaque_type is not None


class CompileRef(_RefBase):
    """A custom-op argument naming a Python object (an op's ``OpQuantizers``, its debug hooks).

    Registered with torch as a *reference* opaque type: a compiled graph takes it as an
    input, like a tensor, instead of baking it in as a constant -- so the layers of a model,
    each with its own quantizers, share one graph (an int handle per op would be a constant
    per layer: one recompilation per layer, and past dynamo's recompile limit, eager
    layers). The target is held weakly; a copy of the owner makes its own ref.
    """

    def __init__(self, target: Any) -> None:
        self._target = None if target is None else weakref.ref(target)
        if target is not None:
            _LIVE_REFS.add(self)

    def target(self) -> Any:
        """The object named (RuntimeError when it no longer exists)."""
        obj = None if self._target is None else self._target()
        if obj is None:
            raise RuntimeError(
                "tp_fuse compiled graph: a CompileRef names an object that no longer exists (the op "
                "was deleted while a compiled graph still refers to it), or none at all"
            )
        return obj

    def __bool__(self) -> bool:
        return self._target is not None


#: Every ref made for an object (held weakly: a ref lives as long as its owner holds it).
_LIVE_REFS: "weakref.WeakSet[CompileRef]" = weakref.WeakSet()


def live_targets(kind: type) -> list[Any]:
    """The live objects of type ``kind`` that made a :class:`CompileRef` (e.g. every
    ``OpQuantizers``: the compiled CUDA path binds their quantizers while tracing)."""
    out = []
    for ref in list(_LIVE_REFS):
        obj = ref._target() if ref._target is not None else None
        if isinstance(obj, kind):
            out.append(obj)
    return out


if HAVE_COMPILE_REFS:
    register_opaque_type(CompileRef, typ="reference")

#: The ref of no object (e.g. a cast nobody observes).
NO_REF = CompileRef(None)
