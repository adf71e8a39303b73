"""Activations with a per-row post-scale (Transformer Engine's grouped-MLP middle ops):
``ScaledSwiGLU``, ``ScaledSiTUGLU``, ``ScaledClampedQGeGLU`` and ``ScaledSReLU``.

Each wraps one of the plain activations (``SwiGLU``, ``SiTUGLU``, ``ClampedSwiGLU``,
``SReLU``) and multiplies its output by a scale per row, passed as an extra input
(MoE router probabilities): ``y = seq(x, scales)``. The activation math, the GLU
layouts (``glu_interleave_size``) and the checks are the wrapped op's; this file adds
only the scale.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..op import BasicOperation, OperationContext, require
from ._checks import check_tensor, compute_dtype, maybe_dequantize
from .activation import _ActivationOperation, SReLU
from .gated_activation import SwiGLU, ClampedSwiGLU, SiTUGLU

__all__ = ["ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU", "ScaledSReLU"]


class _ScaledActivation(BasicOperation):
    r"""``y = act(x) * scales[..., None]``, with ``act`` a wrapped plain activation.

    Shapes: ``x [..., m]``, ``scales [...]`` (``x``'s shape without the last dim),
    ``y [..., n]`` with ``n = m/2`` for gated units, ``m`` otherwise.

    Equations, with ``a = act(x)`` and ``act'`` the wrapped op's backward:
        forward:  y       = a * s[..., None]
        backward: dx      = act'(x, dy * s[..., None])
                  dscales = sum(a * dy, last dim)     (only when scales need a gradient)

    Saved for backward: ``x`` and ``scales``; the backward re-runs the activation
    forward (one elementwise pass) instead of keeping ``a`` alive between the passes.
    The activation, the product with the scale and the scale's gradient are computed in
    float32 (float64 for float64 inputs) and rounded once to the input dtype.
    """

    num_extra_inputs: int = 1

    def __init__(self, activation: _ActivationOperation, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the wrapped op holds no state and must not
        # show up as a second op in module listings.
        self.__dict__["_activation"] = activation
        self.activation_recompute_in_mlp = bool(activation_recompute_in_mlp)

    @property
    def activation(self) -> _ActivationOperation:
        """The wrapped plain activation (its math and layout options)."""
        return self.__dict__["_activation"]

    @property
    def glu_interleave_size(self) -> Optional[int]:
        return getattr(self.activation, "glu_interleave_size", None)

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype (the fuser casts the input to it), else no cast."""
        return autocast_dtype

    def _check_recompute(self) -> None:
        if self.activation_recompute_in_mlp:
            raise RuntimeError(
                f"{type(self).__name__}(activation_recompute_in_mlp=True) requires the fused grouped "
                "MLP path (Transformer Engine's CUDA-only cuDNN kernels), which tp_fuse does not have; "
                "build the op with activation_recompute_in_mlp=False"
            )

    def _scales_for(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        check_tensor(name, scales, "scales (extra input)")
        require(
            tuple(scales.shape) == tuple(x.shape[:-1]),
            f"{name}: scales must have the input's shape without its last dimension "
            f"{tuple(x.shape[:-1])}, got {tuple(scales.shape)}",
        )
        require(scales.device == x.device, f"{name}: scales on {scales.device}, input on {x.device}")
        return scales

    def _activation_out(self, x: torch.Tensor, requires_grad: bool) -> tuple[torch.Tensor, OperationContext]:
        """``act(x)`` and the wrapped op's ctx (filled when ``requires_grad``)."""
        ctx = OperationContext()
        ctx.requires_grad = requires_grad
        a = self.activation.op_forward(ctx, x)
        ctx.saved_tensors, ctx.to_save = tuple(ctx.to_save or ()), None
        return a, ctx

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        self._check_recompute()
        x = maybe_dequantize(input_)
        scales_in = basic_op_extra_inputs[0][0]
        scales = self._scales_for(x, maybe_dequantize(scales_in))
        cdtype = compute_dtype(x.dtype)
        a, _ = self._activation_out(x.to(cdtype), requires_grad=False)
        y = (a * scales.to(cdtype).unsqueeze(-1)).to(x.dtype)
        ctx = basic_op_ctxs[0]
        if ctx.requires_grad:
            ctx.save_for_backward(x, scales)
            ctx.scales_requires_grad = scales_in.requires_grad
        return y, [()]

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]], list[tuple[Optional[torch.Tensor]]]]:
        ctx = basic_op_ctxs[0]
        x, scales = ctx.saved_tensors
        dy = maybe_dequantize(grad_output)
        cdtype = compute_dtype(x.dtype)
        a, act_ctx = self._activation_out(x.to(cdtype), requires_grad=True)
        dy_c = dy.to(cdtype)
        dx = self.activation.activation_backward(act_ctx, dy_c * scales.to(cdtype).unsqueeze(-1)).to(x.dtype)
        dscales = None
        if ctx.scales_requires_grad:
            dscales = (a * dy_c).sum(dim=-1).to(scales.dtype)
        return dx, [()], [(dscales,)]


class ScaledSwiGLU(_ScaledActivation):
    """SwiGLU with a per-row post-scale: ``y = silu(a) b * scales[..., None]`` (see
    ``SwiGLU`` for the gate/value layout and ``_ScaledActivation`` for the shapes and
    gradients). ``activation_recompute_in_mlp=True`` is refused, as in Transformer Engine.
    """

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False) -> None:
        _refuse_glu_recompute(type(self).__name__, activation_recompute_in_mlp)
        super().__init__(SwiGLU(glu_interleave_size=glu_interleave_size))


class ScaledSiTUGLU(_ScaledActivation):
    """SiTU-GLU (``SiTUGLU``'s soft caps ``beta1``, ``beta2``) with a per-row post-scale."""

    def __init__(
        self,
        glu_interleave_size: Optional[int] = None,
        *,
        activation_recompute_in_mlp: bool = False,
        beta1: float = 4.0,
        beta2: float = 25.0,
    ) -> None:
        _refuse_glu_recompute(type(self).__name__, activation_recompute_in_mlp)
        super().__init__(SiTUGLU(beta1=beta1, beta2=beta2, glu_interleave_size=glu_interleave_size))

    @property
    def beta1(self) -> float:
        return self.activation.beta1

    @property
    def beta2(self) -> float:
        return self.activation.beta2


class ScaledClampedQGeGLU(_ScaledActivation):
    """Clamped quick-GELU GLU (``ClampedSwiGLU``'s numerics: ``limit``, ``alpha``,
    ``glu_linear_offset``) with a per-row post-scale."""

    def __init__(
        self,
        glu_interleave_size: Optional[int] = None,
        *,
        activation_recompute_in_mlp: bool = False,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
    ) -> None:
        _refuse_glu_recompute(type(self).__name__, activation_recompute_in_mlp)
        super().__init__(
            ClampedSwiGLU(
                limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset, glu_interleave_size=glu_interleave_size
            )
        )


class ScaledSReLU(_ScaledActivation):
    """Squared ReLU with a per-row post-scale: ``y = relu(x)^2 * scales[..., None]``.

    ``activation_recompute_in_mlp`` is accepted and stored (Transformer Engine's knob for
    its fused grouped MLP); running with it set raises, since that path does not exist here.
    """

    def __init__(self, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__(SReLU(), activation_recompute_in_mlp=activation_recompute_in_mlp)


def _refuse_glu_recompute(name: str, activation_recompute_in_mlp: bool) -> None:
    if activation_recompute_in_mlp:
        raise ValueError(
            f"{name} does not support activation recomputation in the fused grouped MLP "
            "(activation_recompute_in_mlp must be False)"
        )
