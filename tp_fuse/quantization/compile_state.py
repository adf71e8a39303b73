"""What ``torch.compile``'d code sees of the FP8 state, and how it reaches it at run time.

Dynamo cannot read a ``contextvars.ContextVar`` (``autocast`` keeps its state in one), nor
pass Python objects (quantizers, amax trackers) to the ops of a graph. Two small pieces
bridge that, so that compiled code sees only constants, plain tensors and custom ops:

* **The recipe in force, as a constant.** :class:`CompileKey` is what a traced graph's
  *structure* depends on: off, or the recipe class and its forward/backward FP8 dtypes.
  ``autocast`` mirrors it into a plain module attribute when it is entered and left
  (:func:`traced_key`); dynamo reads that attribute while tracing and guards on its value,
  so a different recipe recompiles and an equal new recipe object (a new
  ``DelayedScaling()`` every step) does not. The mirror is process-wide: compiled code
  reads the autocast state of whichever thread last entered or left an ``autocast``. The
  FP8 custom ops re-check the real (context-local) state at run time and raise on a
  mismatch (:func:`raise_key_mismatch`); a compiled high-precision graph has no op to
  check, so do not mix compiled FP8 and non-FP8 threads.
* **Refs** (:mod:`.compile_ref`): a custom op takes tensors and constants, not arbitrary
  objects; a ``CompileRef`` names an object (an op's ``OpQuantizers``, its debug hooks) as
  a graph *input*, so that one graph serves every layer.

Nothing here runs in eager mode except the mirror update (a few attribute writes per
``autocast`` entry, not per op).
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple, Optional

import torch

from .block.quantizer import _SCALE_DTYPE, BlockScalingQuantizer, is_block_recipe
from .op_quantizers import make_quantizer

__all__ = [
    "BLOCK_ROLES",
    "BlockLayout",
    "CompileKey",
    "compile_key",
    "raise_key_mismatch",
    "recipe_key",
    "set_traced_key",
    "traced_amax_group",
    "traced_key",
]


class BlockLayout(NamedTuple):
    """What a compiled graph must know of one role's block-scaled cast (all constants).

    ``recipe_name``: the tensors' short recipe name (``blockwise``, ``mxfp8``, ``rowwise``,
    ``nvfp4``: what the block GEMM dispatches on); ``block_rows`` x ``block_cols``: the
    block shape (``block_cols`` 0: the whole row, row-wise scaling); ``data_dtype``: FP8,
    or ``torch.float4_e2m1fn_x2`` (two values per byte) for NVFP4; ``scale_dtype``: fp32,
    E8M0 (MXFP8) or E4M3 (NVFP4); ``e4m3_max``: NVFP4's second-level scale bound (448, or
    256 with 4over6). The fake implementations derive every output shape from these.
    """

    recipe_name: str
    block_rows: int
    block_cols: int
    data_dtype: torch.dtype
    scale_dtype: torch.dtype
    e4m3_max: float


#: The roles of ``BasicLinear``'s quantizers, whose layouts a block :class:`CompileKey` carries.
BLOCK_ROLES = ("input", "weight", "grad_output")


class CompileKey(NamedTuple):
    """The FP8 facts a traced graph is specialized on (all constants, compared by value).

    ``recipe``: the recipe class name (``"DelayedScaling"``, ``"Float8CurrentScaling"``,
    a block recipe's, or another recipe's, which the traced fuser path does not handle);
    ``fwd_dtype`` / ``bwd_dtype``: the FP8 dtypes of forward tensors and gradients
    (None for recipes without a per-tensor FP8 format); ``layouts``: for the block-scaled
    recipes (``Float8BlockScaling``, ``MXFP8BlockScaling``, ``Float8RowwiseScaling``,
    ``NVFP4BlockScaling``), ``((role, BlockLayout), ...)`` for :data:`BLOCK_ROLES` --
    block shapes and dtypes depend on the recipe's fields, not only on its class, and
    the graph's shapes depend on them -- else None; ``detail``: see below.
    """

    recipe: str
    fwd_dtype: Optional[torch.dtype]
    bwd_dtype: Optional[torch.dtype]
    layouts: Optional[tuple[tuple[str, BlockLayout], ...]] = None
    #: A per-tensor recipe's ``repr`` (its fields): the ATen casts traced on the CUDA path
    #: (``ops/compiled/traced_cast.py``) bind the op's quantizers for the recipe while
    #: tracing, so a changed recipe (which rebuilds them) must trace again.
    detail: str = ""

    @property
    def per_tensor(self) -> bool:
        """Whether this is a per-tensor FP8 recipe (``tp_fuse::fp8_cast`` / ``fp8_gemm``)."""
        return self.recipe in ("DelayedScaling", "Float8CurrentScaling")

    @property
    def block_scaled(self) -> bool:
        """Whether this is a block-scaled recipe (``tp_fuse::block_cast`` / ``block_gemm``)."""
        return self.layouts is not None

    @property
    def traced(self) -> bool:
        """Whether the traced fuser path handles this recipe."""
        return self.per_tensor or self.block_scaled

    def layout(self, role: str) -> BlockLayout:
        """The :class:`BlockLayout` of ``role`` (block recipes only)."""
        assert self.layouts is not None, self
        return dict(self.layouts)[role]


def compile_key(ctx: Any) -> Optional[CompileKey]:
    """The :class:`CompileKey` of an ``AutocastContext`` (None: FP8 off)."""
    if ctx is None or not ctx.enabled:
        return None
    return recipe_key(ctx.recipe)


# (recipe snapshot, its key): autocast is entered every step with an equal recipe, and a
# block recipe's key builds its quantizers to read their layouts (tens of microseconds).
_LAST_BLOCK_KEY: list[Any] = [None, None]
# The same for the per-tensor recipes (their key holds the recipe's repr).
_LAST_PER_TENSOR_KEY: list[Any] = [None, None]


def _block_layouts(recipe: Any) -> Optional[tuple[tuple[str, BlockLayout], ...]]:
    """The layouts of :data:`BLOCK_ROLES` under a block-scaled ``recipe``, else None; read
    from the quantizers ops build (``make_quantizer``), so they cannot disagree."""

    if not is_block_recipe(recipe):
        return None
    snap, key = _LAST_BLOCK_KEY
    if snap is not None and type(snap) is type(recipe) and snap == recipe:
        return key
    layouts = []
    for role in BLOCK_ROLES:
        q = make_quantizer(recipe, role)
        assert isinstance(q, BlockScalingQuantizer), q
        layouts.append((role, BlockLayout(
            q.recipe_name, q.spec.rows, q.spec.cols or 0, q.fp8_dtype, _SCALE_DTYPE[q.rule.kind],
            float(getattr(q, "nvfp4_e4m3_max", 448.0)),
        )))
    key = tuple(layouts)
    _LAST_BLOCK_KEY[:] = [copy.copy(recipe), key]
    return key


def recipe_key(recipe: Any) -> Optional[CompileKey]:
    """The :class:`CompileKey` of a recipe (None: no recipe, high precision)."""
    if recipe is None:
        return None
    fmt = getattr(recipe, "fp8_format", None)
    name = type(recipe).__name__
    if name in ("DelayedScaling", "Float8CurrentScaling") and fmt is not None:
        snap, key = _LAST_PER_TENSOR_KEY
        if snap is None or type(snap) is not type(recipe) or snap != recipe:
            # repr costs ~20 us and autocast is entered every step with an equal recipe.
            key = CompileKey(name, fmt.fwd_dtype, fmt.bwd_dtype, None, repr(recipe))
            _LAST_PER_TENSOR_KEY[:] = [copy.copy(recipe), key]
        return key
    layouts = _block_layouts(recipe)
    if layouts is not None:
        return CompileKey(name, None, None, layouts)
    return CompileKey(name, None, None)


class _TraceView:
    """The mirror dynamo reads: attributes replaced (never mutated) on every change."""

    key: Optional[CompileKey] = None
    # The autocast's amax reduction group (for the sequence-parallel check of the layers).
    amax_group: Any = None


_VIEW = _TraceView()


def traced_key() -> Optional[CompileKey]:
    """The recipe in force as compiled code sees it (see the module doc). Traceable."""
    return _VIEW.key


def traced_amax_group() -> Any:
    """The amax reduction group of the autocast in force, as compiled code sees it."""
    return _VIEW.amax_group


def set_traced_key(key: Optional[CompileKey], amax_group: Any = None) -> tuple[Optional[CompileKey], Any]:
    """Set the mirror; returns the previous ``(key, amax_group)`` for the caller to restore."""
    prev = (_VIEW.key, _VIEW.amax_group)
    _VIEW.key, _VIEW.amax_group = key, amax_group
    return prev


def raise_key_mismatch(expected: str, actual: Optional[CompileKey], where: str) -> None:
    """Raise: a graph traced for FP8 state ``expected`` runs under ``actual`` (another
    thread's autocast state was mirrored when it was traced or its guards ran)."""
    raise RuntimeError(
        f"{where}: this torch.compile'd graph was traced for FP8 {expected}, but it runs under "
        f"{actual or 'no FP8 autocast'}. Compiled code reads the autocast state of the thread that "
        "last entered or left tp_fuse.autocast; do not run compiled tp_fuse ops in threads with "
        "different autocast states."
    )
