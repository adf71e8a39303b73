"""FP8 parameters with a high-precision master copy (``quantized_model_init``).

Design: the parameter IS a :class:`Float8Tensor` (``nn.Parameter`` accepts
wrapper subclasses: it detaches the tensor and flags it ``_is_param``, so
``isinstance(p, nn.Parameter)`` holds and modules register it normally). It
additionally carries

* ``master``: a plain high-precision tensor, the value the optimizer trains;
* ``quantizer``: the op's weight quantizer, used to re-quantize the master.

``torch.optim`` updates parameters with in-place ops -- ``p.mul_``,
``p.addcdiv_`` on the single-tensor path, ``torch._foreach_mul_`` /
``torch._foreach_addcdiv_`` on the foreach path. ``Float8Tensor``'s
``__torch_dispatch__`` routes every in-place op on such a parameter to the
master and then re-quantizes the FP8 bytes in place, so both optimizer paths
work unmodified and the FP8 data tracks the master within FP8 error. Optimizer
state (``zeros_like(p)``) comes out as plain high-precision tensors, and
``p.grad`` is a plain high-precision tensor of the nominal dtype.

Ops that consume an FP8 parameter use it as is (no re-quantization in
forward). With a delayed-scaling weight quantizer they should still call
``autocast_ctx.track_forward(param.quantizer)`` so the weight scale follows the
amaxes recorded at each re-quantization.

``load_state_dict`` copies master to master (lossless); ``copy.deepcopy`` and
``module.to(dtype/device)`` keep the parameter FP8 (the master and nominal
dtype follow). ``torch.save`` pickles the quantizer with the parameter, so it
needs a picklable recipe (no lambdas as ``amax_compute_algo``).
"""

from __future__ import annotations

import torch

from .block.quantizer import BlockScalingQuantizer
from .block.tensor import BlockScaledTensor
from .float8.tensor import Float8Tensor
from .float8.delayed_scaling import DelayedScalingQuantizer
from .quantizer import Quantizer

__all__ = ["make_fp8_parameter", "is_fp8_parameter"]


def make_fp8_parameter(
    master: torch.Tensor, quantizer: Quantizer, requires_grad: bool = True
) -> torch.nn.Parameter:
    """An ``nn.Parameter`` holding ``master`` in FP8, trained through its master.

    Args:
        master: high-precision initial value; it becomes the master copy (it is
            detached, not copied).
        quantizer: the op's weight quantizer. A fresh delayed-scaling quantizer
            (all-zero history) is first calibrated on ``master`` -- its amax is
            recorded and the scale updated once -- so the initial FP8 weights use
            a sensible scale instead of 1.0. At init this amax is not reduced
            across ranks; the first step's reduction aligns the scales.
        requires_grad: autograd flag of the parameter.
    """
    if isinstance(master, (Float8Tensor, BlockScaledTensor)):
        raise ValueError("make_fp8_parameter master: expected a high-precision tensor, got Float8Tensor")
    if not isinstance(master, torch.Tensor) or not master.dtype.is_floating_point:
        raise ValueError(
            "make_fp8_parameter master: expected a floating-point tensor, got "
            f"{getattr(master, 'dtype', type(master).__name__)}"
        )
    if not isinstance(quantizer, Quantizer):
        raise ValueError(
            f"make_fp8_parameter quantizer: expected a Quantizer, got {type(quantizer).__name__}"
        )
    master = master.detach()
    if not master.is_contiguous():
        master = master.contiguous()
    if isinstance(quantizer, BlockScalingQuantizer):
        # Both copies from the master: fprop reads the row-wise one, dgrad the column-wise.
        with torch.no_grad():
            q = quantizer.quantize(master, transpose=True)
        blocked = BlockScaledTensor(
            master.shape, master.dtype, q._rowwise, q._columnwise, q.recipe_name, master=master, quantizer=quantizer
        )
        return torch.nn.Parameter(blocked, requires_grad=requires_grad)
    with torch.no_grad():
        if isinstance(quantizer, DelayedScalingQuantizer) and not bool(quantizer.amax_history.any()):
            quantizer.quantize(master)
            quantizer.update()
        q = quantizer.quantize(master)
    fp8 = Float8Tensor(q._fp8, q._sinv, master.dtype, master=master, quantizer=quantizer)
    return torch.nn.Parameter(fp8, requires_grad=requires_grad)


def is_fp8_parameter(t: object) -> bool:
    """Whether ``t`` is an FP8 parameter with a master copy."""
    return isinstance(t, (Float8Tensor, BlockScaledTensor)) and t._master is not None

