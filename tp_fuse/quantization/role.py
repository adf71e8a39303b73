"""``QuantizerRole``: which tensor slot a quantizer is for (Transformer Engine's name).

An op that quantizes tensors has one quantizer per slot: a linear layer's ``input`` and
``weight`` in the forward pass, its ``grad_output`` in the backward pass. A role names
such a slot with three free-form strings, so that code choosing quantizers (a recipe
factory, a test building reference tensors) can look at the fields it cares about::

    QuantizerRole(module_type="linear", tensor_type="weight", name="fc1")

Every field defaults to ``""`` ("not provided"); roles are frozen and hashable, so they
can key dictionaries. ``tensor_type`` uses the op's own vocabulary, which for linear
layers is the role name tp_fuse's quantizers already use (``"input"``, ``"weight"``,
``"grad_output"``): :func:`role_tensor_type` turns either form into that name.
"""

from __future__ import annotations

import dataclasses
from typing import Union

__all__ = ["QuantizerRole", "role_tensor_type"]


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """Identity of a tensor slot asking for a quantizer.

    Fields (all strings, ``""`` when not provided):

    * ``module_type``: the kind of op that owns the slot (``"linear"`` for
      ``BasicLinear``);
    * ``tensor_type``: which of its tensors is quantized (``"input"``, ``"weight"``,
      ``"grad_output"``);
    * ``name``: a caller-given instance name (``"fc1"``, ``"qkv"``).

    ``str(role)`` lists the fields that are set, ``"module_type=linear|tensor_type=weight"``,
    or ``"QuantizerRole()"`` when none is.
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, str):
                raise ValueError(
                    f"QuantizerRole.{field.name}: expected a string, got {type(value).__name__} {value!r}"
                )

    def __str__(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "|".join(parts) if parts else "QuantizerRole()"


def role_tensor_type(role: Union[str, QuantizerRole]) -> str:
    """The tensor-type name of ``role`` (a role name such as ``"weight"``, or a
    :class:`QuantizerRole`, whose ``tensor_type`` must then be set)."""
    if isinstance(role, QuantizerRole):
        if not role.tensor_type:
            raise ValueError(f"quantizer role {role}: tensor_type is empty; expected e.g. 'input', 'weight'")
        return role.tensor_type
    if isinstance(role, str) and role:
        return role
    raise ValueError(f"quantizer role: expected a non-empty string or a QuantizerRole, got {role!r}")
