"""Forward fusion ``[BasicLinear(, Bias), AllReduce]``: row-parallel GEMM with its
all-reduce overlapped chunk by chunk (tensor parallelism without sequence parallelism)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...overlap.algorithms import Window, WindowOperands, run_algorithm
from ...quantization import active_autocast
from ..basic._checks import maybe_dequantize
from ..basic.all_reduce import AllReduce
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..op import OperationContext, require
from .userbuffers_common import (
    UserbuffersLinearBase,
    gemm_label,
    gemm_then_reduce_operands,
    precision_label,
    run_planned,
)


class UserbuffersForwardLinearAllReduce(UserbuffersLinearBase):
    """Forward pass of ``BasicLinear(, Bias), AllReduce`` with the all-reduce overlapped.

    ======== ============================ ==============================================
    tensor   shape                        notes
    ======== ============================ ==============================================
    x        ``[rows, ..., in/tp]``       this rank's input features
    W        ``[out, in/tp]``
    b        ``[out]``                    added on every rank before the sum, as in the
                                          unfused op order
    y        ``[rows, ..., out]``         ``y = all_reduce(x W^T + b)``
    ======== ============================ ==============================================

    Overlap (``<name>_fprop`` method ``pipeline``, ``tp_fuse.comm.gemm_all_reduce_chunked``): the
    rows are split into ``num_splits`` chunks; chunk i's all-reduce runs (in place on
    its output rows) while chunk i+1's GEMM computes; only the last chunk's all-reduce
    is exposed (``auto``: chunk counts and ``unfused``, GEMM then all-reduce, are measured
    at the first call with a new shape; ``tp_fuse.overlap.auto``). Under ``tp_fuse.autocast`` the GEMM chunks run in FP8
    (``torch._scaled_mm``); the all-reduce stays in high precision (partial sums without
    an FP8 scale; collectives cannot add FP8 numbers).

    Forward only: the backward is BasicLinear's (``AllReduce``'s backward is the
    identity), filled from the context saved here exactly as ``BasicLinear`` saves it.
    """

    def fusion_summary(self) -> str:
        prec = "; FP8 GEMM chunks, all-reduce in high precision" if self.fp8 else ""
        return f"GEMM+AllReduce {gemm_label(self.linear)}, {self.plan.describe()} chunks, {self.tp_label}{prec}"

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:


        linear, ar = self.basic_ops[0], self.basic_ops[-1]
        bias_op = self.basic_ops[1] if len(self.basic_ops) == 3 else None
        assert isinstance(linear, BasicLinear) and isinstance(ar, AllReduce)
        lin_ctx = basic_op_ctxs[0]
        x = input_
        require(x.dim() >= 1, f"{type(self).__name__}: expected a tensor with at least one dimension")
        fp8 = linear.fp8_quantizers(x) is not None
        if not fp8:
            x = maybe_dequantize(x)
        # Checks before any other communication.
        linear.check_input(x)
        ar.check_agreement("GEMM+AllReduce", [x, linear.weight], ("input", "weight"))
        out_shape = (*x.shape[:-1], linear.out_features)
        wire, gemm, saved = gemm_then_reduce_operands(linear, bias_op, lin_ctx, x, out_shape, fp8)
        group = ar.process_group

        operands = WindowOperands(
            wire, gemm, group, None, out_features=linear.out_features, out_dtype=x.dtype, name=self.plan.key,
            check_shapes=self.plan.overlap.check_shapes,
        )
        y2d = run_planned(
            self.plan, functools.partial(run_algorithm, Window.GEMM_ALL_REDUCE, operands=operands),
            rows=wire.shape[0], group=group, x=x,
            precision=precision_label(active_autocast().recipe if fp8 else None),
        )
        lin_ctx.input_shape = x.shape
        if lin_ctx.requires_grad:
            lin_ctx.save_for_backward(*saved)
        return y2d.view(out_shape), [() for _ in self.basic_ops]
