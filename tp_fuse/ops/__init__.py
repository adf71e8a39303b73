"""The operation-fuser API (Transformer Engine's ``pytorch.ops`` names)."""

from . import basic, fused  # importing `fused` registers the built-in fusions
from .basic import *  # noqa: F401,F403
from .explain import explain
from .explanation import Explanation, FuserExplanation
from .fused import *  # noqa: F401,F403
from .fuser import OperationFuser
from .fusion import register_backward_fusion, register_forward_backward_fusion, register_forward_fusion
from .linear import Linear
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential


def _public_classes(module) -> list[str]:
    return [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]


__all__ = [
    "BasicOperation",
    "Explanation",
    "FusedOperation",
    "FusibleOperation",
    "FuserExplanation",
    "Linear",
    "OperationContext",
    "OperationFuser",
    "Sequential",
    "explain",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
    *_public_classes(basic),
    *_public_classes(fused),
]
