"""Transformer Engine API points of issue 23's quantizer files: ``CustomRecipe`` (TE's
fields and checks; constructible, refused by ``autocast`` / ``quantized_model_init`` since
the ops cannot run per-role quantizers), ``constants.TE_DType`` / ``TE_DType_To_Torch``
(TE's tables), and ``Float8Quantizer`` built with a non-fp32 scale (TE constructs it; the
cast needs fp32)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import tp_fuse
from tp_fuse import DType, Float8Quantizer
from tp_fuse.constants import TE_DType, TE_DType_To_Torch
from tp_fuse.recipe import CustomRecipe, DelayedScaling, Format, Recipe


def _factory(role):  # module level: the recipe pickles (TE's checkpoint tests pickle it)
    return None


def test_custom_recipe_fields_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    r = CustomRecipe(qfactory=_factory)
    assert isinstance(r, Recipe) and r.custom() and not r.delayed() and not DelayedScaling().custom()
    assert (r.fp8_format, r.fp8_dpa, r.fp8_mha, r.backward_override, r.quantization_alignment) == (
        Format.HYBRID, False, False, None, 128)
    assert CustomRecipe(_factory) == r  # qfactory is TE's first field
    assert pickle.loads(pickle.dumps(r)) == r and copy.copy(r) == r
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")  # TE's default comes from the env
    assert CustomRecipe(qfactory=_factory).backward_override == "dequantized"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"qfactory": None}, r"CustomRecipe\.qfactory: expected a callable"),
        ({"qfactory": _factory, "backward_override": "fp32"}, r"backward_override .*expected one of"),
        ({"qfactory": _factory, "quantization_alignment": 0}, r"quantization_alignment: expected a positive int"),
        ({"qfactory": _factory, "fp8_dpa": 1}, r"CustomRecipe\.fp8_dpa: expected a bool"),
    ],
)
def test_custom_recipe_refuses_bad_fields(kwargs: dict, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    with pytest.raises(ValueError, match=match):
        CustomRecipe(**kwargs)


def test_custom_recipe_refused_by_autocast_and_model_init() -> None:
    r = CustomRecipe(qfactory=_factory)
    with pytest.raises(ValueError, match=r"autocast: recipe: CustomRecipe .* not supported"):
        with tp_fuse.autocast(recipe=r):
            pass
    with pytest.raises(ValueError, match=r"quantized_model_init: recipe: CustomRecipe .* not supported"):
        with tp_fuse.quantized_model_init(recipe=r):
            pass


def test_te_dtype_tables_match_te() -> None:
    assert TE_DType == {
        torch.uint8: DType.kByte, torch.float8_e4m3fn: DType.kFloat8E4M3, torch.float8_e5m2: DType.kFloat8E5M2,
        torch.int32: DType.kInt32, torch.float32: DType.kFloat32, torch.float16: DType.kFloat16,
        torch.bfloat16: DType.kBFloat16,
    }
    assert all(TE_DType[TE_DType_To_Torch[d]] is d for d in TE_DType_To_Torch)
    assert TE_DType_To_Torch[DType.kFloat8E5M2] is torch.float8_e5m2
    with pytest.raises(KeyError):  # TE's table has no int64 entry either
        TE_DType[torch.int64]


def test_float8_quantizer_int_scale_constructs_but_cast_needs_fp32() -> None:
    q = Float8Quantizer(scale=torch.tensor([1]), amax=torch.tensor([0]), fp8_dtype=DType.kFloat8E5M2)
    assert q.fp8_dtype is torch.float8_e5m2 and q.scale.dtype is torch.int64  # held as given, as in TE
    with pytest.raises(ValueError, match=r"Float8Quantizer scale: casting needs a one-element fp32 tensor, got dtype torch.int64"):
        q(torch.ones(4, 4))
    q.scale, q.amax = torch.tensor([1.0]), torch.tensor([0.0])
    assert torch.equal(q(torch.ones(4, 4)).dequantize(), torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"Float8Quantizer scale: expected a one-element tensor"):
        Float8Quantizer(scale=torch.ones(2), amax=torch.zeros(1), fp8_dtype=DType.kFloat8E4M3)
