"""TE's recipe fields that TE's module-level tests set or read (issue 38 point 4).

``backward_override`` (every TE recipe), ``NVFP4BlockScaling.row_scaled_activation`` and the
assignable ``fp4_quant_*`` QParams; TE's predicates (``nvfp4()``, ``mxfp8()``...). What tp_fuse
does not implement is accepted with TE's values at construction and refused by ``autocast``
with the field's name, never ignored.
"""

from __future__ import annotations

import pytest
import torch

import tp_fuse
from tp_fuse.quantization.nvfp4.quantizer import NVFP4Quantizer
from tp_fuse.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
)

_PREDICATES = ("delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8", "nvfp4", "custom")


@pytest.mark.parametrize("recipe, kind", [
    (DelayedScaling(), "delayed"), (Float8CurrentScaling(), "float8_current_scaling"),
    (Float8BlockScaling(), "float8_block_scaling"), (MXFP8BlockScaling(), "mxfp8"),
    (NVFP4BlockScaling(), "nvfp4"), (CustomRecipe(qfactory=lambda role: None), "custom"),
])
def test_each_recipe_answers_exactly_its_te_predicate(recipe, kind):
    assert [p for p in _PREDICATES if getattr(recipe, p)()] == [kind]
    assert recipe.float8_per_tensor_scaling() == (kind in ("delayed", "float8_current_scaling"))


@pytest.mark.parametrize("make", [Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling])
def test_backward_override_is_accepted_then_refused_by_autocast(make, monkeypatch):
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    assert make().backward_override is None
    recipe = make(backward_override="dequantized")
    with pytest.raises(ValueError, match=rf"{make.__name__}\.backward_override='dequantized'"):
        with tp_fuse.autocast(recipe=recipe):
            pass
    # TE's tests set the field after construction: refused just the same.
    later = make()
    later.backward_override = "high_precision"
    with pytest.raises(ValueError, match="backward_override='high_precision'"):
        with tp_fuse.autocast(recipe=later):
            pass
    with pytest.raises(ValueError, match=r"backward_override .*expected one of"):
        make(backward_override="fp32")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    assert make().backward_override == "high_precision"  # TE's environment default


def test_delayed_scaling_has_no_backward_override():
    with pytest.raises(ValueError, match="DelayedScaling.backward_override"):
        DelayedScaling(backward_override="high_precision")


def test_row_scaled_activation_is_refused_where_used():
    recipe = NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True)
    with pytest.raises(ValueError, match=r"row_scaled_activation=True"):
        with tp_fuse.autocast(recipe=recipe):
            pass
    with pytest.raises(ValueError, match="row_scaled_activation"):
        NVFP4BlockScaling(row_scaled_activation=1)


def test_mxfp8_2d_quantization_is_refused_where_used():
    recipe = MXFP8BlockScaling(enable_2d_quantization=True)
    with pytest.raises(ValueError, match=r"MXFP8BlockScaling.enable_2d_quantization=True"):
        with tp_fuse.autocast(recipe=recipe):
            pass


def test_fp4_qparams_are_assignable_and_reach_the_quantizer():
    recipe = NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False, disable_2d_quantization=False)
    assert NVFP4Quantizer.for_role(recipe, "grad_output").stochastic_rounding is True
    # TE's test_numerics: gradients with RHT but without stochastic rounding.
    recipe.fp4_quant_bwd_grad = QParams(random_hadamard_transform=True, fp4_2d_quantization=False)
    q = NVFP4Quantizer.for_role(recipe, "grad_output")
    assert (q.with_rht, q.stochastic_rounding) == (True, False)
    recipe.fp4_quant_fwd_weight = QParams()
    assert NVFP4Quantizer.for_role(recipe, "weight").with_2d_quantization is False
    # A recipe with other QParams is another recipe (quantizer state is keyed by equality).
    assert recipe != NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False,
                                       disable_2d_quantization=False)


@pytest.mark.parametrize("bad", [QParams(power_2_scale=True), QParams(amax_epsilon=1e-3), "rht"])
def test_fp4_qparams_refuse_what_nvfp4_would_ignore(bad):
    recipe = NVFP4BlockScaling()
    with pytest.raises(ValueError, match="NVFP4BlockScaling.fp4_quant_fwd_inp"):
        recipe.fp4_quant_fwd_inp = bad


def test_assigned_qparams_change_the_numbers():
    """The assignment is used, not ignored: 2-D weight blocks give other FP4 values than 1-D."""
    torch.manual_seed(0)
    w = torch.randn(32, 32, dtype=torch.float32) * torch.logspace(-2, 2, 32)[:, None]
    recipe = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    one_d = NVFP4Quantizer.for_role(recipe, "weight")(w).dequantize()
    recipe.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=True)
    two_d = NVFP4Quantizer.for_role(recipe, "weight")(w).dequantize()
    assert not torch.equal(one_d, two_d)
