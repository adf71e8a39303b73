"""Block-scaled and row-wise FP8 recipes, and TE's :class:`QParams` / :class:`MMParams`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .base import Format, Recipe, _check_not_fp4, _check_type, check_backward_override, env_backward_override

@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one tensor kind of a block recipe (TE's ``QParams``).

    Args:
        power_2_scale: round each scale down to a power of two.
        amax_epsilon: lower bound applied to every block amax before the scale is
            computed (0.0: none).
        random_hadamard_transform: (NVFP4) apply the 16x16 random Hadamard transform to
            the column-wise copy (the one the wgrad GEMM reads).
        stochastic_rounding: (NVFP4) round to FP4 stochastically instead of to nearest.
        fp4_2d_quantization: (NVFP4) 16x16 blocks instead of 1x16.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_type("QParams.power_2_scale", self.power_2_scale, bool, "a bool")
        for name in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
            _check_type(f"QParams.{name}", getattr(self, name), bool, "a bool")
        _check_type("QParams.amax_epsilon", self.amax_epsilon, (int, float), "a float >= 0")
        if not self.amax_epsilon >= 0:
            raise ValueError(f"QParams.amax_epsilon: expected a float >= 0, got {self.amax_epsilon}")


@dataclass(frozen=True)
class MMParams:
    """GEMM parameters of a block recipe (TE's ``MMParams``). ``use_split_accumulator``
    must be True for block scaling: partial products are accumulated in fp32 per block
    (the CPU emulation always accumulates in fp32)."""

    use_split_accumulator: bool = True


def _check_not_e5m2(name: str, fmt: Any) -> None:
    _check_type(f"{name}.fp8_format", fmt, Format, "a recipe.Format")
    _check_not_fp4(name, fmt)
    if fmt is Format.E5M2:
        raise ValueError(f"{name}.fp8_format: expected Format.E4M3 or Format.HYBRID, got E5M2 "
                         "(pure E5M2 training is not supported by block scaling)")


@dataclass
class Float8BlockScaling(Recipe):
    """Block-wise FP8 scaling (DeepSeek-V3 style), Transformer Engine's fields.

    One fp32 scale per block, computed from the block's amax at quantize time::

        scale = fp8_max / max(amax_block, amax_epsilon)   (rounded down to 2**k
                                                           when power_2_scale)

    An all-zero block gets scale 1. Block shapes: ``*_block_scaling_dim == 1`` means
    1x128 blocks (128 consecutive values of a row), ``2`` means 128x128 tiles. Defaults:
    1x128 for inputs and gradients, 128x128 for weights; 2-D by 2-D GEMMs are refused.
    The row-wise and the column-wise (transposed) copies are both quantized from high
    precision (no double quantization).

    Args:
        fp8_format: E4M3 (default) or HYBRID (E5M2 gradients).
        fp8_quant_fwd_inp / fp8_quant_fwd_weight / fp8_quant_bwd_grad: :class:`QParams`
            (default power-of-two scales, amax_epsilon 0).
        x_block_scaling_dim / w_block_scaling_dim / grad_block_scaling_dim: 1 or 2.
        fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: :class:`MMParams` (split
            accumulator required).
        fp8_dpa / fp8_mha: must be False (no FP8 attention here).
        backward_override: TE's (default ``NVTE_BACKWARD_OVERRIDE``); only None runs here.
    """

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = QParams(power_2_scale=True, amax_epsilon=0.0)
    fp8_quant_fwd_weight: QParams = QParams(power_2_scale=True, amax_epsilon=0.0)
    fp8_quant_bwd_grad: QParams = QParams(power_2_scale=True, amax_epsilon=0.0)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams()
    fp8_gemm_dgrad: MMParams = MMParams()
    fp8_gemm_wgrad: MMParams = MMParams()
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=env_backward_override)

    _kind = "float8_block_scaling"

    def __post_init__(self) -> None:
        check_backward_override("Float8BlockScaling", self.backward_override)
        _check_not_e5m2("Float8BlockScaling", self.fp8_format)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            _check_type(f"Float8BlockScaling.{name}", getattr(self, name), QParams, "a recipe.QParams")
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, name)
            _check_type(f"Float8BlockScaling.{name}", value, int, "1 or 2")
            if value not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name}: expected 1 or 2, got {value}")
            dims[name] = value
        pairs = (("x_block_scaling_dim", "w_block_scaling_dim"), ("x_block_scaling_dim", "grad_block_scaling_dim"),
                 ("w_block_scaling_dim", "grad_block_scaling_dim"))
        for a, b in pairs:
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(f"Float8BlockScaling: {a}=2 with {b}=2 would need a 2-D by 2-D block GEMM; "
                                 "at most one operand of a GEMM may use 128x128 blocks")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            mm = getattr(self, name)
            _check_type(f"Float8BlockScaling.{name}", mm, MMParams, "a recipe.MMParams")
            if not mm.use_split_accumulator:
                raise ValueError(f"Float8BlockScaling.{name}: use_split_accumulator must be True for block scaling")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("Float8BlockScaling: fp8_dpa/fp8_mha must be False (FP8 attention is not supported)")


@dataclass
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP Microscaling): 32 consecutive values share one E8M0 (power-of-two) scale.

    Per OCP MX v1.0: ``X = 2**(floor(log2(amax_block)) - emax_elem)`` (``emax_elem`` = 8
    for E4M3, 15 for E5M2), clamped to E8M0's range ``2**-127 .. 2**127``; values are
    ``x / X`` cast with round-to-nearest-even and saturation to the format's max.
    Row-wise and column-wise copies are both quantized from high precision.

    Args:
        margin: kept for Transformer Engine compatibility; must be 0 (unused).
        fp8_format: E4M3 (default) or HYBRID.
        fp8_dpa / fp8_mha: must be False.
        enable_2d_quantization: TE's 32x32 weight blocks; only False runs here (``autocast``
            refuses True).
        backward_override: TE's (default ``NVTE_BACKWARD_OVERRIDE``); only None runs here.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    enable_2d_quantization: bool = False
    backward_override: Optional[str] = field(default_factory=env_backward_override)

    _kind = "mxfp8"

    def __post_init__(self) -> None:
        check_backward_override("MXFP8BlockScaling", self.backward_override)
        _check_type("MXFP8BlockScaling.enable_2d_quantization", self.enable_2d_quantization, bool, "a bool")
        _check_type("MXFP8BlockScaling.margin", self.margin, int, "0")
        if self.margin != 0:
            raise ValueError(f"MXFP8BlockScaling.margin: expected 0 (block scales have no margin), got {self.margin}")
        _check_not_e5m2("MXFP8BlockScaling", self.fp8_format)
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("MXFP8BlockScaling: fp8_dpa/fp8_mha must be False (FP8 attention is not supported)")


@dataclass
class Float8RowwiseScaling(Recipe):
    """Row-wise FP8 current scaling (torchtitan's ``rowwise`` recipe; not a TE recipe).

    Current scaling at row granularity: every row of a GEMM operand (in the layout the
    GEMM reads it: rows of ``x`` and ``W`` for fprop, columns for the transposed copies
    that dgrad and wgrad read) gets ``scale = fp8_max / amax(row)``, rounded down to a
    power of two when ``power_2_scale`` (the default, as in torchtitan). The GEMMs are
    ``torch._scaled_mm`` with row-wise scale vectors. All-zero rows get scale 1.

    Args:
        fp8_format: E4M3 (default) or HYBRID.
        power_2_scale: round scales down to powers of two (default True).
    """

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True

    def __post_init__(self) -> None:
        _check_not_e5m2("Float8RowwiseScaling", self.fp8_format)
        _check_type("Float8RowwiseScaling.power_2_scale", self.power_2_scale, bool, "a bool")
