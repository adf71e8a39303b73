"""Forward fusion of tensor-parallel communication with the GEMM (Transformer Engine's
``UserbuffersForwardLinear``): ``[AllGather, BasicLinear(, Bias)]`` (column-parallel,
all-gather overlapped with the GEMM) and ``[BasicLinear(, Bias), ReduceScatter]``
(row-parallel, reduce-scatter overlapped with the GEMM)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm import all_gather_dim0

from ...overlap.algorithms import Window, WindowOperands, run_algorithm
from ...overlap.method import Collective, Method, OverlapMethod
from ...quantization import BlockScaledTensor, active_autocast, is_quantized_tensor
from ...quantization.block.quantizer import is_block_recipe
from ..basic._checks import maybe_dequantize
from ..basic._tp import check_first_dim_divisible
from ..basic.all_gather import AllGather, gather_maybe_fp8
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.reduce_scatter import ReduceScatter
from ..op import OperationContext, require
from .userbuffers_common import (
    UserbuffersLinearBase,
    fp8_from_wire,
    fp8_gather_problem,
    fp8_gemm_from_bytes,
    fp8_wire,
    fp8_wire_note,
    gemm_label,
    gemm_then_reduce_operands,
    hp_gemm,
    observe_cast,
    precision_label,
    quantize_same_scale_over,
    run_planned,
    symm_mem_window,
)


def _regather(group: Optional[dist.ProcessGroup], x2d: torch.Tensor) -> torch.Tensor:
    """All-gather a saved input shard for the wgrad GEMM (FP8 shards travel as bytes)."""
    return gather_maybe_fp8(x2d, group, all_gather_dim0)


class UserbuffersForwardLinear(UserbuffersLinearBase):
    """Forward pass of a tensor-parallel linear with its communication overlapped.

    Column-parallel ``[AllGather, BasicLinear(, Bias)]`` (e.g. ``qkv``, ``fc1``):

    ======== ============================== ==============================================
    tensor   shape                          notes
    ======== ============================== ==============================================
    x_local  ``[s/tp, ..., in]``            this rank's sequence shard
    W        ``[out/tp, in]``               this rank's output-feature shard
    b        ``[out/tp]``                   optional
    y        ``[s, ..., out/tp]``           ``y = all_gather(x) W^T + b``
    ======== ============================== ==============================================

    Overlap (``ring_exchange``, ``tp_fuse.comm.ring_exchange_ag_gemm``): ``tp`` steps; at each
    the GEMM of the sequence block held runs while the next block travels to rank+1;
    only the last block's GEMM has no transfer behind it. Under ``tp_fuse.autocast``
    the shard is quantized with the BasicLinear's input quantizer *before* the gather,
    so the wire carries 1 byte per element (1/4 of fp32, 1/2 of bf16) and every GEMM
    step is ``torch._scaled_mm`` on the received bytes. This needs one scale on all TP
    ranks: delayed scaling gets it from the amax reduction (the autocast's
    ``amax_reduction_group`` must cover the TP group); current scaling all-reduces the
    amax over the TP group (or the autocast's group) before computing the scale. The
    matcher rejects the window, with the reason, when that does not hold.

    For the backward pass the BasicLinear's context gets what ``BasicLinear`` would
    save, except that by default only this rank's shard is kept and
    ``ctx.regather_input`` is set: the weight gradient re-gathers it (overlapped with
    the dgrad GEMM in ``UserbuffersBackwardLinear``; a plain gather in an unfused
    backward). ``TPOverlap(save_gathered_input=True)`` keeps the gathered input instead.

    Row-parallel ``[BasicLinear(, Bias), ReduceScatter]`` (e.g. ``proj``, ``fc2``):

    ======== ============================== ==============================================
    x        ``[s, ..., in/tp]``            full sequence, this rank's input features
    W        ``[out, in/tp]``
    b        ``[out]``                      added on every rank before the sum, as in the
                                            unfused op order
    y        ``[s/tp, ..., out]``           ``y = reduce_scatter(x W^T + b)``
    ======== ============================== ==============================================

    Overlap: ``pipeline`` (``tp_fuse.comm.gemm_reduce_scatter_pipelined``: ``num_splits`` row
    chunks; chunk i's reduce-scatter runs while chunk i+1's GEMM computes) or
    ``ring_exchange`` (``tp_fuse.comm.gemm_reduce_scatter_ring``: partial sums travel the ring
    while the next block's GEMM runs). ``auto`` (both forms): the tuner of the TPOverlap
    measures the methods that apply and ``unfused`` (the collective and the whole GEMM
    one after the other, same operands) at the first call with a new shape and runs the
    fastest (``tp_fuse.overlap.auto``). FP8 GEMMs under autocast; the reduce-scatter
    stays in the output's high precision: the summands are GEMM partial sums without an
    FP8 scale of their own (quantizing them would add a rounding per rank to the result)
    and collectives cannot add FP8 numbers.

    Equations (both): forward ``y = x W^T (+ b)`` around the collective; the backward is
    the basic ops' (or ``UserbuffersBackwardLinear``). Forward only.
    """

    def fusion_summary(self) -> str:
        linear, tp = self.linear, self.tp_label
        if self.mode == Collective.ALL_GATHER:
            keep = (
                "gathered input kept for wgrad"
                if self.plan.overlap.save_gathered_input and not is_block_recipe(self.recipe)
                else "input shard kept, re-gathered for wgrad"
                + (" (block-scaled: its column-wise copy)" if is_block_recipe(self.recipe) else "")
            )
            wire = f"; FP8: {fp8_wire_note(self.recipe)}" if self.fp8 else ""
            return f"AllGather+GEMM {gemm_label(linear)}, {self.plan.describe()}, {tp}, {keep}{wire}"
        prec = "; FP8 GEMM chunks, reduce-scatter in high precision" if self.fp8 else ""
        return f"GEMM+ReduceScatter {gemm_label(linear)}, {self.plan.describe()}, {tp}{prec}"

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
        **unused: Any,
    ) -> tuple[torch.Tensor, list[tuple[()]]]:
        require(
            isinstance(input_, torch.Tensor) and input_.dim() >= 1,
            f"{type(self).__name__}: expected a tensor with a sequence dimension",
        )
        if self.mode == Collective.ALL_GATHER:
            y = self._forward_all_gather(basic_op_ctxs, input_)
        else:
            y = self._forward_reduce_scatter(basic_op_ctxs, input_)
        return y, [() for _ in self.basic_ops]

    # ---- column-parallel: all-gather + GEMM ------------------------------------

    def _forward_all_gather(self, ctxs: list[OperationContext], x: torch.Tensor) -> torch.Tensor:


        ag, linear = self.basic_ops[0], self.basic_ops[1]
        bias_op = self.basic_ops[2] if len(self.basic_ops) == 3 else None
        assert isinstance(ag, AllGather) and isinstance(linear, BasicLinear)
        lin_ctx, group, tp = ctxs[1], ag.process_group, ag.tp_size
        # The GEMM reads the gathered rows: its M is tp times this shard's.
        fp8 = linear.fp8_quantizers(x, rows=x.numel() // linear.in_features * tp) is not None
        if not fp8:
            x = maybe_dequantize(x)
        # Every check happens before any other communication: all ranks raise.
        linear.check_input(x)
        ag.check_agreement("AllGather+GEMM", [x, linear.weight], ("input", "weight"))
        gathered_shape = torch.Size((x.shape[0] * tp, *x.shape[1:]))
        out_shape = (*gathered_shape[:-1], linear.out_features)
        bias = None
        if bias_op is not None:
            assert isinstance(bias_op, Bias)
            bias_op.check_input_spec(out_shape, x.dtype, x.device)
            bias = bias_op.bias.to(x.dtype)  # under torch.autocast the GEMM runs in x's dtype
        x2d = x.reshape(-1, linear.in_features)  # [s/tp * ..., in]: dim-0 blocks stay in rank order
        lin_ctx.fp8 = fp8
        x_fp8 = None
        if fp8:
            problem = fp8_gather_problem(group, "the GEMM input")
            if problem is not None:
                raise ValueError(f"{problem} (the fusion was decided under another autocast)")
            state = active_autocast()
            assert state is not None
            qs = linear.fp8_quantizers(x, rows=x.numel() // linear.in_features * tp)
            if is_quantized_tensor(x2d):
                x_fp8 = x2d  # quantized upstream (Quantize op): gathered as it is
            else:
                # Block recipes also make the column-wise copy here (wgrad reads it).
                x_fp8 = quantize_same_scale_over(
                    qs["input"], x2d, group, transpose=lin_ctx.requires_grad and linear.weight.requires_grad
                )
                observe_cast(linear, "input", x2d, x_fp8, qs["input"])
                state.track_forward(qs["input"])
            # Quantizes the weight and records the grad quantizer, as forward_gemm does.
            x_fp8, w_saved = linear.quantize_operands(x_fp8, lin_ctx)
            wire = fp8_wire(x_fp8)
            gemm = fp8_gemm_from_bytes(x_fp8, w_saved, x.dtype, bias)
        else:
            w_saved = linear.weight_in(x.dtype)
            wire = x2d.contiguous()
            gemm = hp_gemm(w_saved.t(), bias)
        overlap = self.plan.overlap
        # A block-scaled input's gathered row-wise copy is of no use to wgrad (it reads the
        # column-wise copy): keep the shard, whose column-wise copy backward gathers.
        keep_gathered = (
            overlap.save_gathered_input and lin_ctx.requires_grad and not isinstance(x_fp8, BlockScaledTensor)
        )

        # PyTorch's fused all-gather+matmul, where it can run (CUDA, NCCL, symmetric memory):
        # one more candidate for method: auto, on the same prepared operands.
        symm = symm_mem_window(self.plan, Collective.ALL_GATHER, group, x_fp8 if fp8 else x2d, w_saved,
                               out_dtype=x.dtype, bias=bias, return_a=keep_gathered)

        operands = WindowOperands(
            wire, gemm, group, overlap.pool, out_features=linear.out_features, out_dtype=x.dtype,
            name=self.plan.key, check_shapes=overlap.check_shapes, return_gathered=keep_gathered, symm=symm,
        )
        result = run_planned(
            self.plan, functools.partial(run_algorithm, Window.ALL_GATHER_GEMM, operands=operands),
            rows=wire.shape[0], group=group, x=x,
            precision=precision_label(active_autocast().recipe if fp8 else None),
            extra=", keep gathered" if keep_gathered else "",
            extra_methods=(OverlapMethod(Method.SYMM_MEM),) if symm is not None else (),
        )
        if keep_gathered:
            y2d, gathered = result
            x_saved = fp8_from_wire(gathered, x_fp8) if fp8 else gathered
        else:
            y2d = result
            x_saved = x_fp8 if fp8 else x2d
            lin_ctx.regather_input = functools.partial(_regather, group)
        lin_ctx.input_shape = gathered_shape
        if lin_ctx.requires_grad:
            lin_ctx.save_for_backward(x_saved, w_saved)
        return y2d.view(out_shape)

    # ---- row-parallel: GEMM + reduce-scatter -----------------------------------

    def _forward_reduce_scatter(self, ctxs: list[OperationContext], x: torch.Tensor) -> torch.Tensor:


        linear, rs = self.basic_ops[0], self.basic_ops[-1]
        bias_op = self.basic_ops[1] if len(self.basic_ops) == 3 else None
        assert isinstance(linear, BasicLinear) and isinstance(rs, ReduceScatter)
        lin_ctx, group, tp = ctxs[0], rs.process_group, rs.tp_size
        fp8 = linear.fp8_quantizers(x) is not None
        if not fp8:
            x = maybe_dequantize(x)
        linear.check_input(x)
        check_first_dim_divisible("ReduceScatter", x, tp)
        rs.check_agreement("GEMM+ReduceScatter", [x, linear.weight], ("input", "weight"))
        full_shape = (*x.shape[:-1], linear.out_features)
        wire, gemm, saved = gemm_then_reduce_operands(linear, bias_op, lin_ctx, x, full_shape, fp8)
        overlap = self.plan.overlap

        # PyTorch's fused matmul+reduce-scatter, where it can run (CUDA, NCCL, symmetric memory).
        bias = bias_op.bias.to(x.dtype) if bias_op is not None else None  # type: ignore[union-attr]
        symm = symm_mem_window(self.plan, Collective.REDUCE_SCATTER, group, saved[0], saved[1], out_dtype=x.dtype, bias=bias)
        operands = WindowOperands(
            wire, gemm, group, overlap.pool, out_features=linear.out_features, out_dtype=x.dtype,
            name=self.plan.key, check_shapes=overlap.check_shapes, symm=symm,
        )
        y2d = run_planned(
            self.plan, functools.partial(run_algorithm, Window.GEMM_REDUCE_SCATTER, operands=operands),
            rows=wire.shape[0] // tp, group=group, x=x,
            precision=precision_label(active_autocast().recipe if fp8 else None),
            extra_methods=(OverlapMethod(Method.SYMM_MEM),) if symm is not None else (),
        )
        lin_ctx.input_shape = x.shape
        if lin_ctx.requires_grad:
            lin_ctx.save_for_backward(*saved)
        return y2d.view(x.shape[0] // tp, *full_shape[1:])
