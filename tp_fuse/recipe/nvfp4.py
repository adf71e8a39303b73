"""The NVFP4 recipe (FP4 E2M1 data with E4M3 block scales and an FP32 tensor scale)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .base import Format, Recipe, _check_type, check_backward_override, env_backward_override
from .block import QParams

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
        row_scaled_activation, backward_override: TE's options (``backward_override``
            defaults to ``NVTE_BACKWARD_OVERRIDE``), accepted with TE's values; only False /
            None run here (``autocast`` refuses the others, see :mod:`tp_fuse.recipe`).

    ``fp4_quant_fwd_inp`` / ``fp4_quant_fwd_weight`` / ``fp4_quant_bwd_grad``: TE's
    :class:`QParams` per tensor kind, made from the flags at construction (the bullets
    above) and assignable afterwards; the quantizers read these.
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
    backward_override: Optional[str] = field(default_factory=env_backward_override)
    # TE's per-tensor-kind parameters: made from the flags above at construction, assignable
    # afterwards (TE's tests do); fields, so that recipes with other QParams compare unequal.
    fp4_quant_fwd_inp: QParams = field(init=False)
    fp4_quant_fwd_weight: QParams = field(init=False)
    fp4_quant_bwd_grad: QParams = field(init=False)

    _kind = "nvfp4"

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
        check_backward_override("NVFP4BlockScaling", self.backward_override)
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

        # TE's derivation: RHT only on the column-wise copies (read by wgrad) of inputs and gradients.
        self.fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht)
        self.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        self.fp4_quant_bwd_grad = QParams(random_hadamard_transform=not self.disable_rht,
                                          stochastic_rounding=not self.disable_stochastic_rounding)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _QPARAMS_FIELDS:
            _check_qparams(name, value)
        super().__setattr__(name, value)


_QPARAMS_FIELDS = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")


def _check_qparams(name: str, value: Any) -> None:
    """An NVFP4 tensor kind's :class:`QParams`: the NVFP4 quantizer reads
    ``random_hadamard_transform``, ``stochastic_rounding`` and ``fp4_2d_quantization``;
    ``power_2_scale`` / ``amax_epsilon`` (FP8 block scaling's) would be ignored, so they
    are refused (as TE's NVFP4 recipe asserts)."""
    _check_type(f"NVFP4BlockScaling.{name}", value, QParams, "a recipe.QParams")
    if value.power_2_scale or value.amax_epsilon != 0.0:
        raise ValueError(f"NVFP4BlockScaling.{name}: power_2_scale / amax_epsilon are FP8 block scaling's and "
                         f"have no meaning for NVFP4; expected False / 0.0, got {value!r}")
