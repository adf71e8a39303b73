"""What the fuser's autograd function hands back: copies, aliases, or the caller's own
tensors (modified in place).

Two policies, chosen per fusion group (``OperationFuser.returns_aliases``):

* default -- outputs are safe for the caller to modify in place
  (:func:`outputs_safe_for_inplace`);
* a group holding an op with Transformer Engine's ``in_place=True`` (``AddExtraInput``,
  ``MakeExtraOutput``) -- the caller asked for TE's aliasing, so nothing is copied:
  an input passed through comes back as that tensor (autograd makes it a view of the
  input), a tensor returned twice is the same tensor twice, and an input the ops
  wrote into (the residual of ``AddExtraInput(in_place=True)``) comes back as the
  caller's tensor itself, marked dirty (:func:`aliasing_outputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def outputs_safe_for_inplace(outputs: list[torch.Tensor], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The fuser's outputs, made safe to hand to callers who modify them in place.

    Autograd forbids in-place ops on an output of a custom Function that is a view
    (``relu_``, Megatron's in-place cross-entropy on logits would raise). Two cases:

    * a view of a tensor made inside the forward (``BasicLinear`` reshapes its 2-D GEMM
      result, ``Reshape``): returned as ``detach()``, a non-view alias that shares the
      storage AND the version counter, so a saved tensor sharing that storage is still
      caught by autograd's version check if the caller modifies the output. No copy.
    * an input returned as-is (or a view of one), or one tensor returned twice
      (``MakeExtraOutput``, ``Identity``, TP size 1 comm ops): copied. An alias would let
      an in-place op change the caller's input, or the other output, behind autograd's
      back (values of the other consumers would change, their gradients would not).
    """
    if len(outputs) == 1:
        # The common case, without the id sets: one output, a fresh tensor or a view of one.
        out = outputs[0]
        root = out._base if out._is_view() else out
        if not any(t is out or t is root or (t._is_view() and (t._base is out or t._base is root))
                   for t in inputs if isinstance(t, torch.Tensor)):
            return [out.detach() if out._is_view() else out]
    taken = set()
    for t in inputs:
        if isinstance(t, torch.Tensor):
            taken.add(id(t))
            if t._is_view():
                taken.add(id(t._base))
    safe = []
    for t in outputs:
        root = t._base if t._is_view() else t
        if id(t) in taken or id(root) in taken:
            t = t.clone()
        elif t._is_view():
            t = t.detach()
        taken.add(id(t))
        taken.add(id(root))
        safe.append(t)
    return safe


def input_versions(inputs: Sequence[Any]) -> list[int]:
    """Version counters of the caller's tensors before the forward (-1: not a tensor)."""
    return [t._version if isinstance(t, torch.Tensor) else -1 for t in inputs]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is an alias of ``b`` with the same elements (e.g. ``b.detach()``)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _may_mark_dirty(t: torch.Tensor) -> bool:
    """Whether autograd accepts ``t`` as modified in place by a custom Function.

    It refuses leaves that require grad (and views, whose rebase depends on how and
    under which grad mode they were made): those stay written through an alias, as in
    Transformer Engine, and their autograd history is left as it was.
    """
    if t.is_inference() or t._is_view():
        return False
    return not (t.is_leaf and t.requires_grad)


def aliasing_outputs(
    func_ctx: Any, outputs: list[torch.Tensor], inputs: Sequence[Any], versions: list[int]
) -> list[torch.Tensor]:
    """Transformer Engine's outputs: no copies; in-place-modified inputs returned as such.

    ``inputs`` are the caller's tensors (main input, extra inputs), ``versions`` their
    version counters before the forward. An output that aliases an input whose counter
    moved (the ops wrote into it through ``detach()``) is replaced by that input, which
    is marked dirty: autograd then records the write (the caller's tensor gets the
    fuser as its ``grad_fn``), so later uses of it by the caller are differentiated
    through the fuser, and a saved copy of the old values is caught by the version
    check. Views of tensors made inside the forward are still returned detached (no
    copy), so the caller may modify them in place.
    """
    written = [
        t for t, v in zip(inputs, versions)
        if isinstance(t, torch.Tensor) and t._version != v and _may_mark_dirty(t)
    ]
    input_ids = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    result: list[torch.Tensor] = []
    dirty: dict[int, torch.Tensor] = {}
    for t in outputs:
        owner = next((w for w in written if _same_view(t, w)), None)
        if owner is not None:
            dirty[id(owner)] = owner
            t = owner
        elif id(t) not in input_ids and t._is_view() and id(t._base) not in input_ids:
            t = t.detach()
        result.append(t)
    if dirty:
        func_ctx.mark_dirty(*dirty.values())
    return result
