"""Backward fusion of tensor-parallel communication with the dgrad/wgrad GEMMs (Transformer
Engine's ``UserbuffersBackwardLinear``): ``[AllGather, BasicLinear(, Bias)]`` and
``[BasicLinear(, Bias), ReduceScatter]``."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from tp_fuse import comm

from ...overlap.algorithms import Window, WindowOperands, run_algorithm
from ...overlap.plan import OverlapPlan
from ...overlap.method import Collective, Method, OverlapMethod
from ...quantization import BlockScaledTensor, BlockScalingQuantizer, fp8_gemm
from ..basic._checks import compute_dtype
from ..basic._tp import check_first_dim_divisible
from ..basic.all_gather import AllGather
from ..basic.basic_linear import BasicLinear
from ..basic.reduce_scatter import ReduceScatter
from ..op import OperationContext
from .userbuffers_common import (
    UserbuffersLinearBase,
    fp8_from_wire,
    fp8_gather_problem,
    fp8_gemm_from_bytes,
    fp8_wire,
    fp8_wire_note,
    gemm_label,
    hp_gemm,
    observe_cast,
    precision_label,
    quantize_same_scale_over,
    run_planned,
)


class UserbuffersBackwardLinear(UserbuffersLinearBase):
    """Backward pass of a tensor-parallel linear with its communication overlapped.

    Column-parallel ``[AllGather, BasicLinear(, Bias)]`` (forward ``y = AG(x) W^T + b``):

    ========== ======================= ================================================
    tensor     shape                   equation
    ========== ======================= ================================================
    dy         ``[s, ..., out/tp]``    incoming gradient
    x_full     ``[s, ..., in]``        ``AG(x_local)`` (saved, or re-gathered here)
    dx         ``[s/tp, ..., in]``     ``RS(dy W)``              (dgrad)
    dW         ``[out/tp, in]``        ``dy^T x_full``           (wgrad)
    db         ``[out/tp]``            ``sum(dy)``
    ========== ======================= ================================================

    Overlap, by the ``<name>_dgrad`` entry of the config:

    * ``bulk`` (Megatron's default for qkv/fc1): the re-gather of ``x`` (when the forward
      kept only the shard) runs while the whole dgrad GEMM computes
      (``tp_fuse.comm.bulk_overlap``); then, if ``<name>_wgrad`` is ``bulk``, the reduce-scatter of
      ``dy W`` runs while the wgrad GEMM computes.
    * ``pipeline`` / ``ring_exchange``: dgrad GEMM and reduce-scatter of dx overlap chunk
      by chunk (``tp_fuse.comm.gemm_reduce_scatter_pipelined`` / ``_ring``), with the re-gather
      of ``x`` in flight alongside; the wgrad GEMM follows.
    * ``auto``: the tuner of the TPOverlap measures bulk, pipeline (a few ``num_splits``),
      ring_exchange and ``unfused`` (re-gather, dgrad GEMM, reduce-scatter, wgrad GEMM one
      after the other) on the first backward with a new shape and runs the fastest; the
      ``<name>_wgrad`` entry only matters for ``bulk`` (auto there: bulk).

    Row-parallel ``[BasicLinear(, Bias), ReduceScatter]`` (forward ``y = RS(x W^T + b)``):

    ========== ======================= ================================================
    dy_local   ``[s/tp, ..., out]``    incoming gradient
    dy_full    ``[s, ..., out]``       ``AG(dy_local)``
    dx         ``[s, ..., in/tp]``     ``dy_full W``             (dgrad)
    dW         ``[out, in/tp]``        ``dy_full^T x``           (wgrad)
    db         ``[out]``               ``sum(dy_full)``
    ========== ======================= ================================================

    Overlap (``<name>_dgrad`` = ``ring_exchange``): ``tp_fuse.comm.ring_exchange_ag_gemm`` on dy,
    each block's dgrad GEMM hides the transfer of the next; the gathered dy feeds the
    wgrad GEMM. ``auto``: ring_exchange or ``unfused`` (all-gather dy, then the dgrad
    GEMM), measured.

    FP8 (when the forward ran under autocast): dy is quantized with the BasicLinear's
    grad_output quantizer (E5M2 in HYBRID) and every GEMM runs through
    ``torch._scaled_mm``. The row-parallel dy is quantized *before* its all-gather (1
    byte per element on the wire, one scale on all TP ranks; see
    ``UserbuffersForwardLinear``), so ``db`` is summed from the local high-precision
    dy and all-reduced (``sum(dy_full) = sum_r sum(dy_r)``). Reduce-scatters of dx stay
    in high precision (partial sums, see ``ReduceScatter``). Backward only.
    """

    def __init__(
        self,
        *,
        wgrad_plan: Optional[OverlapPlan] = None,
        wgrad_note: str = "",
        **window: Any,
    ) -> None:
        super().__init__(**window)
        # Column-parallel bulk dgrad only: overlap RS(dx) with the wgrad GEMM.
        self.wgrad_plan = wgrad_plan
        self.wgrad_note = wgrad_note

    def fusion_summary(self) -> str:
        linear, tp = self.linear, self.tp_label
        fp8 = "; FP8 GEMMs" if self.fp8 else ""
        if self.mode == Collective.REDUCE_SCATTER:
            wire = f", {fp8_wire_note(self.recipe, 'dy')}" if self.fp8 else ""
            return f"AllGather(dy)+dgrad GEMM {gemm_label(linear)}, {self.plan.describe()}, {tp}{fp8}{wire}"
        # Whether the input is re-gathered depends on what the forward saved (its shard, by
        # default, when the forward fused too); say so rather than guess.
        regather = (
            "input saved gathered by the forward (save_gathered_input)"
            if self.plan.overlap.save_gathered_input
            else "input shard re-gathered"
        )
        if self.plan.entry.method is Method.AUTO:
            how = f"{regather}; bulk overlaps dx reduce-scatter || wgrad GEMM" + (
                f" ({self.wgrad_plan.describe()})" if self.wgrad_plan is not None else f" only if {self.wgrad_note}"
            )
        elif self.plan.entry.method is Method.BULK:
            how = f"{regather} || dgrad GEMM; " + (
                f"{self.wgrad_plan.describe()}: dx reduce-scatter || wgrad GEMM"
                if self.wgrad_plan is not None
                else f"dx reduce-scatter not overlapped ({self.wgrad_note})"
            )
        else:
            how = f"dgrad GEMM+dx reduce-scatter; {regather} alongside"
        return f"dgrad/wgrad {gemm_label(linear)}, {self.plan.describe()} ({how}), {tp}{fp8}"

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
        **unused: Any,
    ):
        if self.mode == Collective.ALL_GATHER:
            return self._backward_all_gather(basic_op_ctxs, grad_output)
        return self._backward_reduce_scatter(basic_op_ctxs, grad_output)

    # ---- column-parallel ---------------------------------------------------------

    def _backward_all_gather(self, ctxs: list[OperationContext], dy: torch.Tensor):


        ag, linear = self.basic_ops[0], self.basic_ops[1]
        bias_op = self.basic_ops[2] if len(self.basic_ops) == 3 else None
        assert isinstance(ag, AllGather) and isinstance(linear, BasicLinear)
        lin_ctx, group, tp = ctxs[1], ag.process_group, ag.tp_size
        check_first_dim_divisible("AllGather (backward)", dy, tp)
        x_saved, w_saved = lin_ctx.saved_tensors
        pool, key = self.plan.overlap.pool, self.plan.key
        dy2d = dy.reshape(-1, linear.out_features)
        m2d = dy2d.shape[0] // tp
        db = bias_op.bias_grad(dy) if bias_op is not None else None
        need_dw = linear.weight.requires_grad
        # The forward kept only this rank's shard: gather it for wgrad behind the dgrad GEMM.
        regather = need_dw and getattr(lin_ctx, "regather_input", None) is not None
        if lin_ctx.fp8:
            dy_q, fresh = lin_ctx.grad_quantizer.quantize_or_pass(
                dy2d, transpose=need_dw and isinstance(lin_ctx.grad_quantizer, BlockScalingQuantizer)
            )
            if fresh:
                observe_cast(linear, "grad_output", dy2d, dy_q, lin_ctx.grad_quantizer)
                lin_ctx.grad_tracker.track(lin_ctx.grad_quantizer)
            dgrad_in = fp8_wire(dy_q).view(dy2d.shape[0], -1)
            dgrad = fp8_gemm_from_bytes(dy_q, w_saved.transpose_fp8(), dy.dtype)
            # wgrad reads x transposed: a block-scaled x sends its column-wise copy.
            x_wire = fp8_wire(x_saved, "columnwise") if regather else None
        else:
            dy_q = dy2d
            dgrad_in = dy2d.contiguous()
            dgrad = hp_gemm(w_saved)
            x_wire = x_saved.contiguous() if regather else None

        def start_gather():
            return comm.all_gather_dim0_async(x_wire, group)

        def wgrad(x_full) -> Optional[torch.Tensor]:
            if not need_dw:
                return None
            if lin_ctx.fp8:

                return fp8_gemm(dy_q.transpose_fp8(), x_full.transpose_fp8(), out_dtype=dy.dtype)
            return dy_q.t() @ x_full

        # The dgrad GEMM and the reduce-scatter of dx (bulk / unfused: the GEMM alone, dx is
        # reduce-scattered below); no collective shape check here, as in the unfused backward.
        dgrad_operands = WindowOperands(dgrad_in, dgrad, group, pool, out_features=linear.in_features,
                                        out_dtype=dy.dtype, name=key)

        def run(m: OverlapMethod):
            """``(dx2d, dw)`` with method ``m`` (repeatable: operands are prepared above)."""

            def dgrad_and_rs() -> torch.Tensor:
                return run_algorithm(Window.DGRAD_REDUCE_SCATTER, m, dgrad_operands)

            if regather and m.method is Method.UNFUSED:
                x_gathered, dx2d = comm.all_gather_dim0(x_wire, group), dgrad_and_rs()
            elif regather:
                x_gathered, dx2d = comm.bulk_overlap(start_gather, dgrad_and_rs)
            else:
                x_gathered, dx2d = None, dgrad_and_rs()
            if x_gathered is None:
                x_full = x_saved
            else:
                # wgrad reads x transposed: a block-scaled x came as its column-wise copy.
                x_full = fp8_from_wire(x_gathered, x_saved, "columnwise") if lin_ctx.fp8 else x_gathered
            if m.method is Method.BULK and self.wgrad_plan is not None and need_dw:
                return comm.bulk_overlap(
                    lambda: comm.reduce_scatter_dim0_async(dx2d, group, pool=pool), lambda: wgrad(x_full)
                )
            if m.method in (Method.BULK, Method.UNFUSED):
                return comm.reduce_scatter_dim0(dx2d, group, pool=pool), wgrad(x_full)
            return dx2d, wgrad(x_full)

        precision = precision_label(lin_ctx.grad_quantizer.recipe) if lin_ctx.fp8 else "hp"
        dx2d, dw = run_planned(
            self.plan, run, rows=m2d, group=group, x=dy2d, precision=precision,
            extra=", dgrad" + (" re-gather" if regather else "") + ("" if need_dw else " no-wgrad"),
        )
        dx = dx2d.view(dy.shape[0] // tp, *dy.shape[1:-1], linear.in_features)
        grads = [(), (linear.finish_wgrad(dw),)] + ([(db,)] if bias_op is not None else [])
        return dx, grads, [() for _ in self.basic_ops]

    # ---- row-parallel ------------------------------------------------------------

    def _backward_reduce_scatter(self, ctxs: list[OperationContext], dy: torch.Tensor):


        linear, rs = self.basic_ops[0], self.basic_ops[-1]
        bias_op = self.basic_ops[1] if len(self.basic_ops) == 3 else None
        assert isinstance(linear, BasicLinear) and isinstance(rs, ReduceScatter)
        lin_ctx, group, tp = ctxs[0], rs.process_group, rs.tp_size
        x_saved, w_saved = lin_ctx.saved_tensors
        dy2d = dy.reshape(-1, linear.out_features)
        full_rows = dy.shape[0] * tp
        db_pending = None
        if lin_ctx.fp8:
            problem = fp8_gather_problem(group, "dy")
            if problem is not None:
                raise ValueError(f"{problem} (the fusion was decided under another autocast)")
            dy_q = quantize_same_scale_over(
                lin_ctx.grad_quantizer, dy2d, group, transpose=linear.weight.requires_grad
            )
            observe_cast(linear, "grad_output", dy2d, dy_q, lin_ctx.grad_quantizer)
            lin_ctx.grad_tracker.track(lin_ctx.grad_quantizer)
            wire = fp8_wire(dy_q).view(dy2d.shape[0], -1)
            dgrad = fp8_gemm_from_bytes(dy_q, w_saved.transpose_fp8(), dy.dtype)
            if bias_op is not None and bias_op.bias.requires_grad:
                # Only FP8 bytes of dy travel: sum the local rows in high precision, then
                # all-reduce (the sum over ranks runs while the dgrad ring computes).
                db_local = dy2d.sum(dim=0, dtype=compute_dtype(dy.dtype))
                db_pending = comm.all_reduce_async(db_local, group, inplace=True)
        else:
            dy_q = dy2d
            wire = dy2d.contiguous()
            dgrad = hp_gemm(w_saved)

        # The ring also returns the gathered dy: the wgrad GEMM (and db) read it.
        operands = WindowOperands(
            wire, dgrad, group, self.plan.overlap.pool, out_features=linear.in_features, out_dtype=dy.dtype,
            name=self.plan.key, check_shapes=self.plan.overlap.check_shapes, return_gathered=True,
        )
        run = functools.partial(run_algorithm, Window.ALL_GATHER_GEMM, operands=operands)

        precision = precision_label(lin_ctx.grad_quantizer.recipe) if lin_ctx.fp8 else "hp"
        dx2d, gathered = run_planned(self.plan, run, rows=wire.shape[0], group=group, x=dy2d, precision=precision)
        db = None
        if bias_op is not None:
            if db_pending is not None:
                db = db_pending.wait().to(bias_op.bias.dtype)
            elif not lin_ctx.fp8:
                db = bias_op.bias_grad(gathered)
        dw = None
        if linear.weight.requires_grad:
            # The forward may have kept only a shard (a column-parallel fused forward whose
            # backward did not fuse): BasicLinear's hook gathers it.
            x_full = linear.input_for_wgrad(lin_ctx, x_saved)
            if lin_ctx.fp8:

                if isinstance(dy_q, BlockScaledTensor):
                    # The ring moved dy's row-wise copy (for dgrad); wgrad reads the
                    # column-wise one, gathered here with its block scales.
                    dy_full = fp8_from_wire(comm.all_gather_dim0(fp8_wire(dy_q, "columnwise"), group), dy_q,
                                            "columnwise")
                else:
                    dy_full = fp8_from_wire(gathered, dy_q)
                dw = fp8_gemm(dy_full.transpose_fp8(), x_full.transpose_fp8(), out_dtype=dy.dtype)
            else:
                dw = gathered.t() @ x_full
        dx = dx2d.view(full_rows, *dy.shape[1:-1], linear.in_features)
        grads = [(linear.finish_wgrad(dw),)] + ([(db,)] if bias_op is not None else []) + [()]
        return dx, grads, [() for _ in self.basic_ops]
