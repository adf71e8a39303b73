"""``tp_fuse.make_graphed_callables``: Transformer Engine's signature, its refusals, and
(on a GPU) graphed FP8 training equal to eager.

On CPU: the signature matches TE's, unsupported options are refused with a ValueError
naming the argument, and without CUDA the call says that CUDA graphs need a GPU. The FP8
bookkeeping the graphed path relies on is tested on CPU in ``test_graph_contracts.py``.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import tp_fuse as te
from tp_fuse.quantization.step_record import find_quantizers
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

#: Transformer Engine's ``make_graphed_callables`` parameters, in order, with defaults.
TE_SIGNATURE = [
    ("modules", inspect.Parameter.empty), ("sample_args", inspect.Parameter.empty), ("num_warmup_iters", 3),
    ("allow_unused_input", False), ("sample_kwargs", None), ("fp8_enabled", False), ("fp8_calibrating", False),
    ("fp8_recipe", None), ("fp8_group", None), ("fp8_weight_caching", False), ("_order", None),
    ("_num_layers_per_chunk", None), ("pool", None), ("retain_graph_in_backward", False),
    ("_reuse_graph_input_output_buffers", False),
]
H = 64


def test_signature_is_transformer_engines():
    params = inspect.signature(te.make_graphed_callables).parameters
    assert [(n, p.default) for n, p in params.items()] == TE_SIGNATURE


@pytest.mark.parametrize("kwargs, name", [
    ({"fp8_calibrating": True}, "fp8_calibrating"),
    ({"fp8_weight_caching": True}, "fp8_weight_caching"),
    ({"_order": [1, -1]}, "_order"),
    ({"_num_layers_per_chunk": [1]}, "_num_layers_per_chunk"),
    ({"_reuse_graph_input_output_buffers": True}, "_reuse_graph_input_output_buffers"),
    ({"retain_graph_in_backward": True}, "retain_graph_in_backward"),
    ({"sample_kwargs": {"mask": torch.ones(1)}}, "sample_kwargs"),
    ({"num_warmup_iters": 0}, "num_warmup_iters"),
    ({"fp8_enabled": True, "fp8_recipe": MXFP8BlockScaling()}, "fp8_recipe"),
    ({"fp8_group": "world"}, "fp8_group"),
])
def test_unsupported_options_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"make_graphed_callables: {name}"):
        te.make_graphed_callables(te.ops.Linear(H, H), (torch.randn(8, H),), **kwargs)


def test_fp8_needs_modules():
    with pytest.raises(ValueError, match="modules: with fp8_enabled every callable must be a torch.nn.Module"):
        te.make_graphed_callables(lambda x: x * 2, (torch.randn(8, H),), fp8_enabled=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_says_graphs_need_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA graphs need a GPU"):
        te.make_graphed_callables(te.ops.Linear(H, H), (torch.randn(8, H),), fp8_enabled=True)


# ---- GPU ------------------------------------------------------------------------------


def _layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return te.ops.Sequential(te.ops.LayerNorm(H), te.ops.Linear(H, 4 * H), te.ops.GELU(),
                             te.ops.Linear(4 * H, H)).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_graphed_fp8_training_equals_eager_over_10_steps(recipe):
    eager, graphed = _layer(), _layer()
    x0 = torch.randn(128, H, device="cuda", requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x0,), fp8_enabled=True, fp8_recipe=recipe)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.01)
    for step in range(10):
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(128, H, device="cuda", generator=g) * (1 + step)
        with te.autocast(recipe=recipe):
            y_e = eager(x.clone().requires_grad_())
        loss_e = y_e.float().square().mean()
        loss_e.backward()
        y_g = graphed(x.clone().requires_grad_())  # replays; FP8 state updated after backward
        loss_g = y_g.float().square().mean()
        loss_g.backward()
        # The same kernels replayed: equal up to cuBLAS choosing another algorithm under capture.
        torch.testing.assert_close(loss_g, loss_e, rtol=1e-6, atol=0)
        for qe, qg in zip(find_quantizers([eager]), find_quantizers([graphed])):
            torch.testing.assert_close(qg.scale, qe.scale, rtol=1e-5, atol=0, msg=f"step {step}: {qe.role} scale")
            if hasattr(qe, "amax_history"):
                torch.testing.assert_close(qg.amax_history, qe.amax_history, rtol=1e-5, atol=0,
                                           msg=f"step {step}: {qe.role} history")
        for opt in (opt_e, opt_g):
            opt.step()
            opt.zero_grad(set_to_none=False)
