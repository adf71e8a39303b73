"""Activation recompute (``tp_fuse.checkpoint``, ``GPT.set_activation_checkpointing``).

Recompute must not change training at all: the same losses, gradients and FP8 state
(amax histories, scales) bit for bit, with dropout on, for every recipe. The recompute
really happens (the recomputed modules run twice per step).
"""

from __future__ import annotations

import pytest
import torch

import tp_fuse
from tp_fuse.layers import GPT, GPTConfig
from tp_fuse.distributed import fp8_quantizers
from tp_fuse.quantization import DelayedScalingQuantizer
from tp_fuse import te
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

CFG = dict(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=2, num_heads=4,
           hidden_dropout=0.1, attention_dropout=0.1)
RECIPES = {"none": None, "delayed": lambda: DelayedScaling(amax_history_len=4),
           "current": lambda: Float8CurrentScaling()}
STEPS = 3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen)


def _fp8_state(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for q in fp8_quantizers([model]):
        if isinstance(q, DelayedScalingQuantizer):
            out += [q.amax_history.clone(), q.scale.clone()]
    return out


def _train(mode: str, recipe_name: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG), seed=3)
    model.set_activation_checkpointing(mode)
    calls = {"core": 0}
    model.layers[0].attention.core.register_forward_pre_hook(lambda *_: calls.__setitem__("core", calls["core"] + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] else None
    losses, grads = [], []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        with tp_fuse.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(tokens, labels)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "grads": grads, "fp8": _fp8_state(model), "core_calls": calls["core"]}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_is_exact(mode: str, recipe: str) -> None:
    ref = _train("none", recipe)
    got = _train(mode, recipe)
    # The recomputed attention started a second time in every step's backward (a pre-hook:
    # torch stops a recompute early once the last saved tensor is rebuilt).
    assert ref["core_calls"] == STEPS and got["core_calls"] == 2 * STEPS
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=0)
    for g_step, r_step in zip(got["grads"], ref["grads"]):
        for g, r in zip(g_step, r_step):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    if recipe == "delayed":
        assert ref["fp8"], "no delayed-scaling quantizer was used"
        assert len(got["fp8"]) == len(ref["fp8"])
        for g, r in zip(got["fp8"], ref["fp8"]):  # amax histories and scales
            torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_checkpoint_argument_errors() -> None:
    lin = torch.nn.Linear(2, 2)
    x = torch.randn(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant must be a bool"):
        tp_fuse.checkpoint(lin, x, use_reentrant="yes")
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        tp_fuse.checkpoint(lin, x, distribute_saved_activations=True)
    with pytest.raises(ValueError, match="modules"):
        tp_fuse.checkpoint(lambda t: lin(t), x)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        GPT(GPTConfig(**CFG)).set_activation_checkpointing("some")


def _checkpointed_mlp(engine: str, recipe_name: str) -> list[torch.Tensor]:
    """Output, input gradient, parameter gradients and delayed-scaling state of two steps of
    a float64 LayerNormMLP + dropout region run plainly or checkpointed by ``engine``."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(te.LayerNormMLP(16, 32, params_dtype=torch.float64), torch.nn.Dropout(0.2))
    recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] else None
    out = []
    for step in range(2):
        x = torch.randn(4, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(step),
                        requires_grad=True)
        with tp_fuse.autocast(enabled=recipe is not None, recipe=recipe):
            if engine == "none":
                y = block(x)
            else:
                y = tp_fuse.checkpoint(block, x, use_reentrant=engine == "reentrant")
        (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        out += [y.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad(set_to_none=True)
    return out + _fp8_state(block)


@pytest.mark.parametrize("recipe", ["none", "delayed"])
def test_reentrant_checkpoint_matches_non_reentrant(recipe: str) -> None:
    """``use_reentrant=True`` (TE's default engine) gives the gradients, dropout masks and FP8
    state of ``use_reentrant=False`` and of no checkpoint, bit for bit."""
    ref = _checkpointed_mlp("none", recipe)
    for engine in ("non-reentrant", "reentrant"):
        got = _checkpointed_mlp(engine, recipe)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
