"""A group of basic ops and its fusion decisions: what the fuser runs, decided without running.

:class:`OpGroup` flattens the ops into basic ops, routes their extra tensors
(:mod:`tp_fuse.ops.channels`) and decides the fusions for the FP8 recipe in force
(:meth:`OpGroup.maybe_fuse`, with the registered fusion functions of
:mod:`tp_fuse.ops.fusion`). :class:`~tp_fuse.ops.fuser.OperationFuser` builds on it and runs the
group; the compiled path (``ops/compiled``) and ``explain`` read the decisions. The
compiled overlap windows (``ops/compiled/overlap.py``) make a group of their own to ask
for the eager decision, which is why the decisions sit below the fuser: the fuser's
compiled path reaches those windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import fusion as fusion_registry
from .channels import ChannelRouting
from .fusion import FusionLog, call_fusion
from .op import BasicOperation, FusibleOperation, count_params
from ..overlap.userbuffers_setup import ub_generation
from ..quantization import active_autocast

__all__ = ["OpGroup", "OpRun", "current_recipe"]

# Fused ops as stored by a group: the op and the indices of its basic ops.
OpRun = tuple[FusibleOperation, list[int]]


def _fusion_key() -> Any:
    """What the fusion decisions depend on: the FP8 recipe in force (or none), and the
    overlap objects ``initialize_ub`` registered (once it has been called)."""

    state = active_autocast()
    key = None if state is None else state.fusion_key
    generation = ub_generation()
    return key if generation == 0 else (key, generation)


def current_recipe() -> Any:
    """The FP8 recipe of the ``autocast`` in force, or None."""
    state = active_autocast()
    return None if state is None else state.recipe


class OpGroup:
    """Basic ops in order, their extra-tensor routing, and their fusion decisions.

    ``ops`` may contain fused containers (e.g. ``Linear``); they are flattened into basic
    ops. Fusion functions registered with ``register_forward_fusion`` /
    ``register_backward_fusion`` are applied in registration order; the result must cover
    the basic ops exactly and in order.
    """

    def __init__(self, ops: Sequence[FusibleOperation], *, expand: bool = True) -> None:
        # expand=False: ``ops`` are another fuser's ``basic_ops``, already expanded (a
        # BasicLinear with tensor_parallel_mode would add its collectives a second time).
        basic_ops: list[BasicOperation] = []
        for op in ops:
            if not isinstance(op, FusibleOperation):
                raise ValueError(f"OperationFuser expects FusibleOperations, got {type(op).__name__}")
            basic_ops.extend(op.expanded_ops() if expand else op.basic_op_list)
        if not basic_ops:
            raise ValueError("OperationFuser needs at least one operation")
        self.basic_ops: list[BasicOperation] = basic_ops
        self.params_per_op = [count_params(op) for op in basic_ops]
        self.num_params = sum(self.params_per_op)
        # Named channels (validated here) decide which extra tensors the caller passes
        # and receives; the bindings are frozen from now on, as in Transformer Engine.
        self.routing = ChannelRouting(basic_ops)
        for op in basic_ops:
            op._lock_extra_tensor_channels()
        self.num_extra_inputs = len(self.routing.external_input_slots)
        self.num_extra_outputs = len(self.routing.public_output_slots)
        # Whether any basic op has extra inputs or outputs (channels, caller-passed
        # tensors): without them the per-call routing steps have nothing to do.
        self.has_extra_tensors = any(op.num_extra_inputs or op.num_extra_outputs for op in basic_ops)
        # An op with TE's in_place=True: the caller asked for aliases, so outputs are the
        # caller's tensors, not copies (tp_fuse/ops/output_aliasing.py).
        self.returns_aliases = any(op.aliases_caller_tensors for op in basic_ops)
        self.forward_ops: list[OpRun] = []
        self.backward_ops: list[OpRun] = []
        self.fusion_log = FusionLog()
        self._fusion_key: Any = ()  # never equal to a real key: fuse on first call
        self._fusion_recipe: Any = None  # the recipe the current decisions were made for

    def maybe_fuse(self, recipe: Any = None, key: Any = ()) -> None:
        """(Re)decide fusions if the recipe in force changed since last time."""
        if key == ():
            key, recipe = _fusion_key(), current_recipe()
        if key == self._fusion_key:
            return
        self.fusion_log = FusionLog()
        # Joint fusions first: their fused ops run both passes and are what the
        # forward-only and backward-only fusions then see.
        joint = self._apply(fusion_registry.forward_backward_fusions(), "both", recipe, self.basic_ops)
        self.forward_ops = self._runs(
            self._apply(fusion_registry.forward_fusions(), "forward", recipe, joint)
        )
        self.backward_ops = self._runs(
            self._apply(fusion_registry.backward_fusions(), "backward", recipe, joint)
        )
        self._fusion_key = key
        self._fusion_recipe = recipe

    def _positions(self) -> dict[int, int]:
        return {id(op): i for i, op in enumerate(self.basic_ops)}

    def _apply(
        self, functions, direction: str, recipe: Any, ops: Sequence[FusibleOperation]
    ) -> list[FusibleOperation]:
        positions = self._positions()
        ops = list(ops)
        for func in functions:
            self.fusion_log.begin(direction, func, positions)
            logged = len(self.fusion_log.records)
            before = {id(op) for op in ops}
            ops = call_fusion(func, ops, recipe, self.fusion_log)
            self._verify_cover(ops, func)
            if len(self.fusion_log.records) == logged:
                # A function that keeps no log (Transformer Engine's signature): explain
                # still lists what it fused, without a reason.
                for op in ops:
                    if id(op) not in before:
                        self.fusion_log.fused([op], "fused by a fusion function that gives no reason")
        return ops

    def _runs(self, ops: list[FusibleOperation]) -> list[OpRun]:
        positions = self._positions()
        return [(op, [positions[id(b)] for b in op.basic_op_list]) for op in ops]

    def _verify_cover(self, ops: list[FusibleOperation], func: Any) -> None:
        flat = [b for op in ops for b in op.basic_op_list]
        same = len(flat) == len(self.basic_ops) and all(
            a is b for a, b in zip(flat, self.basic_ops)
        )
        if not same:
            got = ", ".join(type(b).__name__ for b in flat)
            want = ", ".join(type(b).__name__ for b in self.basic_ops)
            name = getattr(func, "__name__", repr(func))
            raise RuntimeError(
                f"fusion function {name} must cover the basic ops exactly and in order; "
                f"expected [{want}], got [{got}]"
            )
