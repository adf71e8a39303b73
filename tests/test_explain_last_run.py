"""te.explain(module) after the forward, outside autocast, explains what the forward ran
(the README's ops snippet calls it that way), and says which recipe the explanation is for."""

from __future__ import annotations

import torch

import tp_fuse as te
from tp_fuse.recipe import Float8CurrentScaling


def _mlp() -> te.ops.Sequential:
    return te.ops.Sequential(te.ops.LayerNorm(64), te.ops.Linear(64, 128), te.ops.GELU(), te.ops.Linear(128, 64))


def test_explain_outside_autocast_reports_the_fp8_forward_that_ran():
    mlp = _mlp()
    before = te.explain(mlp)  # never ran, no autocast: high precision, and it says so
    assert before.recipe is None and before.basis == "recipe in force"
    assert str(before).splitlines()[0] == "FP8: off (high precision) [recipe in force]"

    x = torch.randn(32, 64, requires_grad=True)
    with te.autocast():
        y = mlp(x)
    y.sum().backward()
    after = te.explain(mlp)  # outside autocast, as in the README
    assert after.basis == "last forward"
    assert after.recipe is not None and after.recipe.startswith("DelayedScaling(")
    assert str(after).splitlines()[0].startswith("FP8 recipe: DelayedScaling(") and "[last forward]" in str(after)
    # The FP8-only fusion that ran is in the explanation.
    assert any(op.startswith("ForwardNormQuantizeLinear(") for op in after.forward_ops)
    # The next forward in FP8 uses the same decisions (nothing re-decided in between).
    fuser = mlp.fusers()[0]
    key = fuser._fusion_key
    with te.autocast():
        mlp(x)
    assert fuser._fusion_key == key

    # Inside autocast with another recipe: that recipe's decisions, labelled as such.
    with te.autocast(recipe=Float8CurrentScaling()):
        current = te.explain(mlp)
    assert current.basis == "recipe in force" and current.recipe.startswith("Float8CurrentScaling(")

    # A high-precision forward afterwards: explained as high precision.
    mlp(x)
    hp = te.explain(mlp)
    assert hp.recipe is None and hp.basis == "last forward"
    assert not any(op.startswith("ForwardNormQuantizeLinear(") for op in hp.forward_ops)
