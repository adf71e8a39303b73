"""FP8 weights cast once per optimizer step and reused across micro-batches (FP8WeightCache)."""

from __future__ import annotations

import copy

import pytest
import torch

import tp_fuse as te
from tp_fuse.kernels import record_kernel_paths
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

H, FFN, TOKENS = 32, 64, 16


def _mlp(seed: int = 0) -> te.ops.Sequential:
    torch.manual_seed(seed)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, FFN), te.ops.GELU(), te.ops.Linear(FFN, H))


def _micro_batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(TOKENS, H, generator=g) for _ in range(n)]


def _accumulate(model, batches, recipe, cache=None) -> list[int]:
    """Forward + backward of each micro-batch; the weight casts each one made."""
    casts = []
    for x in batches:
        with record_kernel_paths() as log:
            with te.autocast(recipe=recipe, weight_cache=cache):
                y = model(x)
            y.square().mean().backward()
        casts.append(len(log.backends("quantize")))
    return casts


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_later_micro_batches_reuse_the_weight_casts(recipe):
    model, cache = _mlp(), te.FP8WeightCache()
    casts = _accumulate(model, _micro_batches(3), recipe, cache)
    uncached = _accumulate(_mlp(), _micro_batches(3), recipe)
    # Two Linears: their weights are cast by the first micro-batch only.
    assert casts == [uncached[0], uncached[0] - 2, uncached[0] - 2]
    assert (cache.misses, cache.hits, len(cache)) == (2, 4, 2)


def test_current_scaling_with_the_cache_equals_without_bit_for_bit():
    """Current scaling's weight cast depends only on the weight: reusing it changes nothing."""
    recipe = Float8CurrentScaling()
    a, b = _mlp(), _mlp()
    _accumulate(a, _micro_batches(3), recipe, te.FP8WeightCache())
    _accumulate(b, _micro_batches(3), recipe)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), name


def test_delayed_scaling_reuses_the_first_micro_batchs_cast():
    """Delayed scaling updates the weight's scale after each forward; the cached cast keeps
    the first micro-batch's bytes and scale_inv (Transformer Engine's weight caching), and
    the weight quantizer still joins every update (its slot says "no data")."""
    recipe = DelayedScaling(amax_history_len=4)
    model, cache = _mlp(), te.FP8WeightCache()
    linear = model[1]
    batches = _micro_batches(2)
    _accumulate(model, batches[:1], recipe, cache)
    first = cache._entries[id(linear.basic_ops[0])][1]
    q = linear.basic_ops[0]._quantizers.quantizers["weight"]
    history_after_first = q.amax_history.clone()
    _accumulate(model, batches[1:], recipe, cache)
    assert cache._entries[id(linear.basic_ops[0])][1] is first
    # The second micro-batch's update rolled the history with an empty slot.
    assert torch.equal(q.amax_history[-1], torch.zeros(()))
    assert torch.equal(q.amax_history[-2], history_after_first[-1])


@pytest.mark.parametrize("change", ["optimizer_step", "load_state_dict", "in_place_edit", "rebind_data", "recipe"])
def test_any_change_to_the_weight_casts_again(change):
    recipe = DelayedScaling()
    model, cache = _mlp(), te.FP8WeightCache()
    batches = _micro_batches(2)
    _accumulate(model, batches[:1], recipe, cache)
    linear = model[1].basic_ops[0]
    if change == "optimizer_step":
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    elif change == "load_state_dict":
        state = copy.deepcopy(model.state_dict())
        model.load_state_dict(state)
    elif change == "in_place_edit":
        with torch.no_grad():
            linear.weight.mul_(2.0)
    elif change == "rebind_data":
        linear.weight.data = linear.weight.detach().clone() * 2
    elif change == "recipe":
        recipe = DelayedScaling(margin=1)
    casts = _accumulate(model, batches[1:], recipe, cache)
    uncached = _accumulate(_mlp(), batches[:1], DelayedScaling())
    # The edits of one weight recast that weight only; the others recast both.
    changed = 1 if change in ("in_place_edit", "rebind_data") else 2
    assert casts == [uncached[0] - (2 - changed)], change
    assert cache.misses == 2 + changed


def test_a_cached_weight_after_an_edit_is_never_used():
    """Regression guard for the silent case: the GEMM after an in-place edit of the weight
    uses the new values (the output equals a fresh model's with the edited weight)."""
    recipe = Float8CurrentScaling()
    model, cache = _mlp(), te.FP8WeightCache()
    x = _micro_batches(1)[0]
    with te.autocast(recipe=recipe, weight_cache=cache):
        model(x)
    with torch.no_grad():
        model[1].basic_ops[0].weight.mul_(-1.0)
    fresh = copy.deepcopy(model)
    with te.autocast(recipe=recipe, weight_cache=cache):
        y = model(x)
    with te.autocast(recipe=recipe):
        y_ref = fresh(x)
    assert torch.equal(y, y_ref)


def test_clear_and_bad_arguments():
    cache = te.FP8WeightCache()
    _accumulate(_mlp(), _micro_batches(1), DelayedScaling(), cache)
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="weight_cache: expected a tp_fuse.FP8WeightCache"):
        with te.autocast(weight_cache={}):
            pass


def test_nested_autocast_inherits_the_cache():
    cache = te.FP8WeightCache()
    with te.autocast(recipe=DelayedScaling(), weight_cache=cache) as outer:
        with te.autocast(recipe=DelayedScaling()) as inner:
            assert inner.weight_cache is cache and outer.weight_cache is cache


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"),
                                    DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed-most-recent", "delayed-max", "current"])
def test_a_recast_in_the_window_equals_a_reuse(recipe):
    """A cached cast that cannot be reused (a new storage or version with the same values,
    as FSDP2's re-gathered weights) is cast again exactly as the window's first cast: the
    run equals the one that reused it, bit for bit, scales and histories included (FSDP2
    and DDP trained apart by 2e-3 when the recast took the updated scale and its amax)."""
    runs = []
    for force_recast in (False, True):
        model, cache = _mlp(), te.FP8WeightCache()
        for micro, x in enumerate(_micro_batches(3)):
            if force_recast and micro > 0:
                with torch.no_grad():
                    for linear in (model[1].basic_ops[0], model[3].basic_ops[0]):
                        linear.weight.mul_(1.0)  # same values, new version: the cache misses
            with te.autocast(recipe=recipe, weight_cache=cache):
                y = model(x)
            y.square().mean().backward()
        assert (cache.hits, cache.misses) == ((0, 6) if force_recast else (4, 2))
        q = model[1].basic_ops[0]._quantizers.quantizers["weight"]
        runs.append(([p.grad for p in model.parameters()], q.scale.clone(),
                     getattr(q, "amax_history", torch.zeros(1)).clone()))
    (grads_a, scale_a, hist_a), (grads_b, scale_b, hist_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert torch.equal(scale_a, scale_b) and torch.equal(hist_a, hist_b)


def test_an_optimizer_step_through_data_ends_the_window():
    """An optimizer that writes the weights through ``param.data`` (no version bump) still
    ends the cache's window: the next forward casts the new values (stale casts before)."""
    recipe = Float8CurrentScaling()
    model, cache = _mlp(), te.FP8WeightCache()
    x = _micro_batches(1)[0]

    class DataCopyingSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.data.copy_(p.data - group["lr"] * p.grad)  # no version bump

    opt = DataCopyingSGD(model.parameters(), lr=0.5)
    with te.autocast(recipe=recipe, weight_cache=cache):
        y = model(x)
    y.square().mean().backward()
    opt.step()
    fresh = copy.deepcopy(model)
    with te.autocast(recipe=recipe, weight_cache=cache):
        y = model(x)
    with te.autocast(recipe=recipe):
        y_ref = fresh(x)
    assert torch.equal(y, y_ref)
