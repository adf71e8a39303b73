"""``explain``: what the fuser did with a model, and why.

:func:`explain` finds the fusion groups of a module -- a :class:`~tp_fuse.ops.Sequential`'s,
a single fusible op's, or those of every Sequential inside any module -- and returns their
:class:`~tp_fuse.ops.explanation.Explanation` (the reports themselves, and what they say,
are :mod:`tp_fuse.ops.explanation`'s, re-exported here). It sits above the fuser and
``Sequential``, which it reads; they build on the reports, never on this module.
"""

from __future__ import annotations

import torch

from .explanation import Explanation, FuserExplanation, KernelPlan, op_kernels
from .fuser import OperationFuser
from .op import FusibleOperation
from .sequential import Sequential

__all__ = ["Explanation", "FuserExplanation", "KernelPlan", "explain", "op_kernels"]


def explain(module: torch.nn.Module) -> Explanation:
    """Explain the fusions of ``module``, saying which recipe the explanation is for.

    ``module`` may be a :class:`~tp_fuse.ops.Sequential`, a single fusible op,
    or any module containing Sequentials (each is explained, labelled with its
    qualified name). Inside ``tp_fuse.autocast(...)``: the decisions for that recipe.
    Outside autocast: what each group's last forward ran (FP8 if it ran in autocast),
    or high precision for a group that has not run yet. The header names the recipe
    and the basis (``[last forward]`` or ``[recipe in force]``).
    """
    if isinstance(module, Sequential):
        return module.explain()
    if isinstance(module, FusibleOperation):
        fuser = module.__dict__.get("_standalone_fuser") or OperationFuser([module])
        return Explanation.from_groups([(type(module).__name__, fuser.explain())])
    groups = []
    for name, sub in module.named_modules():
        if isinstance(sub, Sequential):
            groups.extend((f"{name}/{label}", g) for label, g in sub.explain_groups())
    if not groups:
        raise ValueError(
            f"explain: {type(module).__name__} contains no tp_fuse.ops.Sequential or fusible op"
        )
    return Explanation.from_groups(groups)
