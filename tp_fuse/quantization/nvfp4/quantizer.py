"""``NVFP4Quantizer`` (Transformer Engine's name): high precision -> NVFP4 ``BlockScaledTensor``.

A subclass of :class:`~tp_fuse.quantization.block.quantizer.BlockScalingQuantizer`, so
everything built for block recipes takes it as is: ``quantized_model_init`` parameters,
the block-scaled all-gather of the overlap ops (``quantize_gatherable``), the block
GEMM, statistics. What NVFP4 adds (math in :mod:`.nvfp4_scaling`):

* a per-tensor amax (second-level FP32 scale) for each copy: the row-wise copy's from
  ``x``, the column-wise copy's from ``x.T`` after the random Hadamard transform;
* the RHT (``with_rht``) on the column-wise copy only -- the one the wgrad GEMM reads,
  where both operands get it and it cancels (``dW = (dy.T H)(x.T H).T``);
* stochastic rounding (``stochastic_rounding``) from a seed drawn from torch's default
  generator of the tensor's device, one draw per quantization;
* 16x16 blocks (``with_2d_quantization``) for weights.

Built two ways: from a recipe and a role (``make_quantizer`` / ``OpQuantizers``, what
ops do) or with TE's constructor arguments (users, TE's tests).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from tp_fuse.comm.nccl_rules import check_collective

from ...recipe import FP4_DTYPE, NVFP4BlockScaling
from ..block.quantizer import BlockScalingQuantizer
from ..block.scaling import ScaleRule
from ..block.tensor import BlockPayload, BlockScaledTensor, flat_2d
from .scaling_4over6 import E4M3_MAXES, ERR_MODES, transpose_nvfp4_2d
from .cast import quantize_nvfp4_layout
from .scaling import NVFP4_BLOCK, NVFP4_BLOCK_2D, _check_cols, apply_rht
from ..quantizer import Quantizer, UsageMixin, is_backward_role, register_recipe_quantizer
from ..te_dtype import DType, as_torch_dtype

__all__ = ["NVFP4Quantizer"]

# Seeds travel through an fp32 all-reduce (MAX): below 2**24 they are exact.
_SEED_LIMIT = 1 << 24


def _amax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


class NVFP4Quantizer(UsageMixin, BlockScalingQuantizer):
    """Quantizes to NVFP4 :class:`BlockScaledTensor` s (``recipe_name == "nvfp4"``).

    Args (Transformer Engine's):
        fp4_dtype: ``DType.kFloat4E2M1`` (or ``torch.float4_e2m1fn_x2``).
        rowwise / columnwise: which copies ``quantizer(x)`` makes (``set_usage``).
        with_amax_reduction, amax_reduction_group: all-reduce (MAX) the per-tensor amaxes
            over the group first (every rank then quantizes with the gathered tensor's
            global scale).
        with_rht: random Hadamard transform on the column-wise copy.
        with_post_rht_amax: the column-wise amax is taken after the RHT (else before).
        with_2d_quantization: 16x16 blocks instead of 1x16.
        stochastic_rounding: round stochastically (unbiased) instead of to nearest.
        with_random_sign_mask: the RHT's sign vector (False: all +1).
        nvfp4_use_4over6: per block, keep the map-to-4 or map-to-6 scale, whichever errs
            less (:mod:`.nvfp4_4over6`); not with ``with_rht`` or ``stochastic_rounding``.
        nvfp4_e4m3_max: the global scale's E4M3 bound, 448 or (4over6 only) 256.
        nvfp4_4over6_err_mode: the 4over6 error metric, "MAE" or "MSE".
        row_scaled_nvfp4: must be False (not implemented here).
        role: the tensor role when built by an op (``"input"``, ``"weight"``,
            ``"grad_output"``...).

    Attribute ``backend``: the quantize kernel (``nvfp4_quantize``, see :mod:`.nvfp4_cast`).
    """

    def __init__(
        self,
        fp4_dtype: Union[DType, torch.dtype] = DType.kFloat4E2M1,
        rowwise: bool = True,
        columnwise: bool = True,
        with_amax_reduction: bool = False,
        amax_reduction_group: Optional[dist.ProcessGroup] = None,
        with_rht: bool = False,
        with_post_rht_amax: bool = False,
        with_2d_quantization: bool = False,
        stochastic_rounding: bool = False,
        row_scaled_nvfp4: bool = False,
        nvfp4_use_4over6: bool = False,
        nvfp4_e4m3_max: int = 448,
        nvfp4_4over6_err_mode: str = "MAE",
        with_random_sign_mask: bool = True,
        *,
        role: str = "input",
    ) -> None:
        if as_torch_dtype(fp4_dtype, "NVFP4Quantizer fp4_dtype") != FP4_DTYPE:
            raise ValueError(f"NVFP4Quantizer fp4_dtype: expected DType.kFloat4E2M1, got {fp4_dtype!r}")
        if row_scaled_nvfp4:
            raise ValueError("NVFP4Quantizer: row_scaled_nvfp4 is not implemented in tp-fuse")
        if nvfp4_e4m3_max not in E4M3_MAXES or (nvfp4_e4m3_max != 448 and not nvfp4_use_4over6):
            raise ValueError(f"NVFP4Quantizer nvfp4_e4m3_max: expected 448, or 256 with nvfp4_use_4over6=True, "
                             f"got {nvfp4_e4m3_max!r}")
        if str(nvfp4_4over6_err_mode).upper() not in ERR_MODES:
            raise ValueError(f"NVFP4Quantizer nvfp4_4over6_err_mode: expected 'MAE' or 'MSE', got {nvfp4_4over6_err_mode!r}")
        if nvfp4_use_4over6 and (with_rht or stochastic_rounding):
            # TE's rule: its 4over6 kernels have no RHT or stochastic-rounding variant.
            raise ValueError("NVFP4Quantizer: nvfp4_use_4over6=True does not support with_rht or stochastic_rounding "
                             "(expected both False)")
        if with_amax_reduction and amax_reduction_group is None:
            raise ValueError("NVFP4Quantizer: with_amax_reduction=True needs amax_reduction_group")
        Quantizer.__init__(self, FP4_DTYPE, role)
        self.recipe: Optional[NVFP4BlockScaling] = None
        self.recipe_name = "nvfp4"
        self.spec = NVFP4_BLOCK_2D if with_2d_quantization else NVFP4_BLOCK
        self.rule = ScaleRule("nvfp4", power_2=False)
        self.with_rht = bool(with_rht)
        self.with_post_rht_amax = bool(with_post_rht_amax)
        self.with_2d_quantization = bool(with_2d_quantization)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.with_random_sign_mask = bool(with_random_sign_mask)
        self.nvfp4_use_4over6 = bool(nvfp4_use_4over6)
        self.nvfp4_e4m3_max = int(nvfp4_e4m3_max)
        self.nvfp4_4over6_err_mode = str(nvfp4_4over6_err_mode).upper()
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.last_scale_inv: Optional[torch.Tensor] = None
        self.last_amax: Optional[torch.Tensor] = None
        self.nonfinite_amax_count = torch.zeros((), dtype=torch.int64)
        #: None (auto: the Triton kernel for CUDA tensors, torch elsewhere), "torch" or "triton".
        self.backend: Optional[str] = None

    @classmethod
    def for_role(cls, recipe: NVFP4BlockScaling, role: str) -> "NVFP4Quantizer":
        """The quantizer an op uses for ``role`` under ``recipe`` (TE's recipe-to-QParams map)."""
        if not isinstance(recipe, NVFP4BlockScaling):
            raise ValueError(f"NVFP4Quantizer recipe: expected NVFP4BlockScaling, got {type(recipe).__name__}")
        if is_backward_role(role):
            qp = recipe.fp4_quant_bwd_grad
        elif role == "weight":
            qp = recipe.fp4_quant_fwd_weight
        else:
            qp = recipe.fp4_quant_fwd_inp
        # TE's scopes: 4over6 never applies to gradients; "weights" / "activations" split the rest.
        use_4over6 = not is_backward_role(role) and _in_scope(recipe.nvfp4_4over6, role)
        e4m3_max = 256 if use_4over6 and _in_scope(recipe.nvfp4_4over6_e4m3_use_256, role) else 448
        if use_4over6 and (qp.random_hadamard_transform or qp.stochastic_rounding):
            raise ValueError(
                f"NVFP4BlockScaling(nvfp4_4over6={recipe.nvfp4_4over6!r}): the {role!r} quantizer would combine "
                "4over6 with the random Hadamard transform or stochastic rounding, which 4over6 does not support; "
                "expected disable_rht=True"
            )
        q = cls(
            with_rht=qp.random_hadamard_transform, with_post_rht_amax=qp.random_hadamard_transform,
            with_2d_quantization=qp.fp4_2d_quantization, stochastic_rounding=qp.stochastic_rounding,
            nvfp4_use_4over6=use_4over6, nvfp4_e4m3_max=e4m3_max,
            nvfp4_4over6_err_mode=recipe.nvfp4_4over6_err_mode, role=role,
        )
        q.recipe = recipe
        return q

    # ------------------------------------------------------------------ TE API
    def __call__(self, tensor: torch.Tensor) -> BlockScaledTensor:
        """Quantize ``tensor`` into the copies set by ``set_usage`` (straight-through autograd)."""
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError("NVFP4Quantizer: neither rowwise nor columnwise usage is set")
        q = self.quantize(tensor, transpose=self.columnwise_usage)
        if not self.rowwise_usage:
            q.update_usage(rowwise_usage=False)
        q._quantizer = self
        return q

    def can_use_quantized(self, x: torch.Tensor, *, transpose: bool = False) -> bool:
        """As the block quantizers, except that with the RHT a given column-wise copy
        is not used: a tensor does not record whether its column-wise copy was
        transformed, and the wgrad GEMM is right only when both operands' copies were
        (the transform cancels). Such a tensor is quantized again from its row-wise copy."""
        if transpose and self.with_rht:
            return False
        return super().can_use_quantized(x, transpose=transpose)

    # ------------------------------------------------------------ quantization
    def _quantize_impl(self, x: torch.Tensor, transpose: bool = False) -> BlockScaledTensor:
        group = self.amax_reduction_group if self.with_amax_reduction else None
        return self._quantize(x, transpose, group, row_offset=0)

    def quantize_gatherable(
        self, x: torch.Tensor, group: Optional[dist.ProcessGroup], *, transpose: bool
    ) -> BlockScaledTensor:
        """Quantize a shard that will be all-gathered along dim 0 over ``group``.

        The per-tensor amaxes and the stochastic-rounding seed are all-reduced (MAX) over
        ``group`` in one collective, and the rounding bits are those of this shard's rows
        in the gathered tensor: the gathered copies equal quantizing the gathered tensor
        (the RHT runs along the gathered dimension in groups of 16, within each shard).
        """
        world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        rank = dist.get_rank(group) if world > 1 else 0
        rows = flat_2d(x.shape)[0]
        return self._quantize(x, transpose, group if world > 1 else None, row_offset=rank * rows)

    def _quantize(
        self, x: torch.Tensor, transpose: bool, group: Optional[dist.ProcessGroup], *, row_offset: int
    ) -> BlockScaledTensor:
        with torch.no_grad():
            x2d = x.detach().reshape(flat_2d(x.shape))
            row_amax = _amax(x2d)
            col_src = col_amax = None
            if transpose:
                col_src = x2d.t()
                if self.with_rht:
                    if col_src.shape[1] % 16:
                        raise ValueError(
                            f"NVFP4Quantizer: the random Hadamard transform of the column-wise copy runs over the "
                            f"{col_src.shape[1]} rows of the flattened tensor, which must be a multiple of 16 "
                            "(or use NVFP4BlockScaling(disable_rht=True))"
                        )
                    col_src = apply_rht(col_src)
                col_amax = _amax(col_src) if (self.with_post_rht_amax or not self.with_rht) else row_amax
            seed = None
            if self.stochastic_rounding:
                seed = torch.randint(0, _SEED_LIMIT, (), device=x2d.device, dtype=torch.int64)
            if group is not None:
                row_amax, col_amax, seed = _reduce_max(row_amax, col_amax, seed, group)
            bad = ~torch.isfinite(row_amax) | (col_amax is not None and ~torch.isfinite(col_amax))
            self.nonfinite_amax_count = self.nonfinite_amax_count.to(row_amax.device) + bad.to(torch.int64)
            sr = (lambda tag: None if seed is None else seed * 2 + tag)  # noqa: E731 -- independent bits per copy
            fmt = self._format()
            data, scale_inv = quantize_nvfp4_layout(x2d, self.spec, row_amax, sr_seed=sr(0), row_offset=row_offset,
                                                    backend=self.backend, four_over_six=fmt)
            rowwise = BlockPayload(data, scale_inv, self.spec, row_amax.reshape(()), float(self.nvfp4_e4m3_max))
            columnwise = None
            if col_src is not None:
                if fmt is not None and self.spec == NVFP4_BLOCK_2D:
                    # 16x16 tiles with a per-tile choice: the column-wise copy is the same tiles
                    # transposed (TE's layout), not a second selection over x.T's row errors.
                    _check_cols(col_src, "the column-wise copy (x.T, for the wgrad/dgrad GEMMs)")
                    data_t, scale_t = transpose_nvfp4_2d(data, scale_inv)
                else:
                    data_t, scale_t = quantize_nvfp4_layout(
                        col_src, self.spec, col_amax, sr_seed=sr(1), col_offset=row_offset,
                        what="the column-wise copy (x.T, for the wgrad/dgrad GEMMs)", backend=self.backend,
                        four_over_six=fmt,
                    )
                columnwise = BlockPayload(data_t, scale_t, self.spec, col_amax.reshape(()), float(self.nvfp4_e4m3_max))
            self.last_scale_inv = scale_inv
            self.last_amax = row_amax
        return BlockScaledTensor(x.shape, x.dtype, rowwise, columnwise, self.recipe_name)

    def _empty_payload(self, rows: int, cols: int, device: torch.device, pin_memory: bool) -> BlockPayload:
        """An uninitialized NVFP4 payload of a ``[rows, cols]`` layout: FP4 data packed two
        values per byte ``[rows, cols/2]``, E4M3 block scales, a 0-d fp32 amax (zero)."""
        if cols % 16:
            raise ValueError(
                f"NVFP4Quantizer.make_empty: a [{rows}, {cols}] layout (the column-wise copy is the transpose); the "
                "quantized (last) dimension must be a multiple of 16 (one E4M3 scale per 16 values)"
            )
        kw = {"device": device, "pin_memory": pin_memory}
        data = torch.empty((rows, cols // 2), dtype=FP4_DTYPE, **kw)
        scale_inv = torch.empty(self.spec.scale_shape((rows, cols)), dtype=torch.float8_e4m3fn, **kw)
        amax = torch.zeros((), dtype=torch.float32, device=device)
        return BlockPayload(data, scale_inv, self.spec, amax, float(self.nvfp4_e4m3_max))

    def _format(self) -> Optional[tuple[int, str]]:
        """``(e4m3_max, err_mode)`` when this quantizer uses 4over6, else None."""
        return (self.nvfp4_e4m3_max, self.nvfp4_4over6_err_mode) if self.nvfp4_use_4over6 else None

    def stats(self) -> dict[str, float]:
        out = super().stats()
        if out and self.last_amax is not None:
            out["amax"] = float(self.last_amax)
        return out

    def __repr__(self) -> str:
        return (f"NVFP4Quantizer(role={self.role!r}, block={self.spec.describe()}, rht={self.with_rht}, "
                f"stochastic_rounding={self.stochastic_rounding}"
                + (f", 4over6={self.nvfp4_4over6_err_mode}/e4m3_max={self.nvfp4_e4m3_max}" if self.nvfp4_use_4over6
                   else "") + ")")


def _in_scope(scope: str, role: str) -> bool:
    """Whether TE's scope value ("none", "weights", "activations", "all") covers ``role``."""
    return scope == "all" or (scope == "weights" and role == "weight") or (
        scope == "activations" and role != "weight")


def _reduce_max(
    row_amax: torch.Tensor, col_amax: Optional[torch.Tensor], seed: Optional[torch.Tensor], group: dist.ProcessGroup
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One all_reduce(MAX) of ``[row amax, col amax, seed]`` (NaN sent as inf so it wins)."""
    zero = torch.zeros((), dtype=torch.float32, device=row_amax.device)
    buf = torch.stack([
        row_amax, col_amax if col_amax is not None else zero, seed.to(torch.float32) if seed is not None else zero,
    ])
    buf = torch.nan_to_num(buf, nan=float("inf"))
    check_collective("all_reduce", [buf], world_size=dist.get_world_size(group), op=dist.ReduceOp.MAX)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return (buf[0], buf[1] if col_amax is not None else None,
            buf[2].to(torch.int64) if seed is not None else None)


register_recipe_quantizer(NVFP4BlockScaling, NVFP4Quantizer.for_role)
