"""``Reshape``: view the tensor with another shape."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..op import BasicOperation, OperationContext, require
from ._checks import maybe_dequantize


class Reshape(BasicOperation):
    """Reshape to ``shape`` (one entry may be -1), like ``torch.reshape``.

    Shapes: ``x [*in_shape] -> y [*shape]`` with ``prod(in_shape) == prod(shape)``.
    Equations: forward ``y = reshape(x, shape)``; backward ``dx = reshape(dy, in_shape)``.
    Saves the input shape (not a tensor) for backward.
    """

    def __init__(self, shape: Iterable[int]) -> None:
        super().__init__()
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, Iterable) or isinstance(shape, (str, bytes)):
            raise ValueError(f"Reshape: shape must be a sequence of ints, got {shape!r}")
        shape = tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < -1 for d in shape):
            raise ValueError(f"Reshape: shape entries must be ints >= -1, got {shape}")
        if sum(1 for d in shape if d == -1) > 1:
            raise ValueError(f"Reshape: at most one entry of shape may be -1, got {shape}")
        self.shape: tuple[int, ...] = shape

    def extra_repr(self) -> str:
        return f"shape={self.shape}"

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The concrete output shape for an input shape; ValueError if incompatible."""
        numel = math.prod(in_shape)
        known = math.prod(d for d in self.shape if d != -1)
        if -1 in self.shape:
            if known == 0 or numel % known != 0:
                raise ValueError(
                    f"Reshape: cannot reshape input of shape {tuple(in_shape)} to {self.shape}"
                )
            return tuple(numel // known if d == -1 else d for d in self.shape)
        if known != numel:
            raise ValueError(f"Reshape: cannot reshape input of shape {tuple(in_shape)} to {self.shape}")
        return self.shape

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        require(
            isinstance(input_, torch.Tensor),
            f"Reshape: expected a torch.Tensor input, got {type(input_).__name__}",
        )
        x = maybe_dequantize(input_)
        out_shape = self.output_shape(tuple(x.shape))
        ctx.input_shape = x.shape
        return x.reshape(out_shape)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        return grad_output.reshape(ctx.input_shape), ()
