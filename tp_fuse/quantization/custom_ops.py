"""``tp_fuse::fp8_cast``: the FP8 cast of a GEMM operand as a ``torch.library`` custom op.

Compiled graphs (``torch.compile`` of a ``Sequential`` or a layer; see
``tp_fuse/ops/compiled``) see FP8 operands as plain tensors -- bytes, transposed bytes and
``scale_inv`` -- made by this op. Its real implementation is the eager quantizer, run at
graph run time:

* the quantizer is the op's own (``OpQuantizers.get`` for the recipe in force, as eager
  ops ask for it), named by the ``OpQuantizers``' ``compile_ref`` (a graph input, so the
  layers of a model share one graph; ``compile_ref.CompileRef``);
* delayed scaling: the cast uses the scale of the last update and folds this tensor's amax
  into ``amax_history[0]``; the quantizer joins the step's amax reduction
  (``AutocastContext.track_forward``) -- so the once-per-step all-reduce and scale update
  still happen at the outermost ``autocast`` exit, as in eager mode;
* current scaling: the scale comes from this tensor's amax (all-reduced over the
  quantizer's group), and its statistics are recorded, as in eager mode;
* gradients (``role="grad_output"``, called from a compiled backward): the quantizers and
  the backward amax tracker are the ones the op's last forward cast bound (eager ops keep
  them in their autograd context); the tracker queues its end-of-backward reduction from
  inside the backward pass, as in eager mode.

So the recipe state is updated by exactly the eager code, in the eager order; what the
compiler sees is a function of ``x`` whose side effects are on that state only. No other
op of a graph reads or writes that state (the scale is replaced only at the autocast
exit, outside any graph), so the compiler may place the cast anywhere its inputs allow;
its outputs always feed a GEMM, so it is never dead code; the partitioner does not
recompute custom ops in the backward.

``tp_fuse::block_cast`` / ``tp_fuse::block_gemm`` (below) do the same for the block-scaled
recipes and NVFP4: the cast runs the op's eager block quantizer (bound the same way) and
returns its row-wise and column-wise payloads as plain tensors; the GEMM rebuilds them and
runs the eager block GEMM.

The fake implementation gives the shapes: ``data`` like ``x`` (contiguous), ``data_t``
``[cols, rows]`` of the 2-D view (``[0]`` without ``transpose``), ``scale_inv`` 0-d fp32.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.fx.node import has_side_effect

from .autocast import active_autocast
from .block.gemm import block_gemm as _block_gemm
from .block.scaling import BlockSpec
from .block.tensor import BlockPayload, BlockScaledTensor, flat_2d
from .compile_ref import HAVE_COMPILE_REFS, NO_REF, CompileRef
from .compile_state import compile_key, raise_key_mismatch
from ..recipe import FP4_DTYPE
from .op_quantizers import OpQuantizers
from .quantizer import is_backward_role

__all__ = ["NO_OBSERVER", "block_cast", "block_gemm", "fp8_cast", "fp8_track"]

# Per OpQuantizers: (quantizers by role, backward amax tracker) of its last forward cast,
# for the gradient casts of the backward that follows (eager ops keep both in their ctx).
_BACKWARD: "weakref.WeakKeyDictionary[OpQuantizers, tuple[dict[str, Any], Any]]" = weakref.WeakKeyDictionary()
#: ``observer`` of a cast nobody observes.
NO_OBSERVER = NO_REF


def _bind_quantizer(
    owner: CompileRef, role: str, where: str, key_ok: Callable[[Any], bool], expected: str
) -> tuple[Any, Any]:
    """The quantizer ``role`` of the ``OpQuantizers`` ``owner`` names, as an eager op would
    use it, and the backward amax tracker to tell (None for forward roles).

    Forward roles: the recipe in force must be the one the graph was traced for
    (``key_ok`` of its :class:`CompileKey`); the quantizer joins the step's amax reduction
    (``track_forward``, a no-op for recipes without one) and the quantizers and tracker are
    bound for the gradient casts of the backward that follows. Gradient roles: that binding.
    """
    quantizer_set: OpQuantizers = owner.target()
    if is_backward_role(role):
        binding = _BACKWARD.get(quantizer_set)
        if binding is None:
            raise RuntimeError(f"{where}({role!r}): no forward FP8 cast of this op ran before its backward")
        quantizers, tracker = binding
        return quantizers[role], tracker
    state = active_autocast()
    actual = compile_key(state)
    if not key_ok(actual):
        raise_key_mismatch(expected, actual, where)
    quantizers = quantizer_set.get(state.recipe, state.amax_reduction_group)
    q = quantizers[role]
    state.track_forward(q)
    _BACKWARD[quantizer_set] = (quantizers, state.backward_tracker)
    return q, None


def fp8_cast(
    x: torch.Tensor,
    owner: CompileRef,
    role: str,
    recipe: str,
    fp8_dtype: torch.dtype,
    transpose: bool,
    observer: CompileRef,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with the quantizer ``role`` of the ``OpQuantizers`` ``owner`` names.

    Shapes::

        x          [..., cols]   high precision (rows = prod of the leading dims)
        data       [..., cols]   fp8_dtype, contiguous: x * scale, saturated, RTNE
        data_t     [cols, rows]  fp8_dtype, contiguous (``transpose``), else [0]
        scale_inv  []            fp32, 1 / scale: value = data * scale_inv

    ``recipe`` / ``fp8_dtype``: what the graph was traced for (checked against the
    recipe in force at run time). Side effects on the quantizer state: see the module doc.
    ``observer``: names the op's ``tp_fuse.debug`` hooks, told about the cast as eager
    ``BasicLinear`` tells them (FP8 statistics), or is ``NO_OBSERVER``.
    """
    q, tracker = _bind_quantizer(
        owner, role, "tp_fuse::fp8_cast",
        lambda key: key is not None and key.recipe == recipe and key.fwd_dtype == fp8_dtype,
        f"{recipe} with forward dtype {fp8_dtype}",
    )
    if q.fp8_dtype != fp8_dtype:
        raise RuntimeError(
            f"tp_fuse::fp8_cast({role!r}): traced for {fp8_dtype}, the quantizer casts to {q.fp8_dtype}"
        )
    with torch.no_grad():
        t = q._quantize_impl(x, transpose)
    if tracker is not None:
        tracker.track(q)
    if observer:
        observer.target().on_quantized(role, x, t, q)
    data_t = t.transpose_data() if transpose else torch.empty(0, dtype=fp8_dtype, device=x.device)
    return t._fp8, data_t, t._sinv


def _fp8_cast_fake(
    x: torch.Tensor,
    owner: CompileRef,
    role: str,
    recipe: str,
    fp8_dtype: torch.dtype,
    transpose: bool,
    observer: CompileRef,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // cols if x.dim() else 1
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = x.new_empty((cols, rows) if transpose else (0,), dtype=fp8_dtype)
    return data, data_t, x.new_empty((), dtype=torch.float32)


if HAVE_COMPILE_REFS:  # else: no op; compiled FP8 GEMMs take the eager fuser (BasicLinear.compiled_unsupported)
    fp8_cast = torch.library.custom_op("tp_fuse::fp8_cast", mutates_args=())(fp8_cast)
    fp8_cast.register_fake(_fp8_cast_fake)


def fp8_track(
    slot: torch.Tensor, scale: torch.Tensor, owner: CompileRef, role: str, recipe: str, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """The per-step Python of a delayed-scaling cast traced as ATen ops; returns the scale
    the cast uses.

    On the CUDA path a compiled FP8 Linear casts with ATen ops (``ops/compiled/traced_cast``:
    amax maxed into ``amax_history[0]``, cast with the scale) on the quantizer state bound at
    trace time; what must still run at every step is the bookkeeping ``tp_fuse::fp8_cast``
    does besides the cast: forward roles join the step's amax reduction
    (``AutocastContext.track_forward``) and bind the quantizers and backward tracker for
    the backward; the gradient role (called from the compiled backward) tells that tracker,
    which queues its end-of-backward reduction.

    Shapes: ``slot`` ``[]`` fp32, the quantizer's amax slot as the cast folded it (read by
    nobody: it places the op after the fold, a value only the cast's graph has -- an op
    taking a tensor the backward also has would be copied into the backward graph by
    AOTAutograd's partitioner and run twice); ``scale`` ``[]`` fp32, the quantizer's scale;
    returns a copy of ``scale``: the value the cast and the saved ``scale_inv`` must use. The
    scale is replaced at the autocast exit, between the forward and the backward graph, so
    a backward that recomputed ``1 / scale`` from the quantizer's buffer would read the next
    step's scale; this op's output is never recomputed (custom op), only saved.
    Declared side-effectful: never removed.
    """
    q, tracker = _bind_quantizer(
        owner, role, "tp_fuse::fp8_track",
        lambda key: key is not None and key.recipe == recipe and key.fwd_dtype == fp8_dtype,
        f"{recipe} with forward dtype {fp8_dtype}",
    )
    if tracker is not None:
        tracker.track(q)
    return scale.clone()


def _fp8_track_fake(
    slot: torch.Tensor, scale: torch.Tensor, owner: CompileRef, role: str, recipe: str, fp8_dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty_like(scale)


if HAVE_COMPILE_REFS:
    fp8_track = torch.library.custom_op("tp_fuse::fp8_track", mutates_args=())(fp8_track)
    fp8_track.register_fake(_fp8_track_fake)
    has_side_effect(torch.ops.tp_fuse.fp8_track.default)


# ---- block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling, Float8RowwiseScaling, NVFP4)


def _empty_payload(x: torch.Tensor, data_dtype: torch.dtype, scale_dtype: torch.dtype) -> list[torch.Tensor]:
    """The ``(data, scale_inv, amax)`` of an absent copy: three ``[0]`` tensors."""
    return [x.new_empty((0,), dtype=data_dtype), x.new_empty((0,), dtype=scale_dtype),
            x.new_empty((0,), dtype=torch.float32)]


def _payload_tensors(p: Any, x: torch.Tensor, data_dtype: torch.dtype, scale_dtype: torch.dtype) -> list[torch.Tensor]:
    if p is None:
        return _empty_payload(x, data_dtype, scale_dtype)
    amax = p.amax.reshape(()) if p.amax is not None else x.new_empty((0,), dtype=torch.float32)
    # Dense outputs, as the fake implementation promises (the torch reference casts are).
    return [p.data.contiguous(), p.scale_inv.contiguous(), amax]


def block_cast(
    x: torch.Tensor,
    owner: CompileRef,
    role: str,
    recipe: str,
    recipe_name: str,
    block_rows: int,
    block_cols: int,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    transpose: bool,
    observer: CompileRef,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-scaled cast of ``x`` with the quantizer ``role`` of the ``OpQuantizers`` ``owner``
    names: the eager ``BlockScalingQuantizer`` / ``NVFP4Quantizer``, run at graph run time,
    as ``tp_fuse::fp8_cast`` runs the per-tensor ones (same binding of the backward's
    quantizers; these recipes have no amax history and no once-per-step reduction).

    Shapes, with ``[R, C]`` the 2-D view of ``x`` (``R`` = prod of the leading dims),
    blocks ``br x bc`` (``block_cols`` 0: ``bc = C``, one scale per row), ``C' = C / 2``
    for FP4 data (two E2M1 values per byte), else ``C``::

        row_data   [R, C']                         data_dtype: x[i, j] ~ data * scale_inv[i//br, j//bc]
        row_scale  [ceil(R/br), ceil(C/bc)]        scale_dtype (fp32, E8M0 or E4M3 for NVFP4)
        row_amax   []  fp32 for NVFP4 (per-tensor amax: value *= amax / (6 * e4m3_max)), else [0]
        col_*      the same for the row-wise cast of x.T ([C, R]) when ``transpose``, else [0] each

    The column-wise copy is quantized from high precision (block scales are not
    transposition-invariant); with NVFP4's random Hadamard transform it is of ``x.T H``.
    ``recipe`` (the recipe class) and the layout constants are what the graph was traced
    for (``compile_state.BlockLayout``); they are checked against the quantizer at run time.
    Not differentiable (straight-through, in :class:`BlockLinearFunction`).
    """
    q, tracker = _bind_quantizer(
        owner, role, "tp_fuse::block_cast",
        lambda key: key is not None and key.recipe == recipe and key.block_scaled,
        f"{recipe} (block-scaled)",
    )
    spec = q.spec
    if (q.recipe_name, spec.rows, spec.cols or 0, q.fp8_dtype) != (recipe_name, block_rows, block_cols, data_dtype):
        raise RuntimeError(
            f"tp_fuse::block_cast({role!r}): traced for {recipe_name} {block_rows}x{block_cols or 'K'} blocks of "
            f"{data_dtype}, the quantizer makes {q.recipe_name} {spec.describe()} blocks of {q.fp8_dtype}"
        )
    with torch.no_grad():
        t = q._quantize_impl(x, transpose)
    if tracker is not None:
        tracker.track(q)
    if observer:
        observer.target().on_quantized(role, x, t, q)
    row = _payload_tensors(t._rowwise, x, data_dtype, scale_dtype)
    col = _payload_tensors(t._columnwise if transpose else None, x, data_dtype, scale_dtype)
    if col[2] is row[2]:  # NVFP4 without the RHT shares one amax object: outputs must not alias
        col[2] = col[2].clone()
    return (*row, *col)  # type: ignore[return-value]


def _block_cast_fake(
    x: torch.Tensor,
    owner: CompileRef,
    role: str,
    recipe: str,
    recipe_name: str,
    block_rows: int,
    block_cols: int,
    data_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    transpose: bool,
    observer: CompileRef,
) -> tuple[torch.Tensor, ...]:
    spec = BlockSpec(block_rows, block_cols or None)
    fp4 = data_dtype == FP4_DTYPE

    def payload(r: int, c: int) -> list[torch.Tensor]:
        return [
            x.new_empty((r, c // 2 if fp4 else c), dtype=data_dtype),
            x.new_empty(spec.scale_shape((r, c)), dtype=scale_dtype),
            x.new_empty(() if fp4 else (0,), dtype=torch.float32),
        ]

    r, c = flat_2d(x.shape)
    col = payload(c, r) if transpose else _empty_payload(x, data_dtype, scale_dtype)
    return (*payload(r, c), *col)


def block_gemm(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_amax: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_amax: torch.Tensor,
    recipe_name: str,
    a_block: list[int],
    b_block: list[int],
    a_e4m3_max: float,
    b_e4m3_max: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out = A @ B.T`` in ``out_dtype`` from block-scaled row-wise payloads (``block_cast``).

    Shapes (``C'`` = ``K/2`` for NVFP4's packed FP4 data, else ``K``)::

        a_data [M, C'], a_scale [ceil(M/br_a), ceil(K/bc_a)], a_amax [] (NVFP4) or [0]
        b_data [N, C'], b_scale [ceil(N/br_b), ceil(K/bc_b)], b_amax likewise
        out    [M, N]  out_dtype, contiguous

    with ``A[i, k] = a_data[i, k] * a_scale[i//br_a, k//bc_a]`` (``a_block`` = ``[br_a,
    bc_a]``, ``bc`` 0: whole rows), likewise B, and for NVFP4 the product of the global
    scales ``a_amax b_amax / (36 a_e4m3_max b_e4m3_max)`` applied to the result. The kernel is
    ``tp_fuse.quantization.block_gemm``'s (CPU: exact emulation, fp32 accumulation;
    row-wise: ``_scaled_mm``; CUDA: ``scaled_mm``). A linear layer's GEMMs (``_r`` / ``_c``
    the row-/column-wise copies of a cast): fprop ``y = gemm(x_r, W_r)``, dgrad
    ``dx = gemm(dy_r, W_c)``, wgrad ``dW = gemm(dy_c, x_c)``. No autograd.
    """
    def operand(
        data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block: list[int], e4m3_max: float
    ) -> BlockScaledTensor:
        fp4 = data.dtype == FP4_DTYPE
        p = BlockPayload(data, scale, BlockSpec(block[0], block[1] or None), amax if fp4 else None, e4m3_max)
        return BlockScaledTensor(p.shape, out_dtype, p, None, recipe_name)

    a = operand(a_data, a_scale, a_amax, a_block, a_e4m3_max)
    return _block_gemm(a, operand(b_data, b_scale, b_amax, b_block, b_e4m3_max), out_dtype)


def _block_gemm_fake(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    a_amax: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    b_amax: torch.Tensor,
    recipe_name: str,
    a_block: list[int],
    b_block: list[int],
    a_e4m3_max: float,
    b_e4m3_max: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    torch._check(a_data.dim() == 2 and b_data.dim() == 2, lambda: "tp_fuse::block_gemm: data must be 2-D")
    torch._check(a_data.shape[1] == b_data.shape[1], lambda: "tp_fuse::block_gemm: a [M, K] and b [N, K] need equal K")
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


if HAVE_COMPILE_REFS:  # else: compiled block-scaled GEMMs take the eager fuser (BasicLinear.compiled_unsupported)
    block_cast = torch.library.custom_op("tp_fuse::block_cast", mutates_args=())(block_cast)
    block_cast.register_fake(_block_cast_fake)
block_gemm = torch.library.custom_op("tp_fuse::block_gemm", mutates_args=())(block_gemm)
block_gemm.register_fake(_block_gemm_fake)
