"""Shared pieces of the tensor-parallel overlap fusions (``Userbuffers*`` fused ops).

* finding the :class:`~tp_fuse.overlap.config.TPOverlap` of a window and deciding, from
  its config, whether and how a window fuses (:func:`plan_overlap`);
* the FP8 rule for all-gathering FP8 bytes: every TP rank must quantize with the same
  scale (:func:`fp8_gather_problem`, :func:`quantize_same_scale_over`);
* GEMM callables with comm's contract ``gemm(chunk, out) -> out`` for high precision and
  FP8 (chunks arrive as uint8 bytes: comm moves FP8 data as raw bytes);
* running the method of a plan, fixed or chosen by measurement (``method: auto``,
  :func:`run_planned`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from tp_fuse.comm import GemmFn

from ...overlap.config import TPOverlap, static_default
from ...overlap.method import CONFIG_METHODS, Collective, Method, OverlapMethod, candidates
from ...overlap.plan import OverlapPlan
from ...overlap.symm_mem import (
    WindowCall,
    fp8_layout_problem,
    group_name_of,
    symm_mem_unavailable,
    symm_op_for,
    window_call,
)
from ...quantization import (
    BlockScaledTensor,
    BlockScalingQuantizer,
    CurrentScalingQuantizer,
    Float8Tensor,
    active_autocast,
    fp8_gemm,
    is_block_recipe,
    is_quantized_tensor,
)
from ...quantization.block import wire as block_wire
from ...quantization.block.quantizer import block_layout, recipe_short_name
from ...recipe import DelayedScaling
from ..basic._tp import TPCommOperation
from ..basic.basic_linear import BasicLinear
from ..basic.bias import Bias
from ..basic.all_gather import AllGather
from ..basic.all_reduce import AllReduce
from ..basic.reduce_scatter import ReduceScatter
from ..op import FusedOperation, FusibleOperation, OperationContext

_USERBUFFERS_OPTION_KEYS = ("comm_name", "overlap")


class UserbuffersLinearBase(FusedOperation):
    """What the Userbuffers fused linears share: the op window and how it is described.

    The window is column-parallel ``[AllGather, BasicLinear(, Bias)]`` (``mode``
    ``"all_gather"``), row-parallel ``[BasicLinear(, Bias), ReduceScatter]``
    (``"reduce_scatter"``) or ``[BasicLinear(, Bias), AllReduce]`` (``"all_reduce"``);
    ``plan`` is the overlap plan of its GEMM stage; ``fp8`` and ``recipe`` record what the
    fusion was decided under, for ``explain`` (``BasicLinear`` decides the GEMM path at run
    time). Subclasses run one direction each.
    """

    def __init__(
        self,
        *,
        linear: BasicLinear,
        plan: OverlapPlan,
        bias: Optional[Bias] = None,
        all_gather: Optional[AllGather] = None,
        reduce_scatter: Optional[ReduceScatter] = None,
        all_reduce: Optional[AllReduce] = None,
        fp8: bool = False,
        recipe: Any = None,
    ) -> None:
        given = {Collective.ALL_GATHER: all_gather, Collective.REDUCE_SCATTER: reduce_scatter,
                 Collective.ALL_REDUCE: all_reduce}
        modes = [mode for mode, op in given.items() if op is not None]
        if len(modes) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one of all_gather / reduce_scatter / all_reduce")
        biases = [bias] if bias is not None else []
        ops: list[FusibleOperation]
        if all_gather is not None:
            ops = [all_gather, linear, *biases]
        else:
            ops = [linear, *biases, given[modes[0]]]  # type: ignore[list-item]
        super().__init__(ops)
        self.mode: Collective = modes[0]
        self.plan = plan
        self.fp8 = fp8
        self.recipe = recipe  # the recipe the fusion was decided under (describes the wire)

    @property
    def linear(self) -> BasicLinear:
        return next(op for op in self.basic_ops if isinstance(op, BasicLinear))

    @property
    def tp_label(self) -> str:
        return f"TP={self.plan.tp_size}"


def resolve_overlap(linear: BasicLinear, comm_op: TPCommOperation, *, quantized: bool = False) -> TPOverlap:
    """The TPOverlap of a window, as its comm op carries it (:meth:`TPCommOperation.window_overlap`:
    the op's own, ``initialize_ub``'s registration for the window's quantization mode
    (``quantized``: it runs under an FP8 recipe), or the op's default).

    A ``TPOverlap`` in the linear's ``userbuffers_options`` (a spelling users and
    ``BasicLinear(..., userbuffers_options={"comm_name": ..., "overlap": ...})`` examples
    use) is handed to the comm op here, once, so that the comm op is its only carrier from
    then on; the comm op holding a different one is a ValueError.
    """
    opts = linear.userbuffers_options
    unknown = sorted(set(opts) - set(_USERBUFFERS_OPTION_KEYS))
    if unknown:
        raise ValueError(
            f"BasicLinear userbuffers_options: unknown key(s) {unknown}; expected {list(_USERBUFFERS_OPTION_KEYS)}"
        )
    name = opts.get("comm_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"BasicLinear userbuffers_options['comm_name'] must be a non-empty str, got {name!r}")
    from_linear = opts.get("overlap")
    if from_linear is not None:
        if not isinstance(from_linear, TPOverlap):
            raise ValueError(
                "BasicLinear userbuffers_options['overlap'] must be a tp_fuse.overlap.config.TPOverlap, "
                f"got {type(from_linear).__name__}"
            )
        if comm_op.overlap is None:
            comm_op.overlap = from_linear
        elif comm_op.overlap is not from_linear:
            raise ValueError(
                f"BasicLinear {name!r} and its {type(comm_op).__name__} were given different TPOverlap "
                "objects; pass the same one (or only one of them)"
            )
    return comm_op.window_overlap(quantized, f"{type(comm_op).__name__} window of {gemm_label(linear)}")


def gemm_label(linear: BasicLinear) -> str:
    return repr(linear.comm_name) if linear.comm_name is not None else "unnamed GEMM"


def plan_overlap(
    comm_op: TPCommOperation,
    linear: BasicLinear,
    stage: str,
    role: str,
    unsupported: Mapping[str, str],
    *,
    quantized: bool = False,
) -> Union[OverlapPlan, str]:
    """An :class:`OverlapPlan`, or the reason (a str) the window does not fuse.

    ``unsupported`` maps a method to why this window cannot use it; ``quantized``: the
    window runs under an FP8 recipe (picks ``initialize_ub``'s FP8 registration).
    """
    tp = comm_op.tp_size
    if tp == 1:
        return "TP size 1: nothing to overlap"
    if linear.reduces_dgrad:
        return (
            "BasicLinear(tensor_parallel_mode='column', sequence_parallel=False) all-reduces its "
            "dgrad itself: no overlap plan for an extra collective around it"
        )
    overlap = resolve_overlap(linear, comm_op, quantized=quantized)
    if not overlap.config.enabled:
        return "overlap disabled by config (OverlapConfig.enabled=False)"
    key, entry = overlap.config.resolve(linear.comm_name, stage, role)
    if not entry.enabled:
        return f"overlap disabled for {key} by config"
    if entry.method in unsupported:
        return f"{key} method {entry.method}: {unsupported[entry.method]}"
    return OverlapPlan(overlap, key, entry, tp, tuple(m for m in CONFIG_METHODS if m not in unsupported))


def precision_label(recipe: Any) -> str:
    """What a measured choice depends on besides shape and dtype: the FP8 recipe kind
    and format (``"DelayedScaling/HYBRID"``), or ``"hp"`` without FP8."""
    if recipe is None:
        return "hp"
    fmt = getattr(recipe, "fp8_format", None)
    return type(recipe).__name__ + (f"/{fmt.name}" if fmt is not None else "")


def run_planned(
    plan: OverlapPlan,
    run: Callable[[OverlapMethod], Any],
    *,
    rows: int,
    group: Optional[dist.ProcessGroup],
    x: torch.Tensor,
    precision: str,
    extra: str = "",
    extra_methods: Sequence[OverlapMethod] = (),
) -> Any:
    """``run(method)`` for the plan's method: the config entry's (``pipeline`` with its
    effective split count for ``rows``, the rows a chunk is cut from), or, for
    ``method: auto``, the candidate the TPOverlap's tuner picks among the window's methods
    and ``unfused``, measured on the first call with this signature (``x``'s shape and
    dtype, ``precision``, the TP size and ``extra``), the same on every TP rank.

    ``extra_methods``: candidates the window can run besides its config's methods
    (``symm_mem`` where :func:`symm_mem_window` built a call); they are offered to
    ``method: auto`` only, and must be the same on every rank (they depend on the device,
    the group's backend and the shapes, which the window's ranks share).

    ``run`` must be repeatable with the same result: operands (FP8 casts included) are
    prepared before, so measuring records nothing twice.
    """
    entry = plan.entry
    if entry.method is not Method.AUTO:
        return run(OverlapMethod.fixed(entry.method, entry.num_splits, rows))
    tuner = plan.overlap.tuner
    # The tuner and its choice file speak labels; each maps back to its typed candidate.
    by_label = {m.label: m for m in candidates(plan.methods, (*tuner.splits, entry.num_splits), rows, extra_methods)}
    signature = (
        f"x {'x'.join(map(str, x.shape))} {str(x.dtype).replace('torch.', '')}, {precision}, tp={plan.tp_size}{extra}"
    )
    fallback = static_default(plan.key)
    default = None if fallback is None else OverlapMethod.fixed(*fallback, rows).label
    label = tuner.decide(plan.key, signature, {lb: functools.partial(run, m) for lb, m in by_label.items()}, group,
                         x.device, default=default)
    return run(by_label[label])


def symm_mem_window(
    plan: OverlapPlan,
    mode: Collective,
    group: Optional[dist.ProcessGroup],
    a: Any,
    w: Any,
    *,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    return_a: bool = False,
) -> Optional[WindowCall]:
    """The ``symm_mem`` candidate of a forward window (PyTorch's fused AG+GEMM / GEMM+RS op,
    :func:`tp_fuse.overlap.symm_mem.window_call`), or None where it is not offered: the
    plan is not ``method: auto``, the op cannot run here (:func:`symm_mem_unavailable`:
    CPU, gloo, no symmetric memory, ...), the FP8 layout has no form in the op (block
    scales), or the call would break one of the op's rules (:func:`symm_mem_violations`,
    e.g. K % 16 for FP8). ``a [M, K]``, ``w [N, K]``: plain or FP8 operands."""
    if plan.entry.method is not Method.AUTO:
        return None
    op = symm_op_for(mode, is_quantized_tensor(a))
    if symm_mem_unavailable(op, group, a.device, plan.overlap.pool) is not None:
        return None
    if is_quantized_tensor(a) and fp8_layout_problem(a, w) is not None:
        return None
    call = window_call(mode, a, w, group_name=group_name_of(group), world_size=plan.tp_size,
                       out_dtype=out_dtype, bias=bias, return_a=return_a)
    return None if call.call.violations() else call


# ---- FP8 all-gather: one scale on every TP rank --------------------------------


def _ranks(group: Optional[dist.ProcessGroup]) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def fp8_gather_problem(tp_group: Optional[dist.ProcessGroup], what: str) -> Optional[str]:
    """Why ``what`` cannot be all-gathered as FP8 bytes under the autocast in force, or None.

    The bytes of all ranks are re-wrapped with one scale, so every TP rank must quantize
    with the same scale. Delayed scaling: the scales come from amaxes all-reduced over
    the autocast's ``amax_reduction_group`` (None: the default group), which must
    therefore contain the TP group, with ``reduce_amax=True``. Current scaling: the
    fused op reduces the amax over the autocast's group when it contains the TP group,
    and over the TP group when the autocast has none.
    """
    state = active_autocast()
    if state is None or is_block_recipe(state.recipe):
        # Block / row scales are computed from local data and travel with the bytes.
        return None
    if isinstance(state.recipe, DelayedScaling) and not state.recipe.reduce_amax:
        return (
            f"FP8 all-gather of {what} needs one scale on all TP ranks, but "
            "DelayedScaling(reduce_amax=False) keeps per-rank scales"
        )
    amax_group = state.amax_reduction_group
    if amax_group is None:
        return None
    tp_ranks, amax_ranks = _ranks(tp_group), _ranks(amax_group)
    if not tp_ranks <= amax_ranks:
        return (
            f"FP8 all-gather of {what} needs one scale on all TP ranks, but the autocast's "
            f"amax_reduction_group (ranks {sorted(amax_ranks)}) does not cover the TP group "
            f"(ranks {sorted(tp_ranks)})"
        )
    return None


def quantize_same_scale_over(
    quantizer: Any, x: torch.Tensor, tp_group: Optional[dist.ProcessGroup], *, transpose: bool = False
):
    """``quantizer.quantize(x)`` with a scale that is identical on every rank of ``tp_group``.

    A current-scaling quantizer without an amax reduction group computes its amax over
    ``tp_group`` for this call (so the amax equals that of the gathered tensor the unfused
    path would quantize); delayed-scaling scales are already equal (see
    :func:`fp8_gather_problem`). A block-scaled quantizer needs no common scale; with
    ``transpose`` it also makes the column-wise copy that the wgrad GEMM reads
    (``BlockScalingQuantizer.quantize_gatherable``).
    """
    if isinstance(quantizer, BlockScalingQuantizer):
        return quantizer.quantize_gatherable(x, tp_group if tp_group is not None else dist.group.WORLD,
                                             transpose=transpose)

    if isinstance(quantizer, CurrentScalingQuantizer) and quantizer.amax_reduction_group is None:
        quantizer.amax_reduction_group = tp_group if tp_group is not None else dist.group.WORLD
        try:
            return quantizer.quantize(x)
        finally:
            quantizer.amax_reduction_group = None
    return quantizer.quantize(x)


def fp8_wire_note(recipe: Any, what: str = "input") -> str:
    """What an FP8 all-gather of ``what`` puts on the wire under ``recipe`` (for ``explain``)."""
    if recipe is None:
        return ""
    if not is_block_recipe(recipe):
        # (texts as they were before block recipes existed)
        return f"{what} quantized before the gather (1 byte/element{' on the wire' if what == 'input' else ''})"
    spec, rule, _ = block_layout(recipe, "grad_output" if what == "dy" else "input")
    if rule.kind == "nvfp4":
        return (
            f"nvfp4: {what} quantized before the gather, 0.5 byte/element plus one 1-byte E4M3 scale per "
            f"{spec.describe()} block and the 4-byte fp32 tensor amax per row on the wire; block scales come "
            "from local data, the per-tensor amax (and the stochastic-rounding seed) are all-reduced (MAX) "
            "over the TP group in one collective before quantizing"
        )
    size = "4-byte fp32" if rule.kind == "fp32" else "1-byte E8M0"
    return (
        f"{recipe_short_name(recipe)}: {what} quantized before the gather, 1 byte/element plus one {size} "
        f"scale per {spec.describe()} block on the wire, scales packed with their rows; block scales come "
        "from local data, so no amax reduction is needed"
    )


def observe_cast(linear: Any, role: str, hp: torch.Tensor, q: Any, quantizer: Any) -> None:
    """Report an FP8 cast done by an overlap op to the layer's FP8-stats tap, as
    ``BasicLinear`` does for its own casts (the stats of a gathered operand are those
    of this rank's shard: the cast happens before the gather)."""
    hooks = getattr(linear, "debug_hooks", None)
    if hooks is not None:
        hooks.on_quantized(role, hp, q, quantizer)


def fp8_wire(x_fp8: Any, layout: str = "rowwise") -> torch.Tensor:
    """The FP8 bytes of a Float8Tensor as a contiguous uint8 tensor (what comm moves).

    A BlockScaledTensor travels as ``[rows, bytes per row]`` with its scales packed in
    (``block_wire``): ``layout="rowwise"`` for the GEMM that reads it as is,
    ``"columnwise"`` for the copy a wgrad GEMM reads transposed.
    """
    if isinstance(x_fp8, BlockScaledTensor):
        return block_wire.rowwise_wire(x_fp8) if layout == "rowwise" else block_wire.columnwise_wire(x_fp8)
    return x_fp8._fp8.contiguous().view(torch.uint8)


def fp8_from_wire(data: torch.Tensor, like: Any, layout: str = "rowwise"):
    """Re-wrap gathered uint8 bytes with the scale and dtypes of ``like`` (a Float8Tensor;
    a BlockScaledTensor's scales come out of the bytes themselves)."""
    if isinstance(like, BlockScaledTensor):
        if layout == "rowwise":
            return block_wire.rowwise_from_wire(data, like)
        return block_wire.columnwise_from_wire(data, like)
    return Float8Tensor.from_parts(data.view(like._fp8.dtype), like._sinv, dtype=like.dtype)


# ---- GEMM callables (comm contract: gemm(chunk [rows, ..., K], out [rows, ..., N]) -> out) ----


def hp_gemm(mat: torch.Tensor, bias: Optional[torch.Tensor] = None) -> GemmFn:
    """``out = chunk @ mat (+ bias)`` with ``mat [K, N]`` (e.g. ``W.t()`` for fprop, ``W`` for dgrad)."""

    def gemm(chunk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a = chunk.reshape(-1, chunk.shape[-1])
        o = out.view(-1, out.shape[-1])
        if bias is None:
            torch.matmul(a, mat, out=o)
        else:
            torch.addmm(bias, a, mat, out=o)
        return out

    return gemm


def fp8_gemm_from_bytes(a_like: Any, b_fp8: Any, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> GemmFn:
    """``out = A_chunk @ b^T (+ bias)`` through ``torch._scaled_mm``, where ``A_chunk`` arrives
    as uint8 bytes quantized like ``a_like`` (same FP8 dtype and scale) and ``b_fp8 [N, K]``."""
    def gemm(chunk: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a = fp8_from_wire(chunk.reshape(-1, chunk.shape[-1]), a_like)
        out.view(-1, out.shape[-1]).copy_(fp8_gemm(a, b_fp8, out_dtype=out_dtype, bias=bias))
        return out

    return gemm


def gemm_then_reduce_operands(
    linear: BasicLinear, bias_op: Optional[FusibleOperation], lin_ctx: OperationContext,
    x: torch.Tensor, out_shape: tuple[int, ...], fp8: bool,
) -> tuple[torch.Tensor, GemmFn, tuple[Any, ...]]:
    """``(wire, gemm, saved)`` for an fprop GEMM whose output is reduced over the TP group
    (reduce-scatter or all-reduce): ``x [..., K]`` as the ``[rows, K]`` tensor the overlap
    chunks (FP8 bytes when ``fp8``), the GEMM with the bias in its epilogue, and the
    operands backward needs. Checks the bias against ``out_shape`` first (no communication yet)."""
    bias = None
    if bias_op is not None:
        assert isinstance(bias_op, Bias)
        bias_op.check_input_spec(out_shape, x.dtype, x.device)
        bias = bias_op.bias.to(x.dtype)  # under torch.autocast the GEMM runs in x's dtype
    x2d = x.reshape(-1, linear.in_features)
    lin_ctx.fp8 = fp8
    if fp8:
        x_fp8, w_fp8 = linear.quantize_operands(x2d, lin_ctx)
        return fp8_wire(x_fp8).view(x2d.shape[0], -1), fp8_gemm_from_bytes(x_fp8, w_fp8, x.dtype, bias), (x_fp8, w_fp8)
    w = linear.weight_in(x.dtype)
    return x2d.contiguous(), hp_gemm(w.t(), bias), (x2d, w)
