"""Contracts a CUDA graph (or any replay of recorded ops) relies on, checked on CPU.

A replay runs the recorded kernels against fixed addresses and none of tp_fuse's Python.
These tests catch, without a GPU, what would otherwise be silently wrong on one:

* a step replayed from recorded ops (``make_fx`` of forward + backward, replayed as an
  ``fx.GraphModule``: tp_fuse's Python is not re-run, as in a CUDA graph replay) with the
  end-of-step FP8 work run the way the graphed path runs it
  (``step_record.FP8StepMembership.reduce_and_update``, outside the replay) leaves the
  quantizers' scales, histories and counters, and the outputs, bit-identical to eager
  steps -- delayed and current scaling; without that end-of-step work the delayed scales
  freeze (checked too, so the comparison is known to be sensitive);
* no quantizer state tensor is rebound after the first step: not by a second step, a step
  where a quantizer is unused, a step where a new op first runs, nor a checkpoint load;
  a device move after it is refused;
* the lazy first move of quantizer state to the data's device (a host-to-device copy) is
  refused during a CUDA graph capture.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tp_fuse as te
from tp_fuse.quantization.op_quantizers import make_quantizer
from tp_fuse.quantization.step_record import (
    FP8StepMembership,
    find_quantizers,
    record_fp8_step,
    reset_fp8_state,
    snapshot_fp8_state,
)
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

H, TOKENS, STEPS, LR = 32, 16, 6, 0.002
STATE = ("scale", "amax_history", "last_amax", "nonfinite_amax_count", "zero_amax_count")
RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": lambda: Float8CurrentScaling()}


def _block() -> te.ops.Sequential:
    # No GELU: its CPU backward branches on the data (a host read), which make_fx cannot
    # record; the CUDA path's Triton kernel does not.
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, 4 * H), te.ops.Linear(4 * H, H))


def _step_fn(model: torch.nn.Module, recipe):
    params = list(model.parameters())

    def step(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.detach().requires_grad_()
        with te.autocast(recipe=recipe):
            y = model(x)
        return (y, *torch.autograd.grad(y, [x, *params], dy))

    return step


def _sgd(model: torch.nn.Module, grads) -> None:
    # Outside the replay, in place: the recorded ops read the parameters' storage.
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(LR * g)


def _state(model: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    return [(q.role, n, getattr(q, n).clone()) for q in find_quantizers([model]) for n in STATE if hasattr(q, n)]


def _inputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    # Growing magnitudes: the delayed scales must move from step to step.
    return torch.randn(TOKENS, H, generator=g) * (1 + i), torch.randn(TOKENS, H, generator=g) * (1 + 2 * i)


def _recorded(model: torch.nn.Module, recipe) -> tuple[torch.fx.GraphModule, FP8StepMembership]:
    """The graphed path's set-up, with make_fx in place of a CUDA graph capture: a warm-up
    step that records the end-of-step membership, the state put back, the step recorded."""
    step = _step_fn(model, recipe)
    x, dy = _inputs(0)
    snapshot = snapshot_fp8_state(find_quantizers([model]))
    membership = FP8StepMembership()
    with record_fp8_step(membership):
        step(x, dy)  # warm-up: builds the quantizers, moves nothing later
    reset_fp8_state(find_quantizers([model]), snapshot)
    with record_fp8_step(FP8StepMembership()):
        graph = make_fx(step)(x, dy)  # runs the ops once more (real tensors): reset again
    reset_fp8_state(find_quantizers([model]), snapshot)
    return graph, membership


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_replayed_step_keeps_fp8_state_equal_to_eager(recipe_name):
    recipe = RECIPES[recipe_name]()
    replayed, eager = _block(), _block()
    graph, membership = _recorded(replayed, recipe)
    if recipe_name == "delayed":
        assert len(membership) == 6  # input + weight of two Linears, and their grad_output
    eager_step = _step_fn(eager, recipe)
    for i in range(1, STEPS + 1):
        x, dy = _inputs(i)
        with torch.no_grad():
            out_r = graph(x, dy)  # the recorded ops only: no tp_fuse Python runs
        membership.reduce_and_update()
        out_e = eager_step(x, dy)
        for a, b in zip(out_r, out_e):
            assert torch.equal(a, b) and bool(a.isfinite().all()), f"step {i}: outputs differ or are not finite"
        for (role, name, a), (_, _, b) in zip(_state(replayed), _state(eager)):
            assert torch.equal(a, b), f"step {i}: {role}.{name} {a} (replayed) != {b} (eager)"
        _sgd(replayed, out_r[2:])
        _sgd(eager, out_e[2:])
    if recipe_name == "current":
        counted = [q for q in find_quantizers([replayed]) if int(q.zero_amax_count) or int(q.nonfinite_amax_count)]
        assert not counted  # finite non-zero data: the counters stay 0 in both
        assert all(float(q.last_amax) > 0 for q in find_quantizers([replayed]))  # written by the replay


def test_replay_without_end_of_step_update_freezes_delayed_scales():
    """Why the graphed path must run the recorded update: a replay alone leaves the
    delayed scales at their initial 1.0 (the comparison above is sensitive to it)."""
    model = _block()
    graph, _ = _recorded(model, DelayedScaling(amax_history_len=4))
    for i in range(1, 4):
        with torch.no_grad():
            graph(*_inputs(i))
    assert all(float(q.scale) == 1.0 for q in find_quantizers([model]))
    assert any(float(q.amax_history[0]) > 0 for q in find_quantizers([model]))  # the slots were folded


def _addresses(quantizers) -> dict[tuple[int, str], tuple[int, int]]:
    return {(id(q), n): (id(getattr(q, n)), getattr(q, n).data_ptr())
            for q in quantizers for n in STATE if hasattr(q, n)}


def test_no_quantizer_state_tensor_is_rebound_after_the_first_step():
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    a, b, c = te.ops.Linear(H, H), te.ops.Linear(H, H), te.ops.Linear(H, H)

    def step(*ops: torch.nn.Module) -> None:
        x = torch.randn(TOKENS, H, requires_grad=True)
        with te.autocast(recipe=recipe):
            y = x
            for op in ops:
                y = op(y)
        y.sum().backward()

    step(a, b)
    first = find_quantizers([a, b])
    seen = _addresses(first)
    step(a, b)
    assert _addresses(first) == seen, "a second step rebound state"
    b_state = [(n, t.clone()) for n, t in ((n, getattr(q, n)) for q in find_quantizers([b]) for n in STATE[:4])]
    step(a)  # b unused: its rows are kept, untouched
    assert _addresses(first) == seen, "a step with an unused quantizer rebound state"
    for (n, before), (_, now) in zip(b_state, ((n, getattr(q, n)) for q in find_quantizers([b]) for n in STATE[:4])):
        assert torch.equal(before, now), f"an unused quantizer's {n} changed"
    step(a, b, c)  # c's quantizers appear: they join a new group
    assert _addresses(first) == seen, "a new quantizer rebound the existing groups' state"
    for op in (a, b):
        op.load_state_dict(copy.deepcopy(op.state_dict()))
    assert _addresses(first) == seen, "a checkpoint load rebound state"
    step(a, b, c)
    assert _addresses(first) == seen


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_lazy_state_move_is_refused_during_capture(monkeypatch, recipe_name):
    """Quantizer state born elsewhere is moved at its first cast: a host-to-device copy,
    illegal inside a CUDA graph capture, so it is refused there (simulated on CPU: the
    state sits on the meta device and torch reports a capture in progress)."""
    q = make_quantizer(RECIPES[recipe_name](), "input")
    for name in STATE:
        if hasattr(q, name):
            setattr(q, name, getattr(q, name).to("meta"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="would be copied to cpu during CUDA graph capture"):
        q.quantize(torch.randn(4, 8))


def test_delayed_state_cannot_move_after_its_first_update():
    q = te.ops.Linear(H, H)
    with te.autocast(recipe=DelayedScaling()):
        y = q(torch.randn(TOKENS, H))
    (quantizer,) = [x for x in find_quantizers([q]) if x.role == "input"]
    assert quantizer._shared_state is not None
    with pytest.raises(ValueError, match="static from then on; got data on meta"):
        quantizer.quantize(torch.randn(4, 8, device="meta"))
    assert y.shape == (TOKENS, H)
