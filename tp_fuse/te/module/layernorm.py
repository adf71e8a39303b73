"""``LayerNorm`` and ``RMSNorm``: Transformer Engine's norm modules
(``transformer_engine.pytorch.LayerNorm`` / ``.RMSNorm``, paths ``module.layernorm`` /
``module.rmsnorm``) as thin constructors over ``tp_fuse.ops.LayerNorm`` / ``ops.RMSNorm``.

TE's signatures: ``LayerNorm(normalized_shape, eps=1e-5, sequence_parallel=None,
params_dtype=None, zero_centered_gamma=False, device="cuda", **kwargs)`` (TE also accepts the
old name ``hidden_size`` for ``normalized_shape``); RMSNorm the same without a bias.
Parameters ``weight`` (and ``bias``), each with the attribute ``sequence_parallel`` that
Megatron reads to all-reduce their gradients over TP under sequence parallelism (TE sets it
the same way); ``zero_centered_gamma`` stores ``weight`` as ``gamma - 1`` (initialized to 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional, Union

import torch

from tp_fuse.ops.basic.layer_norm import LayerNorm as LayerNormOp
from tp_fuse.ops.basic.rmsnorm import RMSNorm as RMSNormOp
from ._ops_module import OpsModule, refuse_unless

__all__ = ["LayerNorm", "RMSNorm"]


def _shape(cls: str, normalized_shape: Any, kwargs: dict[str, Any]) -> Any:
    """TE's ``normalized_shape``, or its deprecated alias ``hidden_size`` (one of the two)."""
    hidden_size = kwargs.pop("hidden_size", None)
    if hidden_size is not None:
        if normalized_shape is not None:
            raise ValueError(f"{cls}: give normalized_shape or hidden_size, not both")
        normalized_shape = hidden_size
    if normalized_shape is None:
        raise ValueError(f"{cls}: normalized_shape (or hidden_size) is required")
    if kwargs:
        raise ValueError(f"{cls}: unexpected arguments {sorted(kwargs)}")
    return normalized_shape


class _Norm(OpsModule):
    """One norm op under TE's parameter names; ``forward(inp)``."""

    _op_class: type = LayerNormOp
    _param_names: tuple[str, ...] = ("weight", "bias")

    def __init__(self, normalized_shape: Union[int, Iterable[int], None] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, device: Optional[Union[torch.device, str]] = None,
                 **kwargs: Any) -> None:
        super().__init__(None)
        cls = type(self).__name__
        normalized_shape = _shape(cls, normalized_shape, kwargs)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
            raise ValueError(f"{cls}: eps must be a non-negative float, got {eps!r}")
        if not isinstance(zero_centered_gamma, bool):
            raise ValueError(f"{cls}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
        refuse_unless(cls, "sequence_parallel", sequence_parallel in (None, True, False), sequence_parallel,
                      "None, True or False")
        dtype = params_dtype or torch.get_default_dtype()
        op = self._op_class(normalized_shape, float(eps), device=device, dtype=dtype,
                            zero_centered_gamma=zero_centered_gamma)
        self.eps = float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = bool(sequence_parallel)
        self.normalized_shape = tuple(op.weight.shape)
        self.tp_group = None
        self._bind(op, {n: (op, n) for n in self._param_names}, {})
        for n in self._param_names:
            # TE: Megatron all-reduces these gradients over TP when sequence_parallel is set.
            getattr(self, n).sequence_parallel = self.sequence_parallel

    # reset_parameters (TE's: weight 1, or 0 with zero_centered_gamma; bias 0; meta parameters
    # materialized) is OpsModule's.

    def reset_layer_norm_parameters(self) -> None:
        """TE's older name of :meth:`reset_parameters`."""
        self.reset_parameters()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The normalized ``inp`` over its last dims (``normalized_shape``); same shape."""
        self._sync()
        return self._ops(inp)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            raise ValueError(f"{type(self).__name__} _extra_state: a norm has no FP8 state, got {state!r}")

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}, "
                f"sequence_parallel={self.sequence_parallel}")


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * gamma + bias`` over the last dims, TE's ``LayerNorm``
    (see the module docstring); parameters ``weight``, ``bias``."""

    _op_class = LayerNormOp
    _param_names = ("weight", "bias")


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last dims, TE's ``RMSNorm``
    (see the module docstring); parameter ``weight``."""

    _op_class = RMSNormOp
    _param_names = ("weight",)
