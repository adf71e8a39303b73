"""Transformer Engine's ``delay_wgrad_compute`` / ``backward_dw()`` on tp_fuse's TE module
classes (the deferral lives in ``tp_fuse.ops.basic.linear_wgrad``).

The backward pass leaves the weight gradients out (and gives the biases theirs); each
``backward_dw()`` computes the oldest deferred ones and puts them where the backward pass would
have -- ``weight.grad`` (accumulated) or ``weight.main_grad`` -- bit for bit (float64, and
under delayed-scaling FP8).
"""

from __future__ import annotations

import pytest
import torch

import tp_fuse
from tp_fuse import te
from tp_fuse.recipe import DelayedScaling

F64 = torch.float64
IN, OUT = 16, 24
SPLITS = [3, 0, 5]  # GroupedLinear's rows per GEMM (an empty group included)

MODULES = {
    "Linear": lambda **kw: te.Linear(IN, OUT, params_dtype=F64, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(IN, OUT, params_dtype=F64, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(IN, OUT, params_dtype=F64, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(3, IN, OUT, params_dtype=F64, **kw),
}


def _gemm_weights(m: torch.nn.Module) -> list[str]:
    return [n for n, _ in m.named_parameters() if "weight" in n and not n.startswith("layer_norm")]


def _run(name: str, delay: bool, fuse: bool, recipe=None, steps: int = 2) -> tuple[list[torch.Tensor], list]:
    """Outputs and gradients of ``steps`` forward/backward(/backward_dw) passes with gradients
    accumulated over them; and what each delayed backward left before its ``backward_dw``."""
    torch.manual_seed(0)
    m = MODULES[name](delay_wgrad_compute=delay, fuse_wgrad_accumulation=fuse)
    weights = _gemm_weights(m)
    if fuse:
        for n in weights:
            p = m.get_parameter(n)
            p.main_grad = torch.rand(p.shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    out, between = [], []
    for step in range(steps):
        x = torch.randn(8, IN, dtype=F64, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with tp_fuse.autocast(enabled=recipe is not None, recipe=recipe):
            y = m(x, SPLITS) if name == "GroupedLinear" else m(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=F64).reshape(y.shape)).sum().backward()
        if delay:
            params = dict(m.named_parameters())
            between.append(({n: params[n].grad for n in weights},
                            {n: params[n].main_grad.clone() for n in weights} if fuse else {},
                            {n: p.grad is not None for n, p in params.items() if n not in weights}))
            m.backward_dw()
        out += [y.detach(), x.grad]
    out += [p.main_grad if fuse and n in weights else p.grad for n, p in m.named_parameters()]
    return out, between


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_delayed_wgrad_equals_immediate(name: str, fuse: bool) -> None:
    ref, _ = _run(name, delay=False, fuse=fuse)
    got, between = _run(name, delay=True, fuse=fuse)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    # Before backward_dw: no weight gradient anywhere (main_grad untouched after the first step's
    # initial value), while the biases and norm weights already have theirs.
    grads, main_grads, others = between[0]
    assert all(g is None for g in grads.values())
    for n, mg in main_grads.items():
        torch.testing.assert_close(mg, torch.rand(mg.shape, dtype=F64, generator=torch.Generator().manual_seed(7)),
                                   rtol=0, atol=0)
    assert all(others.values()) and others


@pytest.mark.parametrize("name", ["Linear", "GroupedLinear"])
def test_delayed_wgrad_fp8_delayed_scaling(name: str) -> None:
    """The saved FP8 operands (input and gradient casts) are kept until backward_dw."""
    ref, _ = _run(name, delay=False, fuse=False, recipe=DelayedScaling(amax_history_len=4))
    got, _ = _run(name, delay=True, fuse=False, recipe=DelayedScaling(amax_history_len=4))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_backward_dw_without_pending_backward() -> None:
    x = torch.randn(4, IN, dtype=F64)
    # Without delay_wgrad_compute backward_dw does nothing (TE's); weight.grad stays autograd's.
    m = te.Linear(IN, OUT, params_dtype=F64)
    m(x).sum().backward()
    before = m.weight.grad.clone()
    m.backward_dw()
    assert not m.need_backward_dw()
    torch.testing.assert_close(m.weight.grad, before, rtol=0, atol=0)
    # With it and no backward pass waiting: TE's Linear raises, its GroupedLinear returns.
    m = te.Linear(IN, OUT, params_dtype=F64, delay_wgrad_compute=True)
    assert m.need_backward_dw()
    with pytest.raises(ValueError, match=r"BasicLinear.backward_dw\(\): no deferred weight gradient is waiting"):
        m.backward_dw()
    m(x).sum().backward()
    m.backward_dw()
    with pytest.raises(ValueError, match="no deferred weight gradient is waiting"):
        m.backward_dw()
    g = te.GroupedLinear(2, IN, OUT, params_dtype=F64, delay_wgrad_compute=True)
    g.backward_dw()
    assert g.weight0.grad is None


def test_backward_dw_runs_hooks_and_marks_weights() -> None:
    """TE's DDP contract: the weights skip their backward post hooks; the registered hooks run
    after the deferred gradients are in place."""
    m = te.LayerNormMLP(IN, OUT, params_dtype=F64, delay_wgrad_compute=True)
    assert m.fc1_weight.skip_backward_post_hook and m.fc2_weight.skip_backward_post_hook
    seen = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(m.fc1_weight.grad is not None))
    m(torch.randn(4, IN, dtype=F64)).sum().backward()
    assert seen == []
    m.backward_dw()
    assert seen == [True]
    with pytest.raises(ValueError, match="hook must be callable"):
        m.register_wgrad_accumulation_and_reduce_hooks(3)


def test_delay_wgrad_switch_refuses_pending() -> None:
    m = te.Linear(IN, OUT, params_dtype=F64, delay_wgrad_compute=True)
    m(torch.randn(4, IN, dtype=F64)).sum().backward()
    with pytest.raises(ValueError, match=r"delay_wgrad_compute=False while 1 deferred weight gradient"):
        m._linears[""].delay_wgrad_compute = False
