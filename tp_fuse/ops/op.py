"""Base classes of the operation fuser.

A *basic operation* implements one piece of math (a GEMM, a bias add, an
activation) with a forward and a backward pass. A *fused operation* replaces a
contiguous run of basic operations with a single implementation that must be
interchangeable with them: same outputs, same gradients, same side effects on
the basic ops' state. The :class:`~tp_fuse.ops.fuser.OperationFuser` decides
which fused operations to use; parameters and state always live in the basic
operations.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from ..quantization.quantizer import Quantizer, is_backward_role
from ..quantization.role import QuantizerRole
from .channels import ExtraTensorChannels


#: What runs an op called on its own (``op(x)``, outside a ``Sequential``): the fuser class,
#: registered by ``tp_fuse.ops.fuser`` when it is imported. The fuser builds on this module,
#: so this module names it only through the registration (``import tp_fuse.ops`` imports both).
_STANDALONE_FUSER: Optional[Callable[[list["FusibleOperation"]], Any]] = None


def register_standalone_fuser(fuser_type: Callable[[list["FusibleOperation"]], Any]) -> None:
    """Make ``fuser_type([op])`` the runner of an op called on its own (set by ``tp_fuse.ops.fuser``)."""
    global _STANDALONE_FUSER
    if not callable(fuser_type):
        raise ValueError(f"register_standalone_fuser: expected a fuser class, got {fuser_type!r}")
    _STANDALONE_FUSER = fuser_type


def standalone_fuser(ops: list["FusibleOperation"]) -> Any:
    """A new fuser over ``ops``, of the registered fuser class."""
    if _STANDALONE_FUSER is None:
        raise RuntimeError("no fuser is registered to run a standalone op: tp_fuse.ops.fuser registers "
                           "OperationFuser when it is imported (import tp_fuse.ops)")
    return _STANDALONE_FUSER(ops)


class OperationContext:
    """State carried from one basic op's forward pass to its backward pass.

    Mirrors the part of ``torch.autograd.Function``'s ctx that ops need:
    ``save_for_backward(*tensors)`` in forward, ``saved_tensors`` in backward,
    plus free-form attributes. Tensors saved here are routed through the
    fuser's autograd ctx so that autograd's in-place modification checks apply.
    """

    # Defaults as class attributes (immutable values): the fuser makes one context per
    # basic op per call, and an empty __init__ is the cheapest. Assigning shadows them.
    to_save: Optional[tuple[Optional[torch.Tensor], ...]] = None
    saved_tensors: tuple[Optional[torch.Tensor], ...] = ()
    # Whether any gradient is needed from this op's backward.
    requires_grad: bool = True
    # torch.autocast's dtype when the fuser was called inside torch.autocast, else
    # None (Transformer Engine's ctx.dtype); ops then compute in their own dtype.
    dtype: Optional[torch.dtype] = None
    # Set by the fuser before this op's backward: whether the gradient it receives
    # was allocated by the previous op's backward in the same fuser and is referenced
    # nowhere else, so the op may write its result into that buffer (on CPU a fresh
    # full-size buffer costs page faults; see OperationFuser's backward).
    grad_output_owned: bool = False
    # Set by an op's backward when the input gradient it returns is a tensor it just
    # allocated and keeps no reference to (a GEMM's output): the next op may own it.
    grad_input_fresh: bool = False

    def save_for_backward(self, *tensors: Optional[torch.Tensor]) -> None:
        self.to_save = tensors


class FusibleOperation(torch.nn.Module, metaclass=abc.ABCMeta):
    """A tensor operation that the operation fuser can run and fuse.

    Calling an op directly runs it through a one-op fuser, so ops behave like
    ordinary modules. Inside :class:`~tp_fuse.ops.Sequential`, adjacent ops are
    grouped and may be fused.
    """

    @property
    @abc.abstractmethod
    def is_fused_op(self) -> bool:
        """Whether this op stands for several basic ops."""

    @property
    def basic_op_list(self) -> list["BasicOperation"]:
        """The basic ops this op stands for, in order."""
        raise NotImplementedError

    def pre_first_fuser_forward(self) -> None:
        """Hook run once before the first forward pass through a fuser."""

    def expanded_ops(self) -> list["BasicOperation"]:
        """The basic ops a fuser runs for this op when a user puts it in a list: its
        ``basic_op_list``, plus any ops it implies (a ``BasicLinear`` with
        ``tensor_parallel_mode`` adds its collectives)."""
        return self.basic_op_list

    def get_quantizer(self, mode: str, index: int) -> Optional[Quantizer]:
        """This op's quantizer number ``index`` for ``mode`` (Transformer Engine's API).

        ``mode`` is ``"forward"`` (e.g. ``BasicLinear``: 0 input, 1 weight) or
        ``"backward"`` (0 grad_output). None when the op has no quantizer there yet:
        quantizers are built at the first forward under ``tp_fuse.autocast`` (or in
        ``quantized_model_init``).
        """
        if mode not in ("forward", "backward"):
            raise ValueError(f"get_quantizer mode: expected 'forward' or 'backward', got {mode!r}")
        quantizers = getattr(self, "_quantizers", None)
        roles = self._quantizer_role_names(mode)
        if not isinstance(index, int) or not 0 <= index < max(len(roles), 1):
            raise ValueError(
                f"{type(self).__name__}.get_quantizer: {mode} index must be in [0, {len(roles)}), got {index!r}"
            )
        if not roles:
            return None
        return quantizers.quantizers.get(roles[index])

    def _quantizer_role_names(self, mode: str) -> list[str]:
        """This op's quantizer role names for ``mode``, in ``get_quantizer`` index order."""
        if mode not in ("forward", "backward"):
            raise ValueError(f"quantizer mode: expected 'forward' or 'backward', got {mode!r}")
        quantizers = getattr(self, "_quantizers", None)
        if quantizers is None:
            return []
        return [r for r in quantizers.roles if is_backward_role(r) == (mode == "backward")]

    def num_quantizers(self, mode: str) -> int:
        """How many quantizers this op has for ``mode`` (Transformer Engine's API)."""
        return len(self._quantizer_role_names(mode))

    def get_quantizer_roles(self, mode: str) -> Optional[list[QuantizerRole]]:
        """One :class:`QuantizerRole` per quantizer of ``mode``, in ``get_quantizer``
        index order (``BasicLinear`` forward: input, weight; backward: grad_output), or
        None for an op without quantizers (Transformer Engine's API).

        ``module_type`` is the op's ``quantizer_module_type`` and ``name`` its ``name``
        attribute (``""`` when unset).
        """
        names = self._quantizer_role_names(mode)
        if not names:
            return None
        module_type = getattr(self, "quantizer_module_type", "") or ""
        name = getattr(self, "name", "") or ""
        return [QuantizerRole(module_type=module_type, tensor_type=r, name=name) for r in names]

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, Iterable[Iterable[torch.Tensor]]]:
        """Forward pass for the run of basic ops this op stands for.

        Returns the output and, per basic op, a tuple of its extra outputs.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no forward implementation; "
            "it can only be used as a backward fusion"
        )

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[
        Optional[torch.Tensor],
        Iterable[Iterable[Optional[torch.Tensor]]],
        Iterable[Iterable[Optional[torch.Tensor]]],
    ]:
        """Backward pass for the run of basic ops this op stands for.

        Returns the input gradient, per basic op the gradients of its
        parameters (in ``parameters()`` order), and per basic op the gradients
        of its extra inputs.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no backward implementation; "
            "it can only be used as a forward fusion"
        )

    def forward(self, input_: torch.Tensor, *extra_inputs: torch.Tensor, **kwargs: Any):
        fuser = self.__dict__.get("_standalone_fuser")
        if fuser is None:
            fuser = standalone_fuser([self])
            if not torch.compiler.is_compiling():  # see Sequential._make_module_groups
                # Plain attribute on purpose: the fuser is not a submodule.
                self.__dict__["_standalone_fuser"] = fuser
        basic_ops = self.expanded_ops()
        return fuser(input_, *extra_inputs, basic_op_kwargs=[kwargs] * len(basic_ops))


class BasicOperation(ExtraTensorChannels, FusibleOperation):
    """A single operation with its own forward and backward pass.

    Subclasses implement :meth:`op_forward` and :meth:`op_backward`; ops with
    extra inputs or outputs (``num_extra_inputs``/``num_extra_outputs``)
    override :meth:`fuser_forward`/:meth:`fuser_backward` instead. Extra slots can
    be wired to each other inside a fuser with ``set_extra_output_channel`` /
    ``set_extra_input_channel`` (see :mod:`tp_fuse.ops.channels`).

    Under ``torch.compile`` an op is traced by its ``compiled_forward(x, extra_inputs,
    fp8) -> (y, extra_outputs)`` method, written beside its eager code, when its own
    class defines one (a subclass, which may change the math, runs through the eager
    fuser unless it defines its own); :meth:`compiled_unsupported` says when it cannot
    (see :mod:`tp_fuse.ops.compiled.basic`).
    """

    #: Number of tensors this op takes besides the main input.
    num_extra_inputs: int = 0
    #: Number of tensors this op returns besides the main output.
    num_extra_outputs: int = 0

    @property
    def aliases_caller_tensors(self) -> bool:
        """Whether the caller asked this op for Transformer Engine's in-place aliasing
        (``AddExtraInput``/``MakeExtraOutput`` with ``in_place=True``): a fuser holding such
        an op returns the caller's tensors themselves, not copies (see ``fuser.py``)."""
        return False

    @property
    def is_fused_op(self) -> bool:
        return False

    @property
    def basic_op_list(self) -> list["BasicOperation"]:
        return [self]

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """The dtype the fuser casts this op's input to before it runs, or None (no cast).

        ``autocast_dtype`` is ``torch.autocast``'s dtype (None outside it). Ops that
        compute (GEMMs, norms, activations) return the autocast dtype, else the dtype of
        their parameters, as Transformer Engine's ops do; data-movement ops return None.
        The input's gradient is cast back to the input's dtype.
        """
        return None

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Forward pass; may save state in ``ctx`` for the backward pass."""
        raise NotImplementedError(f"{type(self).__name__} does not implement op_forward")

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[Optional[torch.Tensor], Iterable[Optional[torch.Tensor]]]:
        """Backward pass: returns ``(grad_input, param_grads)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement op_backward")

    def compiled_unsupported(self, fp8: Any) -> Optional[str]:
        """Why this op's ``compiled_forward`` cannot trace it under ``fp8`` (the traced
        ``CompileKey``, None: high precision), or None when it can. Asked only of ops
        whose class defines ``compiled_forward``."""
        return None

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        if self.num_extra_inputs or self.num_extra_outputs:
            raise NotImplementedError(
                f"{type(self).__name__} has extra inputs/outputs and must override fuser_forward"
            )
        output = self.op_forward(basic_op_ctxs[0], input_, **basic_op_kwargs[0])
        return output, [()]

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[Optional[torch.Tensor], list[Iterable[Optional[torch.Tensor]]], list[tuple[()]]]:
        if self.num_extra_inputs or self.num_extra_outputs:
            raise NotImplementedError(
                f"{type(self).__name__} has extra inputs/outputs and must override fuser_backward"
            )
        grad_input, grad_params = self.op_backward(basic_op_ctxs[0], grad_output)
        return grad_input, [grad_params], [()]


class FusedOperation(FusibleOperation):
    """An operation that stands for a run of basic operations.

    It is stateless: parameters and state stay in the basic ops, so a fused op
    can be created and dropped by the fuser at will. ``basic_ops`` may contain
    other fused ops (e.g. a ``Linear`` container); they are flattened.
    """

    def __init__(self, basic_ops: Iterable[FusibleOperation]) -> None:
        super().__init__()
        flat: list[BasicOperation] = []
        for op in basic_ops:
            if not isinstance(op, FusibleOperation):
                raise ValueError(
                    f"{type(self).__name__} expects FusibleOperations, got {type(op).__name__}"
                )
            flat.extend(op.basic_op_list)
        if not flat:
            raise ValueError(f"{type(self).__name__} needs at least one basic operation")
        # A plain tuple, not submodules: the fused op must not own parameters.
        self.__dict__["_basic_ops"] = tuple(flat)

    @property
    def is_fused_op(self) -> bool:
        return True

    @property
    def basic_ops(self) -> tuple[BasicOperation, ...]:
        return self.__dict__["_basic_ops"]

    @property
    def basic_op_list(self) -> list[BasicOperation]:
        return list(self.basic_ops)

    def pre_first_fuser_forward(self) -> None:
        for op in self.basic_ops:
            op.pre_first_fuser_forward()

    def extra_repr(self) -> str:
        return ", ".join(type(op).__name__ for op in self.basic_ops)


def count_params(op: BasicOperation) -> int:
    """Number of parameters a basic op owns (the length of its param-grad list)."""
    return sum(1 for _ in op.parameters())


def op_display_name(op: FusibleOperation, index: Optional[int] = None) -> str:
    """``Name[i]`` for messages; fused ops list their basic ops."""
    name = type(op).__name__
    if op.is_fused_op:
        name += "(" + "+".join(type(b).__name__ for b in op.basic_op_list) + ")"
    return name if index is None else f"{name}[{index}]"


def require(cond: bool, message: str) -> None:
    """Raise ValueError with ``message`` unless ``cond``: input validation in ops."""
    if not cond:
        raise ValueError(message)


def check_sequence_length(
    op: FusibleOperation, what: str, values: Sequence[Any], expected: int
) -> None:
    """Validate the length of a per-op return list (user-defined ops get it wrong)."""
    if len(values) != expected:
        raise RuntimeError(
            f"{type(op).__name__} returned {len(values)} {what}, expected {expected}"
        )
