"""FP8 recipes: which FP8 formats to use and how to choose scaling factors.

Names and fields follow Transformer Engine's ``transformer_engine.common.recipe``
so that user code can switch between the two libraries:

* :class:`Format` -- the FP8 formats for forward tensors (activations, weights)
  and backward tensors (gradients).
* :class:`DelayedScaling` -- per-tensor scales computed from a history of past
  absolute maxima ("amax"), updated once per step after an amax reduction.
* :class:`Float8CurrentScaling` -- per-tensor scales computed from the tensor
  being quantized, at the moment it is quantized.
* :class:`CustomRecipe` -- Transformer Engine's per-role quantizer factory; constructible
  here, refused by ``autocast`` (see its docstring).
* Block-scaled recipes (:class:`Float8BlockScaling`, :class:`MXFP8BlockScaling`,
  :class:`Float8RowwiseScaling`) and :class:`NVFP4BlockScaling` (FP4 E2M1 data,
  E4M3 block scales plus an FP32 per-tensor scale).

Recipes are plain validated dataclasses. Equality is field-wise, so two recipes
built with the same arguments are interchangeable (quantizer state is reused);
callables compare by identity.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

__all__ = [
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "QParams",
    "MMParams",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "Float8RowwiseScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
]


class _FormatHelper(NamedTuple):
    """A :class:`Format`'s value, as in Transformer Engine: the largest finite
    values of its forward and backward FP8 dtypes (``Format.HYBRID.value.max_fwd``)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 formats used in the forward and backward passes.

    ``E4M3``: E4M3 everywhere (max 448, finer mantissa).
    ``E5M2``: E5M2 everywhere (max 57344, wider range).
    ``HYBRID``: E4M3 for forward tensors, E5M2 for gradients -- gradients need
    range more than precision.
    ``E2M1``: the FP4 format of :class:`NVFP4BlockScaling` (max 6); its torch dtype is
    ``torch.float4_e2m1fn_x2`` (two values packed per byte).

    Values are ``(max_fwd, max_bwd)`` named tuples, as in Transformer Engine.
    """

    E2M1 = _FormatHelper(max_fwd=6.0, max_bwd=6.0)
    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)

    @property
    def fwd_dtype(self) -> torch.dtype:
        """Low-precision dtype of forward-pass tensors (inputs, weights)."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        """Low-precision dtype of backward-pass tensors (gradients)."""
        if self is Format.E2M1:
            return torch.float4_e2m1fn_x2
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    @property
    def fwd_max(self) -> float:
        """Largest finite value of :attr:`fwd_dtype` (6, 448 or 57344)."""
        return low_precision_max(self.fwd_dtype)

    @property
    def bwd_max(self) -> float:
        """Largest finite value of :attr:`bwd_dtype` (6, 448 or 57344)."""
        return low_precision_max(self.bwd_dtype)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: FP4 E2M1 (two values per byte): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
FP4_DTYPE = torch.float4_e2m1fn_x2
FP4_MAX = 6.0


def low_precision_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype or of FP4 E2M1 (6.0)."""
    if dtype == FP4_DTYPE:
        return FP4_MAX
    return fp8_dtype_max(dtype)


def fp8_dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448.0 (E4M3) or 57344.0 (E5M2)."""
    if dtype not in _FP8_DTYPES:
        raise ValueError(
            f"fp8 dtype: expected one of {_FP8_DTYPES}, got {dtype}"
        )
    return float(torch.finfo(dtype).max)


def _check_type(name: str, value: Any, expected: type | tuple[type, ...], what: str) -> None:
    # bool is an int subclass; a flag passed as margin is a mistake, not a value.
    ok = isinstance(value, expected) and not (
        isinstance(value, bool) and expected is int
    )
    if not ok:
        raise ValueError(f"{name}: expected {what}, got {value!r} ({type(value).__name__})")


def _check_not_fp4(name: str, fmt: "Format") -> None:
    if fmt is Format.E2M1:
        raise ValueError(f"{name}.fp8_format: expected an FP8 format (E4M3, E5M2, HYBRID), got E2M1 "
                         "(FP4 training is NVFP4BlockScaling)")


class Recipe:
    """Base class of FP8 recipes. Use :class:`DelayedScaling` or
    :class:`Float8CurrentScaling`."""

    fp8_format: Format

    def delayed(self) -> bool:
        """Whether this recipe uses delayed (history-based) scaling."""
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        """Whether this recipe uses current (just-in-time) scaling."""
        return isinstance(self, Float8CurrentScaling)

    def custom(self) -> bool:
        """Whether this is a :class:`CustomRecipe` (TE's predicate of the same name)."""
        return isinstance(self, CustomRecipe)


AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
ScalingFactorComputeAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


@dataclass
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor's scale comes from its past amaxes.

    Every quantizer keeps an amax history of ``amax_history_len`` steps. During a
    step, quantizing folds ``amax(|x|)`` into slot 0 using the scale computed at
    the end of the previous step. At the end of the step the slot-0 amaxes are
    all-reduced (MAX) over the amax reduction group, then each quantizer picks
    an amax from its history and sets::

        scale = (fp8_max / amax) / 2**margin     if amax is finite and > 0
        scale = previous scale                   otherwise

    Args:
        margin: non-negative int; the scale leaves ``2**margin`` of headroom.
        fp8_format: :class:`Format` (default HYBRID).
        amax_history_len: number of steps of amax history (>= 1).
        amax_compute_algo: ``"max"`` (max over the history), ``"most_recent"``
            (this step's amax), or a callable ``history -> amax`` receiving the
            1-D fp32 history (slot 0 = this step) and returning a 0-d tensor.
        scaling_factor_compute_algo: None for the formula above, or a callable
            ``(amax, scale, fp8_max, recipe) -> scale`` used instead of it for
            finite positive amaxes (non-finite or zero amax still keeps the
            previous scale).
        reduce_amax: all-reduce amaxes over the amax reduction group (set False
            to keep per-rank scales).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    scaling_factor_compute_algo: Optional[ScalingFactorComputeAlgo] = None
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        _check_type("DelayedScaling.margin", self.margin, int, "a non-negative int")
        if self.margin < 0:
            raise ValueError(
                f"DelayedScaling.margin: expected a non-negative int, got {self.margin}"
            )
        _check_type("DelayedScaling.fp8_format", self.fp8_format, Format, "a recipe.Format")
        _check_not_fp4("DelayedScaling", self.fp8_format)
        _check_type(
            "DelayedScaling.amax_history_len", self.amax_history_len, int, "an int >= 1"
        )
        if self.amax_history_len < 1:
            raise ValueError(
                "DelayedScaling.amax_history_len: expected an int >= 1, "
                f"got {self.amax_history_len}"
            )
        algo = self.amax_compute_algo
        if not (callable(algo) or algo in ("max", "most_recent")):
            raise ValueError(
                "DelayedScaling.amax_compute_algo: expected 'max', 'most_recent' or a "
                f"callable(history) -> amax, got {algo!r}"
            )
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise ValueError(
                "DelayedScaling.scaling_factor_compute_algo: expected None or a callable"
                f"(amax, scale, fp8_max, recipe) -> scale, got {sf!r}"
            )
        _check_type("DelayedScaling.reduce_amax", self.reduce_amax, bool, "a bool")


@dataclass
class Float8CurrentScaling(Recipe):
    """Current scaling: each tensor's scale comes from its own amax, now.

    ``scale = fp8_max / amax(|x|)`` with the amax all-reduced (MAX) over the
    quantizer's amax reduction group when it has one, so that all tensor-parallel
    ranks use one scale. A zero or non-finite amax gives scale 1.0.

    Args:
        fp8_format: :class:`Format` (default HYBRID).
        power_2_scale: round each scale down to a power of two, so that scaling
            is exact (only the exponent changes).
    """

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False

    def __post_init__(self) -> None:
        _check_type(
            "Float8CurrentScaling.fp8_format", self.fp8_format, Format, "a recipe.Format"
        )
        _check_not_fp4("Float8CurrentScaling", self.fp8_format)
        _check_type("Float8CurrentScaling.power_2_scale", self.power_2_scale, bool, "a bool")


# ---- block-scaled and row-wise recipes ------------------------------------------------
# Each tensor carries many scales (one per block or row), computed from that block's own
# amax when it is quantized: there is no amax history and no amax reduction across ranks.


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

    def __post_init__(self) -> None:
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
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
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


def _env_flag(name: str) -> bool:
    return os.getenv(name, "0") == "1"


@dataclass
class NVFP4BlockScaling(Recipe):
    """NVFP4: FP4 E2M1 values with two levels of scaling (Transformer Engine's fields).

    Level 1: every block of 16 consecutive values of a row (16x16 tiles for weights)
    shares an E4M3 scale; level 2: one FP32 scale per tensor, from the tensor's amax.
    With ``g = amax_tensor / (6 * 448)`` a value decodes as
    ``fp4 * e4m3_block_scale * g``; the block scale is ``amax_block / 6 / g`` cast to
    E4M3 (saturating, round to nearest even) and the data ``x / (block_scale * g)``
    cast to E2M1 with saturation at +-6.

    Per tensor kind (TE's ``fp4_quant_fwd_inp`` / ``fp4_quant_fwd_weight`` /
    ``fp4_quant_bwd_grad`` :class:`QParams`, derived from the flags below):

    * inputs: 1x16 blocks; the column-wise copy (read by wgrad) gets the random
      Hadamard transform (RHT);
    * weights: 16x16 blocks, no RHT, round to nearest;
    * gradients: 1x16 blocks, RHT on the column-wise copy, stochastic rounding.

    The RHT multiplies each run of 16 values along the token dimension by
    ``diag(signs) @ H16 / 4`` (an orthogonal matrix): both wgrad operands get it, so
    ``dW = dy.T @ x`` is unchanged in exact arithmetic while outliers are spread out.
    Row-wise and column-wise copies are both quantized from high precision.

    Args (defaults from TE's environment variables ``NVTE_NVFP4_DISABLE_RHT``,
    ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING``, ``NVTE_NVFP4_DISABLE_2D_QUANTIZATION``,
    read when the recipe is built):
        disable_rht: no random Hadamard transform anywhere.
        disable_stochastic_rounding: round gradients to nearest too.
        disable_2d_quantization: 1x16 blocks for weights too.
        fp4_format: must be ``Format.E2M1``.
        fp8_format: format of the block scales, must be ``Format.E4M3``.
        fp8_dpa / fp8_mha: must be False (no low-precision attention).
        nvfp4_4over6: which tensors use 4over6 block scaling ("none", "weights",
            "activations" -- every non-weight forward tensor -- or "all"); gradients never
            do. Each 4over6 block keeps the map-to-4 or map-to-6 scale, whichever errs
            less (``tp_fuse.quantization.nvfp4.scaling_4over6``). Needs ``disable_rht=True`` when
            it covers activations (no RHT variant, as in TE).
        nvfp4_4over6_e4m3_use_256: which 4over6 tensors use 256 instead of 448 as the
            global scale's E4M3 bound (same values; default "all").
        nvfp4_4over6_err_mode: the 4over6 error metric, "MAE" or "MSE".
        row_scaled_activation, backward_override (None): TE's newer options, accepted
            at their defaults only (other values raise ValueError: not implemented here).
    """

    disable_rht: bool = field(default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = field(
        default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    )
    disable_2d_quantization: bool = field(default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization", "row_scaled_activation",
                     "fp8_dpa", "fp8_mha"):
            _check_type(f"NVFP4BlockScaling.{name}", getattr(self, name), bool, "a bool")
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"NVFP4BlockScaling.fp4_format: expected Format.E2M1, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError(
                f"NVFP4BlockScaling.fp8_format: expected Format.E4M3 (the block scales' format), got {self.fp8_format!r}"
            )
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("NVFP4BlockScaling: fp8_dpa/fp8_mha must be False (low-precision attention is not supported)")
        unsupported = {
            "row_scaled_activation": (self.row_scaled_activation, False),
            "backward_override": (self.backward_override, None),
        }
        for name, (value, default) in unsupported.items():
            if value != default:
                raise ValueError(
                    f"NVFP4BlockScaling.{name}: only {default!r} is implemented in tp-fuse, got {value!r}"
                )
        if self.nvfp4_4over6 not in ("none", "weights", "activations", "all"):
            raise ValueError(
                "NVFP4BlockScaling.nvfp4_4over6: expected 'none', 'weights', 'activations' or 'all', "
                f"got {self.nvfp4_4over6!r}"
            )
        if self.nvfp4_4over6_e4m3_use_256 not in ("none", "weights", "activations", "all"):
            raise ValueError(
                "NVFP4BlockScaling.nvfp4_4over6_e4m3_use_256: expected 'none', 'weights', 'activations' or 'all', "
                f"got {self.nvfp4_4over6_e4m3_use_256!r}"
            )
        if str(self.nvfp4_4over6_err_mode).upper() not in ("MAE", "MSE"):
            raise ValueError(
                f"NVFP4BlockScaling.nvfp4_4over6_err_mode: expected 'MAE' or 'MSE', got {self.nvfp4_4over6_err_mode!r}"
            )

    # TE derives these from the flags (RHT only on the column-wise copy, for wgrad).
    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        return QParams(random_hadamard_transform=not self.disable_rht)

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        return QParams(fp4_2d_quantization=not self.disable_2d_quantization)

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        return QParams(random_hadamard_transform=not self.disable_rht,
                       stochastic_rounding=not self.disable_stochastic_rounding)


_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


@dataclass
class CustomRecipe(Recipe):
    """Transformer Engine's ``CustomRecipe``: quantizers chosen per tensor by a factory.

    TE calls ``qfactory(role)`` once per quantizer slot of a module or op, with a
    ``QuantizerRole(module_type, tensor_type, name)``, and uses the quantizer (or
    ``DelayedScalingRequest``) it returns for that tensor, so one op may mix formats
    (e.g. MXFP8 forward, NVFP4 gradients).

    In tp-fuse the recipe is constructible and compares, copies and pickles like the
    other recipes (TE code that builds one, or classifies checkpoints by recipe type,
    runs), but ``autocast`` and ``quantized_model_init`` refuse it with a ValueError:
    tp-fuse's ops pick their GEMM and cast kernels from the recipe type and assume
    every operand of a GEMM has that one recipe's format, so per-role quantizers from
    an arbitrary factory cannot be run correctly. Use the built-in recipes.

    Args:
        qfactory: callable ``qfactory(role) -> quantizer``. Required (TE raises without
            one when the recipe is used; here a non-callable is refused at construction).
        fp8_format: TE reads it for backend selection only; default ``Format.HYBRID``.
        fp8_dpa, fp8_mha: FP8 attention flags (bools).
        backward_override: ``None``, ``"high_precision"`` or ``"dequantized"``; default from
            ``NVTE_BACKWARD_OVERRIDE`` as in TE.
        quantization_alignment: grouped-op padding alignment, > 0 (default 128).
    """

    qfactory: Callable[..., Any] = None  # type: ignore[assignment]
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))
    quantization_alignment: int = 128

    def __post_init__(self) -> None:
        # TE makes qfactory a required positional field; the default here only keeps the
        # dataclass field order (fields after it have defaults), so None is refused.
        if not callable(self.qfactory):
            raise ValueError(
                f"CustomRecipe.qfactory: expected a callable qfactory(role) -> quantizer, got {self.qfactory!r}"
            )
        _check_type("CustomRecipe.fp8_format", self.fp8_format, Format, "a Format")
        for name in ("fp8_dpa", "fp8_mha"):
            _check_type(f"CustomRecipe.{name}", getattr(self, name), bool, "a bool")
        if self.backward_override not in _BACKWARD_OVERRIDES:
            raise ValueError(
                f"CustomRecipe.backward_override (or NVTE_BACKWARD_OVERRIDE): expected one of "
                f"{_BACKWARD_OVERRIDES}, got {self.backward_override!r}"
            )
        _check_type("CustomRecipe.quantization_alignment", self.quantization_alignment, int, "a positive int")
        if self.quantization_alignment <= 0:
            raise ValueError(
                f"CustomRecipe.quantization_alignment: expected a positive int, got {self.quantization_alignment}"
            )
