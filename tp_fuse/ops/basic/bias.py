"""``Bias``: add a learnable vector over the last dimension."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...kernels._common import as_dtype, as_rows
from ...kernels.dispatch import takes_cuda_path
from ..op import BasicOperation, OperationContext
from ._checks import check_tensor, compute_dtype, maybe_dequantize, param_dtype
from ._tp import group_size


class Bias(BasicOperation):
    """Learnable bias added over the last dimension: ``y = x + b``.

    Shapes: ``x [..., size]``, ``b [size]``, ``y [..., size]``.

    Equations:
        forward:  y  = x + b
        backward: dx = dy,  db = sum of dy over every dimension but the last

    Nothing is saved for the backward pass. ``db`` is accumulated in float32
    (float64 for float64 inputs) and returned in the parameter's dtype.
    Parameter: ``bias`` (initialized to zeros).

    Tensor parallelism (Transformer Engine's arguments): with ``tensor_parallel=True``
    ``size`` is the GLOBAL size, split evenly over ``tensor_parallel_group`` (the default
    group when None); this rank holds ``size / tp`` values. As for ``BasicLinear``, the
    attribute ``size`` (and TE's ``local_size``) is this rank's size after construction;
    ``global_size`` keeps the argument. Without torch.distributed the TP size is 1.
    """

    def __init__(
        self,
        size: int,
        *,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        tensor_parallel: bool = False,
        tensor_parallel_group: Optional[Any] = None,
    ) -> None:
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"Bias: size must be a positive int, got {size!r}")
        if not isinstance(tensor_parallel, bool):
            raise ValueError(f"Bias: tensor_parallel must be a bool, got {tensor_parallel!r}")
        tp = group_size(tensor_parallel_group) if tensor_parallel else 1
        if size % tp:
            raise ValueError(
                f"Bias: size={size} is not divisible by the tensor-parallel size {tp} "
                "(tensor_parallel=True splits the bias evenly over the group)"
            )
        self.tensor_parallel = tensor_parallel and tp > 1
        self.tensor_parallel_group = tensor_parallel_group if tensor_parallel else None
        self.tensor_parallel_size = tp
        self.global_size = size
        self.size = size // tp
        self.bias = torch.nn.Parameter(
            torch.zeros(self.size, device=device, dtype=param_dtype("Bias", dtype))
        )

    @property
    def local_size(self) -> int:
        """This rank's number of bias values (Transformer Engine's name; = ``size``)."""
        return self.size

    def reset_parameters(self) -> None:
        """Zero the bias (the usual initialization for biases, as in Transformer Engine)."""
        with torch.no_grad():
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"size={self.size}"

    # ---- validation and math shared with fused ops ----------------------

    def input_dtype(self, autocast_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
        """torch.autocast's dtype, else the bias's: the fuser casts the input to it."""
        return autocast_dtype or self.bias.dtype

    def check_input_spec(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """Validate an input described by shape/dtype/device.

        Fused ops (e.g. bias in a GEMM epilogue) call this with the GEMM's
        output description before computing, so they raise exactly what
        ``Bias`` would. ``dtype`` is not checked: the bias is cast to the input's
        dtype (under ``torch.autocast`` they differ).
        """
        # (messages formatted on failure only: this runs on every call)
        if not (len(shape) >= 1 and shape[-1] == self.size):
            raise ValueError(f"Bias: expected last dimension {self.size}, got input of shape {tuple(shape)}")
        if device != self.bias.device:
            raise ValueError(f"Bias: input on {device}, bias on {self.bias.device}")

    def check_input(self, x: torch.Tensor) -> None:
        check_tensor("Bias", x)
        self.check_input_spec(tuple(x.shape), x.dtype, x.device)

    def bias_grad(self, dy: torch.Tensor) -> Optional[torch.Tensor]:
        """``db = sum(dy)`` over all but the last dim; None when the bias is frozen.

        Fused backward ops call this too, so ``db`` is bit-identical either way.
        """
        if not self.bias.requires_grad:
            return None
        dy2d = as_rows(dy, self.size)
        # Accumulate wide: a bf16 sum over many rows would lose the small terms. CUDA's
        # reduction kernels accumulate 16-bit inputs in fp32 and round once: one kernel.
        # (CPU's do too for bf16 but not in every vectorized path: summed in fp32 here.)
        if takes_cuda_path(dy2d.device) and dy2d.dtype == self.bias.dtype:
            return dy2d.sum(dim=0)
        return as_dtype(dy2d.sum(dim=0, dtype=compute_dtype(dy.dtype)), self.bias.dtype)

    # ---- basic-op interface ----------------------------------------------

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, **unused: Any) -> torch.Tensor:
        x = maybe_dequantize(input_)
        self.check_input(x)
        return x + self.bias.to(x.dtype)

    def op_backward(
        self, ctx: OperationContext, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor]]]:
        return grad_output, (self.bias_grad(grad_output),)

    # ---- torch.compile (tp_fuse/ops/compiled/basic.py) ------------------------

    def compiled_forward(
        self, x: torch.Tensor, extra_inputs: list[torch.Tensor], fp8: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Traced: ``y = x + b`` (b in x's dtype; autograd sums dy into db). A ``Bias``
        right after an FP8 ``BasicLinear`` on the CUDA path is its GEMM's epilogue
        instead (``BasicLinear.compiled_folds_bias``)."""
        self.check_input(x)
        return x + self.bias.to(x.dtype), []
