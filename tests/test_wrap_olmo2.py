"""OLMo2 under ``wrap()`` (issue 22): gloo, CPU, 2 ranks, one process start.

OLMo2's ``q_norm`` / ``k_norm`` are one RMSNorm over the WHOLE q (k) projection
(``[heads * head_dim]``), applied before the heads are split: its mean of squares spans
every head. Under TP each rank holds half the heads, so the norm must be sharded with
them and its statistic summed over TP (plan style ``"sharded_norm"``); a replicated norm
fails on the shapes, and one normalising each rank's slice alone is silently wrong.

* the built-in olmo2 plan (plan=None) trains like the unwrapped model in float32
  (logits, loss, every gradient gathered, AdamW steps; GQA with 2 KV heads), and
  ``verify=True`` passes; the sharded norms are in the report, not synced;
* ``original_state_dict`` loads strictly into the unwrapped model;
* refused with one message: a plan that shards OLMo2's attention but leaves the
  full-width norms replicated (the llama plan), ``sharded_norm`` on a norm whose input is
  not sharded, and on a norm class whose formula it does not reproduce.
* the general rule behind the first (any model, found by the trace): a LayerNorm/RMSNorm-
  like module over the full width of a projection the plan shards, entered with its
  sharded output but left replicated, is refused naming the module and the fix -- on a
  plain model at its first forward (every forward after too) or in ``wrap`` with a probe,
  on an OLMo2-like model of no known family (the llama plan) in ``wrap``; a weightless
  norm that would compute wrong numbers silently is refused alike; the same plain model
  with the norm as ``sharded_norm`` matches the unwrapped one.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import case_values, run_cases, run_distributed, value_error
from test_wrap_correctness import V, _check_trained, _train_against_unwrapped

pytestmark = pytest.mark.multirank

HAVE_OLMO2 = (importlib.util.find_spec("transformers") is not None
              and importlib.util.find_spec("transformers.models.olmo2") is not None)


def _olmo2(**over: Any) -> nn.Module:
    import transformers as tf

    kw = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=8, **over)
    torch.manual_seed(3)
    model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**kw))
    with torch.no_grad():  # every parameter perturbed: one-initialized norms hide layout bugs
        for n, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


def builtin(rank: int, world: int) -> Any:
    from tp_fuse.layers import wrap
    from tp_fuse.layers.wrap.export import original_state_dict

    group = dist.new_group([0, 1])
    ref = _olmo2()
    model = wrap(copy.deepcopy(ref), group, verbose=False)
    out = _train_against_unwrapped(ref, model, group, steps=3)
    out["family"] = model.tp_fuse_wrap_report.family
    out["q_norm_local"] = tuple(model.model.layers[0].self_attn.q_norm.weight.shape)
    out["k_norm_local"] = tuple(model.model.layers[0].self_attn.k_norm.weight.shape)
    # Exported in the original layout: loads strictly into a fresh unwrapped model.
    fresh = _olmo2()
    fresh.load_state_dict(original_state_dict(model, group), strict=True)
    out["export_q_norm_equal"] = torch.equal(
        fresh.model.layers[1].self_attn.q_norm.weight,
        torch.cat([t for t in _gather(model.model.layers[1].self_attn.q_norm.weight, group)]))
    out["verified"] = wrap(_olmo2(), group, verify=True, verbose=False).tp_fuse_wrap_report.verified
    return out


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def refusals(rank: int, world: int) -> Any:
    from tp_fuse.layers import wrap
    from tp_fuse.layers.wrap.hf_plans import FAMILIES

    group = dist.new_group([0, 1])
    llama_plan = FAMILIES["llama"].plan_for(_olmo2().config)
    olmo2_plan = FAMILIES["olmo2"].plan_for(_olmo2().config)
    not_sharded = {**olmo2_plan, "model.layers.*.post_attention_layernorm": "sharded_norm"}

    class LayerNormAfterColumn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.norm(self.up(x)))

    torch.manual_seed(0)
    return {
        "llama_plan": value_error(lambda: wrap(_olmo2(), group, plan=llama_plan, verbose=False)),
        "not_sharded_input": value_error(lambda: wrap(_olmo2(), group, plan=not_sharded, verbose=False)),
        "layernorm": value_error(lambda: wrap(LayerNormAfterColumn(), group, plan={"up": "column", "norm": "sharded_norm",
                                                                               "down": "row"}, verbose=False)),
    }


class NormAfterColumn(nn.Module):
    """``down(norm(up(x)))``: the norm sees all 16 features of the column-parallel ``up``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), norm, nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


class WeightlessRMSNorm(nn.Module):
    """An RMSNorm written out by hand, no weight: replicated on each rank's 8 features it
    would run without any shape error and give wrong numbers (statistics of the slice)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.normalized_shape = (width,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def replicated_norms(rank: int, world: int) -> Any:
    from tp_fuse.layers import wrap
    from tp_fuse.layers.wrap.hf_plans import FAMILIES

    group = dist.new_group([0, 1])
    plan = {"up": "column", "down": "row"}
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(7))

    def plain(norm: nn.Module) -> nn.Module:
        torch.manual_seed(0)
        return NormAfterColumn(norm)

    def first_forward(norm: nn.Module) -> list[str]:
        model = wrap(plain(norm), group, plan=plan, verbose=False)  # no probe: traced at the first forward
        return [value_error(lambda: model(x)) for _ in range(2)]

    out: dict[str, Any] = {
        "rmsnorm_first_forward": first_forward(nn.RMSNorm(16)),
        "weightless_first_forward": first_forward(WeightlessRMSNorm(16)),
        "layernorm_first_forward": first_forward(nn.LayerNorm(16)),
        "rmsnorm_probe": value_error(lambda: wrap(plain(nn.RMSNorm(16)), group, plan=plan, verify=x, verbose=False)),
    }
    # An OLMo2-like model of no built-in family (so no family check): only the trace sees it.
    olmo_like = _olmo2()
    olmo_like.config.model_type = "my_olmo2_fork"
    out["olmo2_like_llama_plan"] = value_error(lambda: wrap(olmo_like, group, plan=FAMILIES["llama"].plan_for(
        olmo_like.config), verbose=False))
    # Accepted: the norm sharded with the features.
    ref = plain(nn.RMSNorm(16))
    with torch.no_grad():
        ref.norm.weight.add_(0.1 * torch.randn(16, generator=torch.Generator().manual_seed(2)))
    model = wrap(copy.deepcopy(ref), group, plan={**plan, "norm": "sharded_norm"}, verbose=False)
    out["sharded_ok_rel"] = float((model(x) - ref(x)).abs().max() / ref(x).abs().max())
    model = wrap(copy.deepcopy(ref), group, plan={**plan, "norm": "sharded_norm"}, verify=x, verbose=False)
    out["sharded_verified"] = model.tp_fuse_wrap_report.verified
    return out


_CASES = {"builtin": builtin, "refusals": refusals, "replicated_norms": replicated_norms}


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    if not HAVE_OLMO2:
        pytest.skip("transformers with OLMo2 is not installed")
    return run_distributed(2, _run_all_cases, timeout=600)


def _run_all_cases(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    return run_cases(_CASES, rank, world)


def test_olmo2_builtin_plan_trains_like_unwrapped(results) -> None:
    v = _check_trained(case_values(results, "builtin"))
    assert v["family"] == "olmo2"
    # Sharded with the heads (q: 4 heads * 8 = 32 -> 16 per rank; k: 2 KV heads * 8 = 16 -> 8).
    assert v["q_norm_local"] == (16,) and v["k_norm_local"] == (8,), (v["q_norm_local"], v["k_norm_local"])
    assert "sharded norm (weight split with the features, statistics summed over TP)" in v["report"], v["report"]
    assert not [n for n in v["synced"] if "_norm" in n], v["synced"]  # sharded, not replicated-and-summed
    assert v["export_q_norm_equal"]
    assert v["verified"]


def test_olmo2_refusals_are_one_clear_message(results) -> None:
    v = case_values(results, "refusals")[0]
    msg = v["llama_plan"]
    assert "model.layers.*.self_attn.q_norm" in msg and "'sharded_norm'" in msg, msg
    msg = v["not_sharded_input"]
    assert "post_attention_layernorm: plan style 'sharded_norm'" in msg and "input is not TP-sharded" in msg, msg
    msg = v["layernorm"]
    assert "norm: plan style 'sharded_norm' needs a torch.nn.RMSNorm" in msg and "got LayerNorm" in msg, msg


def test_replicated_full_width_norm_refused_with_the_fix(results) -> None:
    v = case_values(results, "replicated_norms")[0]
    for key in ("rmsnorm_first_forward", "weightless_first_forward", "layernorm_first_forward"):
        first, again = v[key]
        assert first.startswith("wrap: the first forward of the wrapped model shows it cannot be correct:"), first
        assert first.count("\n  - ") == 1, first  # one problem, one line
        assert "norm: this " in first and "normalises over 16 features, the full output width of up" in first, first
        assert "each rank would normalise only its own 8 features" in first, first
        assert again == first, (key, again)  # still refused, never silently run
    assert "Add 'norm' to the plan as 'sharded_norm'" in v["rmsnorm_first_forward"][0]
    assert "Add 'norm' to the plan as 'sharded_norm'" in v["weightless_first_forward"][0] or \
        "shards only RMSNorms" in v["weightless_first_forward"][0]
    msg = v["layernorm_first_forward"][0]
    assert "shards only RMSNorms" in msg and "not a LayerNorm" in msg and "leave up unsharded" in msg, msg
    msg = v["rmsnorm_probe"]
    assert msg.startswith("wrap: cannot convert the model:") and "norm: this RMSNorm normalises over 16" in msg, msg
    msg = v["olmo2_like_llama_plan"]
    assert msg.startswith("wrap: cannot convert the model:"), msg
    assert "model.layers.*.self_attn.q_norm: this Olmo2RMSNorm normalises over 32 features" in msg, msg
    assert "model.layers.*.self_attn.k_norm: this Olmo2RMSNorm normalises over 16 features" in msg, msg
    assert "Add 'model.layers.*.self_attn.q_norm' to the plan as 'sharded_norm'" in msg, msg
    assert v["sharded_ok_rel"] < 1e-6, v["sharded_ok_rel"]
    assert v["sharded_verified"]
