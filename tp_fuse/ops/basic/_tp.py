"""Shared helpers of the tensor-parallel communication ops (``AllGather``, ``ReduceScatter``,
``AllReduce``): the process group, the TP size, the overlap settings, and shape checks."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.comm import ShapeAgreement

from ...overlap.config import TPOverlap
from ...overlap.userbuffers_setup import registered_overlap
from ..op import BasicOperation


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialized)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 1
    return dist.get_world_size(group)


def check_first_dim_divisible(op_name: str, x: torch.Tensor, size: int) -> None:
    """Local shape check done before any communication (so every rank raises)."""
    # (messages formatted on failure only: this runs on every call)
    if x.dim() < 1:
        raise ValueError(f"{op_name}: expected a tensor with a sequence dimension, got a scalar")
    if x.shape[0] % size:
        raise ValueError(f"{op_name}: first (sequence) dimension {x.shape[0]} is not divisible by the "
                         f"tensor-parallel size {size}")


class TPCommOperation(BasicOperation):
    """Base of the TP communication ops: a process group and optional overlap settings.

    Args:
        process_group: the tensor-parallel group (None: the default group; TP size 1 when
            torch.distributed is not initialized).
        overlap: a :class:`tp_fuse.overlap.config.TPOverlap` for the overlap fusion this op
            takes part in. The comm op is the one carrier of a window's ``TPOverlap``: the
            fusion matcher and the fused op read it here (:meth:`window_overlap`). (A
            ``BasicLinear``'s ``userbuffers_options["overlap"]`` is handed to its comm op
            when the window is matched: ``ops.fused.userbuffers_common.resolve_overlap``.)
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        overlap: Optional["TPOverlap"] = None,
    ) -> None:
        super().__init__()
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                f"{type(self).__name__}: process_group must be a torch.distributed.ProcessGroup "
                f"or None, got {type(process_group).__name__}"
            )
        if overlap is not None and not isinstance(overlap, TPOverlap):
            raise ValueError(
                f"{type(self).__name__}: overlap must be a tp_fuse.overlap.config.TPOverlap, "
                f"got {type(overlap).__name__}"
            )
        self.process_group = process_group
        self.overlap = overlap
        self._default_overlap: Optional["TPOverlap"] = None
        # Ranks that disagree on a shape raise ValueError on every rank instead of
        # aborting inside the backend; checked once per shape signature.
        self.shape_agreement = ShapeAgreement()

    def check_agreement(self, what: str, tensors: "list[torch.Tensor]", names: tuple[str, ...] = ("input",)) -> None:
        """All ranks pass the same shapes/dtypes (a collective the first time a signature is seen).

        Call it before this op's (or its fused op's) first collective, on every rank.
        """
        self.shape_agreement.check(self.process_group, what, tensors, names)

    @property
    def tp_size(self) -> int:
        return group_size(self.process_group)

    def window_overlap(self, quantized: bool, what: str) -> "TPOverlap":
        """The ``TPOverlap`` of this op's overlap window: the one given to this op, else the
        one Transformer Engine's ``initialize_ub`` registered for the window's quantization
        mode (``quantized``: it runs under an FP8 recipe; ValueError for a missing mode or
        another TP size, naming ``what``), else this op's own default."""
        if self.overlap is not None:
            return self.overlap
        return registered_overlap(quantized, self.tp_size, what) or self.default_overlap()

    def default_overlap(self) -> "TPOverlap":
        """This op's own ``TPOverlap()`` (created on first use; owns its workspace pool)."""
        if self._default_overlap is None:
            self._default_overlap = TPOverlap()
        return self._default_overlap

    def extra_repr(self) -> str:
        return f"tp_size={self.tp_size}" if dist.is_available() and dist.is_initialized() else ""
