"""Current scaling: :class:`CurrentScalingQuantizer`, whose scale comes from the tensor's
own amax (all-reduced MAX over its group, if any) at quantize time."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

from ... import kernels
from ...recipe import Float8CurrentScaling
from .. import scaling
from ..quantizer import (
    Quantizer,
    is_backward_role,
    move_state_before_capture,
    new_scale_inv,
    no_grad_if_enabled,
    with_transpose,
)
from .tensor import Float8Tensor

__all__ = ["CurrentScalingQuantizer"]


class CurrentScalingQuantizer(Quantizer):
    """Current scaling: ``scale = fp8_max / amax(|x|)`` computed at quantize time.

    With an ``amax_reduction_group`` the amax is all-reduced (MAX) over it first,
    so all ranks of the group quantize with one scale (required to all-gather
    FP8 bytes). A zero or non-finite amax gives scale 1.0; such amaxes are
    counted in ``zero_amax_count`` / ``nonfinite_amax_count`` for logging.
    ``power_2_scale`` rounds the scale down to a power of two.

    State (``scale``, ``last_amax``: fp32 0-d; the two counts: int64 0-d) lives on the
    device of the data, moved there at the first quantize, and is then only written in
    place by the cast (never rebound): a CUDA graph or compiled step that holds these
    buffers sees every update. On CUDA a quantize is two launches: the amax reduction
    (or the producer's amax) and the cast, which derives the scale from the amax and
    writes scale, ``scale_inv``, last amax and counts itself.
    """

    def __init__(
        self,
        recipe: Float8CurrentScaling,
        role: str,
        amax_reduction_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if not isinstance(recipe, Float8CurrentScaling):
            raise ValueError(
                "CurrentScalingQuantizer recipe: expected Float8CurrentScaling, got "
                f"{type(recipe).__name__}"
            )
        fmt = recipe.fp8_format
        super().__init__(fmt.bwd_dtype if is_backward_role(role) else fmt.fwd_dtype, role)
        self.recipe = recipe
        self.power_2_scale = recipe.power_2_scale
        self.amax_reduction_group = amax_reduction_group
        with torch.inference_mode(False):  # written in place by later steps
            self.scale = torch.ones((), dtype=torch.float32)
            self.last_amax = torch.zeros((), dtype=torch.float32)
            self.nonfinite_amax_count = torch.zeros((), dtype=torch.int64)
            self.zero_amax_count = torch.zeros((), dtype=torch.int64)

    def _empty_scale_inv(self, device: torch.device) -> torch.Tensor:
        # ``self.scale`` is the last tensor's scale, unrelated to a new tensor's values:
        # an empty tensor gets 1, its real scale comes with the first quantization.
        return torch.ones((), dtype=torch.float32, device=device)

    def _to_device(self, device: torch.device) -> None:
        # State follows the data on first use (modules may be moved after init); after
        # that it is only written in place.
        if self.scale.device != device:
            move_state_before_capture(self, ("scale", "last_amax", "nonfinite_amax_count", "zero_amax_count"), device)

    def reduces_at_cast(self) -> bool:
        group = self.amax_reduction_group
        return group is not None and dist.get_world_size(group) > 1

    def _reduce(self, amax: torch.Tensor) -> torch.Tensor:
        group = self.amax_reduction_group
        if group is None or dist.get_world_size(group) == 1:
            return amax
        # fp32 on the wire (gloo has no bf16 MAX; exact for any amax of bf16/fp16 values).
        amax = scaling.nan_to_inf(amax.float()).reshape(1)
        check_collective("all_reduce", [amax], world_size=dist.get_world_size(group), op=dist.ReduceOp.MAX)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax.reshape(())

    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> Float8Tensor:
        # One reduction kernel: the amax in x's dtype (exact).
        return self._quantize_with_own_amax(x, kernels.amax_of(x if not x.requires_grad else x.detach()), transpose)

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, *, transpose: bool = False) -> Float8Tensor:
        """Quantize with the scale from ``amax`` = this rank's max |x| (all-reduced
        over the amax group first), e.g. the amax a norm kernel computed in passing."""
        return self._quantize_with_own_amax(x, amax.detach(), transpose)

    def _quantize_with_own_amax(self, x: torch.Tensor, amax: torch.Tensor, transpose: bool) -> Float8Tensor:
        """:meth:`quantize_with_amax`: the cast derives the scale and writes the state."""
        with no_grad_if_enabled():
            self._to_device(x.device)
            amax = self._reduce(amax)
            scale_inv = new_scale_inv(x.device)
            # The cast kernels take >= 1 dims: a 0-d tensor is cast as shape [1] (as _cast does).
            data, data_t = kernels.quantize_current_scaling(
                x.reshape(1) if x.dim() == 0 else x, amax, self.fp8_dtype, scale_out=self.scale,
                scale_inv_out=scale_inv, last_amax_out=self.last_amax, nonfinite_count=self.nonfinite_amax_count,
                zero_count=self.zero_amax_count, power_2_scale=self.power_2_scale, transpose=transpose and x.dim() > 0,
            )
            if x.dim() == 0:
                data, data_t = data.reshape(()), data.reshape(1, 1) if transpose else None
        return with_transpose(Float8Tensor.wrap_checked(data, scale_inv, x.dtype), data_t)

    def stats(self) -> dict[str, float]:
        return {
            "amax": float(self.last_amax),
            "scale": float(self.scale),
            "scale_inv": float(1.0 / self.scale),
            "nonfinite_amax_count": float(self.nonfinite_amax_count),
            "zero_amax_count": float(self.zero_amax_count),
        }
