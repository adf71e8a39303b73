"""Quantizers of the block-scaled and row-wise recipes.

One class, :class:`BlockScalingQuantizer`, serves :class:`~tp_fuse.recipe.Float8BlockScaling`
(1x128 / 128x128 fp32 scales), :class:`~tp_fuse.recipe.MXFP8BlockScaling` (1x32, E8M0)
and :class:`~tp_fuse.recipe.Float8RowwiseScaling` (one scale per row): the recipe only
decides, per role, the block shape, the scale rule and the FP8 dtype
(:func:`block_layout`). Scales come from each block's own amax at quantize time, so
these quantizers keep no amax history and take part in no amax reduction
(``needs_amax_reduction = False``): a block's scale depends on local data only, and a
gathered tensor carries the scales of every rank with its bytes.

``quantize(x, transpose=True)`` quantizes both layouts from high precision in one call:
the row-wise copy of ``x [R, C]`` and the row-wise quantization of ``x.T [C, R]`` (the
column-wise copy that dgrad/wgrad GEMMs read). Never one from the other. The work is done
by :func:`~tp_fuse.quantization.block.cast.quantize_layouts`: Triton kernels for CUDA
tensors (both layouts in one read), the torch reference elsewhere; ``backend`` forces one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

import torch
import torch.distributed as dist

from ...recipe import FP4_DTYPE, Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling, NVFP4BlockScaling, QParams
from .cast import AmaxHook, quantize_layouts
from .scaling import BlockSpec, ScaleRule
from .tensor import BlockPayload, BlockScaledTensor, copy_payloads, flat_2d
from ..quantized_tensor import QuantizedTensor
from ..quantizer import Quantizer, is_backward_role, parse_shape, register_recipe_quantizer

__all__ = ["BlockRecipe", "BlockScalingQuantizer", "block_layout", "is_block_recipe", "recipe_short_name"]

BlockRecipe = Union[Float8BlockScaling, MXFP8BlockScaling, Float8RowwiseScaling, NVFP4BlockScaling]
# The FP8 recipes this class quantizes; NVFP4 has its own subclass (nvfp4/quantizer.py).
FP8_BLOCK_RECIPES = (Float8BlockScaling, MXFP8BlockScaling, Float8RowwiseScaling)
BLOCK_RECIPES = FP8_BLOCK_RECIPES + (NVFP4BlockScaling,)

_BLOCK_1D = BlockSpec(1, 128)
_BLOCK_2D = BlockSpec(128, 128)
_MX_BLOCK = BlockSpec(1, 32)
_ROW = BlockSpec(1, None)

# Storage dtype of each scale rule's block scales.
_SCALE_DTYPE = {"fp32": torch.float32, "e8m0": torch.float8_e8m0fnu, "nvfp4": torch.float8_e4m3fn}


def is_block_recipe(recipe: object) -> bool:
    """Whether ``recipe`` is one of the block-scaled / row-wise recipes."""
    return isinstance(recipe, BLOCK_RECIPES)


def recipe_short_name(recipe: BlockRecipe) -> str:
    """``blockwise``, ``mxfp8``, ``rowwise`` or ``nvfp4`` (the launcher's names)."""
    if isinstance(recipe, NVFP4BlockScaling):
        return "nvfp4"
    if isinstance(recipe, Float8BlockScaling):
        return "blockwise"
    if isinstance(recipe, MXFP8BlockScaling):
        return "mxfp8"
    return "rowwise"


def block_layout(recipe: BlockRecipe, role: str) -> tuple[BlockSpec, ScaleRule, torch.dtype]:
    """``(block shape, scale rule, FP8 dtype)`` of ``role`` under ``recipe``.

    NVFP4: 1x16 blocks (16x16 for weights unless ``disable_2d_quantization``), E4M3
    block scales (rule ``"nvfp4"``: two-level, see ``nvfp4_scaling``), FP4 data.
    """
    if isinstance(recipe, NVFP4BlockScaling):
        two_d = role == "weight" and recipe.fp4_quant_fwd_weight.fp4_2d_quantization
        return (BlockSpec(16, 16) if two_d else BlockSpec(1, 16)), ScaleRule("nvfp4", power_2=False), FP4_DTYPE
    fmt = recipe.fp8_format
    dtype = fmt.bwd_dtype if is_backward_role(role) else fmt.fwd_dtype
    if isinstance(recipe, Float8BlockScaling):
        if is_backward_role(role):
            dim, qp = recipe.grad_block_scaling_dim, recipe.fp8_quant_bwd_grad
        elif role == "weight":
            dim, qp = recipe.w_block_scaling_dim, recipe.fp8_quant_fwd_weight
        else:
            dim, qp = recipe.x_block_scaling_dim, recipe.fp8_quant_fwd_inp
        assert isinstance(qp, QParams)
        rule = ScaleRule("fp32", power_2=qp.power_2_scale, amax_epsilon=float(qp.amax_epsilon))
        return (_BLOCK_2D if dim == 2 else _BLOCK_1D), rule, dtype
    if isinstance(recipe, MXFP8BlockScaling):
        return _MX_BLOCK, ScaleRule("e8m0"), dtype
    if isinstance(recipe, Float8RowwiseScaling):
        return _ROW, ScaleRule("fp32", power_2=recipe.power_2_scale), dtype
    raise ValueError(f"block_layout: expected a block-scaled recipe, got {type(recipe).__name__}")


class BlockScalingQuantizer(Quantizer):
    """Quantizes to :class:`BlockScaledTensor` with the block layout of ``role``.

    Attributes:
        spec, rule: block shape and scale rule (:func:`block_layout`).
        last_scale_inv: the row-wise ``scale_inv`` of the last quantization (for stats).
        backend: None (auto: Triton for CUDA tensors, torch elsewhere), "torch" or
            "triton" (see ``tp_fuse.kernels.dispatch``); settable.
    """

    transposes_by_view = False  # the column-wise copy has its own block scales
    needs_amax_reduction = False

    def __init__(self, recipe: BlockRecipe, role: str) -> None:
        if not isinstance(recipe, FP8_BLOCK_RECIPES):
            raise ValueError(
                f"BlockScalingQuantizer recipe: expected Float8BlockScaling, MXFP8BlockScaling or "
                f"Float8RowwiseScaling, got {type(recipe).__name__}"
            )
        spec, rule, dtype = block_layout(recipe, role)
        super().__init__(dtype, role)
        self.recipe = recipe
        self.recipe_name = recipe_short_name(recipe)
        self.spec = spec
        self.rule = rule
        self.last_scale_inv: Optional[torch.Tensor] = None
        self.backend: Optional[str] = None
        # Quantizations with a NaN/inf block amax (the saturating cast would hide an inf);
        # the launcher's non-finite guard reads it like the per-tensor quantizers' count.
        self.nonfinite_amax_count = torch.zeros((), dtype=torch.int64)

    def quantize_gatherable(
        self, x: torch.Tensor, group: Optional[dist.ProcessGroup], *, transpose: bool
    ) -> BlockScaledTensor:
        """Quantize a shard that will be all-gathered along dim 0 over ``group``.

        Block scales are local, so this equals :meth:`quantize` -- except for row-wise
        scaling's column-wise copy, whose one scale per column spans the whole gathered
        dimension: its column amaxes are all-reduced (MAX) over ``group`` first, so that
        the gathered copy equals quantizing the gathered tensor. No autograd.
        """
        if not (transpose and self.spec.cols is None):
            with torch.no_grad():
                return self._quantize_impl(x, transpose)

        def reduce_col_amax(col_amax: torch.Tensor) -> torch.Tensor:
            if group is not None and dist.get_world_size(group) > 1:
                # NaN must win the MAX like it does locally: send it as inf.
                col_amax = torch.nan_to_num(col_amax, nan=float("inf"))
                dist.all_reduce(col_amax, op=dist.ReduceOp.MAX, group=group)
            return col_amax

        with torch.no_grad():
            return self._quantize_layouts(x, True, reduce_col_amax)

    def can_use_quantized(self, x: torch.Tensor, *, transpose: bool = False) -> bool:
        """A :class:`BlockScaledTensor` of this recipe with the copies the GEMMs read:
        the row-wise one always, the column-wise one when ``transpose`` (block scales
        are not transposition-invariant, so a missing copy cannot be derived from the
        other without quantizing twice)."""
        return (
            isinstance(x, BlockScaledTensor)
            and x.recipe_name == self.recipe_name
            and x._rowwise is not None
            and (not transpose or x._columnwise is not None)
        )

    def _quantize_layouts(
        self, x: torch.Tensor, transpose: bool, reduce_col_amax: Optional[AmaxHook] = None
    ) -> BlockScaledTensor:
        x2d = x.detach().reshape(flat_2d(x.shape))
        out = quantize_layouts(x2d, self.spec, self.fp8_dtype, self.rule, columnwise=transpose,
                               reduce_columnwise_amax=reduce_col_amax, backend=self.backend)
        self.nonfinite_amax_count = self.nonfinite_amax_count.to(out.nonfinite.device) + out.nonfinite
        self.last_scale_inv = out.rowwise.scale_inv
        return BlockScaledTensor(x.shape, x.dtype, out.rowwise, out.columnwise, self.recipe_name)

    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> BlockScaledTensor:
        # Both copies from high precision: block scales are not transposition-invariant.
        with torch.no_grad():
            return self._quantize_layouts(x, transpose)

    # ------------------------------------------------- Transformer Engine's API
    def get_scale_shape(self, shape: Iterable[int], columnwise: bool) -> tuple[int, int]:
        """Shape of the ``scale_inv`` of a tensor of ``shape`` (TE's ``get_scale_shape``): of
        the column-wise copy when ``columnwise``, else of the row-wise copy.

        For ``[R, C]`` = ``(prod(shape[:-1]), shape[-1])`` (``(1, 1)`` for 0-d) and blocks
        ``(br, bc)``: row-wise ``[ceil(R/br), ceil(C/bc)]``, column-wise (blocks of the
        transpose) ``[ceil(C/br), ceil(R/bc)]`` -- the shapes this quantizer's tensors hold
        (``_rowwise_scale_inv`` / ``_columnwise_scale_inv``) and the constructors take.
        Transformer Engine's answer is its cuBLAS layout instead (padded to multiples of
        128 x 4, and for 1x128 blocks and MXFP8's column-wise copy in another orientation):
        the same scales, other buffer shapes (docs/ops.md).
        """
        dims = parse_shape(shape, f"{type(self).__name__}.get_scale_shape")
        r, c = flat_2d(dims)
        return self.spec.scale_shape((c, r) if columnwise else (r, c))

    def get_columnwise_shape(self, shape: Iterable[int]) -> tuple[int, ...]:
        """Shape of the column-wise data of a tensor of ``shape``: ``(shape[-1], *shape[:-1])``
        (TE's ``Float8BlockQuantizer`` / ``NVFP4Quantizer`` answer; ``()`` for 0-d). The
        constructors take it or its 2-D form ``[C, R]``. For MXFP8 TE answers ``shape`` (its
        column-wise copy is not transposed); here every block format stores the transpose."""
        dims = parse_shape(shape, f"{type(self).__name__}.get_columnwise_shape")
        return (dims[-1], *dims[:-1]) if dims else ()

    def _empty_payload(self, rows: int, cols: int, device: torch.device, pin_memory: bool) -> BlockPayload:
        """An uninitialized payload of a ``[rows, cols]`` layout (data and block scales)."""
        kw = {"device": device, "pin_memory": pin_memory}
        data = torch.empty((rows, cols), dtype=self.fp8_dtype, **kw)
        scale_inv = torch.empty(self.spec.scale_shape((rows, cols)), dtype=_SCALE_DTYPE[self.rule.kind], **kw)
        return BlockPayload(data, scale_inv, self.spec)

    def _make_empty(
        self, dims: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, requires_grad: bool, pin_memory: bool
    ) -> QuantizedTensor:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}.make_empty: neither rowwise nor columnwise usage is set")
        r, c = flat_2d(dims)
        row = self._empty_payload(r, c, device, pin_memory) if self.rowwise_usage else None
        col = self._empty_payload(c, r, device, pin_memory) if self.columnwise_usage else None
        return BlockScaledTensor(dims, dtype, row, col, self.recipe_name, requires_grad=requires_grad, quantizer=self)

    def _can_store(self, dst: QuantizedTensor) -> bool:
        return isinstance(dst, BlockScaledTensor) and dst.recipe_name == self.recipe_name

    def _store(self, src: torch.Tensor, dst: QuantizedTensor) -> None:
        assert isinstance(dst, BlockScaledTensor)
        # Both copies from high precision (never one from the other), then into dst's buffers.
        copy_payloads(dst, self._quantize_impl(src, transpose=dst._columnwise is not None))

    def stats(self) -> dict[str, float]:
        s = self.last_scale_inv
        if s is None:
            return {}
        s = s.to(torch.float32)
        finite = s[torch.isfinite(s)]
        if finite.numel() == 0:
            return {"scale_inv_min": float("nan"), "scale_inv_max": float("nan"), "scale_inv_std": float("nan")}
        return {
            "scale_inv_min": float(finite.min()),
            "scale_inv_max": float(finite.max()),
            "scale_inv_std": float(finite.std(unbiased=False)),
            "num_blocks": float(s.numel()),
            "nonfinite_amax_count": float(self.nonfinite_amax_count),
        }

    def __repr__(self) -> str:
        return (f"BlockScalingQuantizer({self.recipe_name}, role={self.role!r}, block={self.spec.describe()}, "
                f"scale={self.rule.kind}{' pow2' if self.rule.power_2 and self.rule.kind == 'fp32' else ''}, "
                f"fp8_dtype={self.fp8_dtype})")


for _recipe_type in FP8_BLOCK_RECIPES:
    register_recipe_quantizer(_recipe_type, BlockScalingQuantizer)
