"""Forward fusion ``[BasicLinear(, Bias), AllReduce]``: row-parallel GEMM with its
all-reduce overlapped chunk by chunk (tensor parallelism without sequence parallelism)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from tp_fuse.comm import all_reduce, gemm_all_reduce_chunked

from ...overlap.auto import UNFUSED, parse_label
from ...quantization import active_autocast
from ..basic._checks import maybe_dequantize
from ..basic.all_reduce import AllReduce
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..fusion import Fuse, FusionLog, MatchResult, Reject, fuse_by_window
from ..op import FusedOperation, FusibleOperation, OperationContext, require
from .userbuffers_common import (
    gemm_label,
    gemm_then_reduce_operands,
    match_gemm_then,
    plan_overlap,
    precision_label,
    reject_collective_without_gemm,
    run_planned,
)
from ...overlap.plan import OverlapPlan

_AR_FPROP_UNSUPPORTED = {
    "ring_exchange": "a GEMM+all-reduce overlaps by chunks (method pipeline, num_splits chunks); "
    "ring_exchange applies to all-gathers and reduce-scatters",
    "bulk": "bulk hides a collective behind an independent computation, but the all-reduce "
    "needs this GEMM's output; use pipeline",
}


class UserbuffersForwardLinearAllReduce(FusedOperation):
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

    def __init__(
        self,
        *,
        linear: BasicLinear,
        all_reduce: AllReduce,
        plan: OverlapPlan,
        bias: Optional[Bias] = None,
        fp8: bool = False,
    ) -> None:
        super().__init__([linear] + ([bias] if bias is not None else []) + [all_reduce])
        self.plan = plan
        self.fp8 = fp8  # for describing the fusion only

    def fusion_summary(self) -> str:
        linear = self.basic_ops[0]
        assert isinstance(linear, BasicLinear)
        prec = "; FP8 GEMM chunks, all-reduce in high precision" if self.fp8 else ""
        return f"GEMM+AllReduce {gemm_label(linear)}, {self.plan.describe()} chunks, TP={self.plan.tp_size}{prec}"

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

        def run(label: str) -> torch.Tensor:
            method, splits = parse_label(label)
            if method == "pipeline":
                return gemm_all_reduce_chunked(
                    wire,
                    gemm,
                    group,
                    num_splits=splits,
                    out_features=linear.out_features,
                    out_dtype=x.dtype,
                    check_shapes=self.plan.overlap.check_shapes,
                )
            assert label == UNFUSED, label  # no overlap: one GEMM, then the all-reduce
            out = torch.empty(wire.shape[0], linear.out_features, dtype=x.dtype, device=x.device)
            return all_reduce(gemm(wire, out), group, inplace=True)

        y2d = run_planned(
            self.plan, run, rows=wire.shape[0], group=group, x=x,
            precision=precision_label(active_autocast().recipe if fp8 else None),
        )
        lin_ctx.input_shape = x.shape
        if lin_ctx.requires_grad:
            lin_ctx.save_for_backward(*saved)
        return y2d.view(out_shape), [() for _ in self.basic_ops]


def fuse_userbuffers_forward_linear_all_reduce(
    ops: list[FusibleOperation],
    *,
    recipe: Any = None,
    fusion_log: Optional[FusionLog] = None,
    **unused: Any,
) -> list[FusibleOperation]:
    """Replace ``[BasicLinear(, Bias), AllReduce]`` windows with
    :class:`UserbuffersForwardLinearAllReduce`, as the overlap config says."""

    def matcher(window: Sequence[FusibleOperation]) -> MatchResult:
        if not isinstance(window[0], BasicLinear):
            return reject_collective_without_gemm(window, AllReduce, "no GEMM to overlap the all-reduce with")
        found = match_gemm_then(window, AllReduce, "all-reduce")
        if not isinstance(found, tuple):
            return found
        linear, bias, ar, length = found
        plan = plan_overlap(ar, linear, "fprop", "row", _AR_FPROP_UNSUPPORTED, quantized=recipe is not None)
        if isinstance(plan, str):
            return Reject(plan, length)
        op = UserbuffersForwardLinearAllReduce(linear=linear, bias=bias, all_reduce=ar, plan=plan, fp8=recipe is not None)
        return Fuse(op, length, op.fusion_summary())

    return fuse_by_window(ops, matcher, fusion_log)
