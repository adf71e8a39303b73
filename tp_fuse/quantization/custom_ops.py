"""``tp_fuse::fp8_cast``: the FP8 cast of a GEMM operand as a ``torch.library`` custom op.

Compiled graphs (``torch.compile`` of a ``Sequential`` or a layer; see
``tp_fuse/ops/compiled``) see FP8 operands as plain tensors -- bytes, transposed bytes and
``scale_inv`` -- made by this op. Its real implementation is the eager quantizer, run at
graph run time:

* the quantizer is the op's own (``OpQuantizers.get`` for the recipe in force, as eager
  ops ask for it), named by the ``OpQuantizers``' ``compile_ref`` (a graph input, so the
  layers of a model share one graph; ``compile_state.CompileRef``);
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

The fake implementation gives the shapes: ``data`` like ``x`` (contiguous), ``data_t``
``[cols, rows]`` of the 2-D view (``[0]`` without ``transpose``), ``scale_inv`` 0-d fp32.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .autocast import active_autocast
from .compile_state import HAVE_COMPILE_REFS, NO_REF, CompileRef, compile_key, raise_key_mismatch
from .quantizer import OpQuantizers, is_backward_role

__all__ = ["NO_OBSERVER", "fp8_cast"]

# Per OpQuantizers: (quantizers by role, backward amax tracker) of its last forward cast,
# for the gradient casts of the backward that follows (eager ops keep both in their ctx).
_BACKWARD: "weakref.WeakKeyDictionary[OpQuantizers, tuple[dict[str, Any], Any]]" = weakref.WeakKeyDictionary()
#: ``observer`` of a cast nobody observes.
NO_OBSERVER = NO_REF


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
    quantizer_set: OpQuantizers = owner.target()
    if is_backward_role(role):
        binding = _BACKWARD.get(quantizer_set)
        if binding is None:
            raise RuntimeError(
                f"tp_fuse::fp8_cast({role!r}): no forward FP8 cast of this op ran before its backward"
            )
        quantizers, tracker = binding
        q = quantizers[role]
    else:
        state = active_autocast()
        actual = compile_key(state)
        if actual is None or actual.recipe != recipe or actual.fwd_dtype != fp8_dtype:
            raise_key_mismatch(f"{recipe} with forward dtype {fp8_dtype}", actual, "tp_fuse::fp8_cast")
        quantizers = quantizer_set.get(state.recipe, state.amax_reduction_group)
        q = quantizers[role]
        state.track_forward(q)
        _BACKWARD[quantizer_set] = (quantizers, state.backward_tracker)
        tracker = None
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
    return t._data, data_t, t._scale_inv


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


if HAVE_COMPILE_REFS:  # else: no op; compiled FP8 GEMMs take the eager fuser (ops/compiled/basic.py)
    fp8_cast = torch.library.custom_op("tp_fuse::fp8_cast", mutates_args=())(fp8_cast)
    fp8_cast.register_fake(_fp8_cast_fake)
