"""Per-tensor FP8 recipes (:class:`DelayedScaling`, :class:`Float8CurrentScaling`) and TE's
:class:`CustomRecipe`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from .base import Format, Recipe, _check_not_fp4, _check_type, check_backward_override, env_backward_override

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
        backward_override: None only (TE's field; delayed scaling has none).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    scaling_factor_compute_algo: Optional[ScalingFactorComputeAlgo] = None
    reduce_amax: bool = True
    backward_override: Optional[str] = None

    _kind = "delayed"

    def __post_init__(self) -> None:
        # TE: delayed scaling has no backward override (its backward reads the FP8 forward tensors).
        if self.backward_override is not None:
            raise ValueError(f"DelayedScaling.backward_override: expected None (delayed scaling has no "
                             f"backward override, as in TE), got {self.backward_override!r}")
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
        backward_override: TE's (default ``NVTE_BACKWARD_OVERRIDE``); only None runs here
            (``autocast`` refuses the others, see :mod:`tp_fuse.recipe`).
    """

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    backward_override: Optional[str] = field(default_factory=env_backward_override)

    _kind = "float8_current_scaling"

    def __post_init__(self) -> None:
        check_backward_override("Float8CurrentScaling", self.backward_override)
        _check_type(
            "Float8CurrentScaling.fp8_format", self.fp8_format, Format, "a recipe.Format"
        )
        _check_not_fp4("Float8CurrentScaling", self.fp8_format)
        _check_type("Float8CurrentScaling.power_2_scale", self.power_2_scale, bool, "a bool")


# ---- block-scaled and row-wise recipes ------------------------------------------------
# Each tensor carries many scales (one per block or row), computed from that block's own
# amax when it is quantized: there is no amax history and no amax reduction across ranks.


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
    backward_override: Optional[str] = field(default_factory=env_backward_override)
    quantization_alignment: int = 128

    _kind = "custom"

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
        check_backward_override("CustomRecipe", self.backward_override)
        _check_type("CustomRecipe.quantization_alignment", self.quantization_alignment, int, "a positive int")
        if self.quantization_alignment <= 0:
            raise ValueError(
                f"CustomRecipe.quantization_alignment: expected a positive int, got {self.quantization_alignment}"
            )
