"""Megatron-Core's Transformer Engine layer spec on tp_fuse (issue 38), CPU gloo, 2 ranks.

``transformer_engine`` is tp_fuse through the strict alias (:mod:`tp_fuse.te.te_alias`: no
placeholders; ``import megatron.core`` must pass with it), installed in the spawned ranks
only, before megatron is imported. megatron-core's CUDA-only helpers run on CPU through
``megatron_cpu``'s test shims, as in the other megatron tests.

* ``get_gpt_layer_with_transformer_engine_spec()`` GPTModel at TP=1 and at TP=2 with sequence
  parallelism (GPT style and Llama style), against megatron's local spec with the same weights
  (copied by name: the TE spec fuses the norms into ``linear_qkv`` / ``linear_fc1``). With
  megatron's own core attention in the TE spec, logits and loss are bitwise equal in fp32, and
  GPT style's gradients too (Llama style's to ~1 ulp: see the test). With TE's ``DotProductAttention`` (tp_fuse's one attention implementation,
  SDPA) they are equal up to the core attention's summation order (SDPA's blocked softmax vs
  megatron's baddbmm + softmax + bmm), asserted <= 1e-5 relative: not bitwise.
* ``config.fp8="hybrid"`` (delayed scaling through Megatron's ``get_fp8_context`` ->
  ``fp8_autocast``) at TP=2 + SP: a few Adam steps with finite, decreasing loss, scales updated.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import case_values, run_cases, run_distributed

pytestmark = pytest.mark.multirank

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
_CASES: dict[str, Callable[[int, int], Any]] = {}
V, S, B = 64, 8, 2


def _setup(tp: int) -> None:
    from tp_fuse.te import te_alias

    te_alias.install()  # before megatron imports: it probes transformer_engine at import time
    import megatron_cpu

    megatron_cpu.init_model_parallel(tp)


def _gpt(spec: Any, tp: int, sp: bool, llama: bool, **overrides: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                              tensor_model_parallel_size=tp, params_dtype=torch.float32,
                              attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sp)
    if llama:
        kw.update(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                  num_query_groups=2)
    kw.update(overrides)
    torch.manual_seed(7)
    return GPTModel(TransformerConfig(**kw), spec, vocab_size=V, max_sequence_length=S,
                    share_embeddings_and_output_weights=llama,
                    position_embedding_type="rope" if llama else "learned_absolute")


def _te_name(local_name: str) -> str:
    """The TE spec's name of a local-spec parameter (its norms live in the fused linears)."""
    name = local_name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
    return name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    return tokens, torch.arange(S)[None].expand(B, S), torch.randint(0, V, (B, S), generator=gen)


def _spec_equivalence(tp: int, sp: bool, llama: bool, megatron_core_attention: bool) -> dict[str, Any]:
    _setup(tp)
    import megatron_cpu
    import tp_fuse as te
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention as MegatronCoreAttention

    group = dist.new_group(list(range(dist.get_world_size())))
    norm = "RMSNorm" if llama else "LayerNorm"
    spec = get_gpt_layer_with_transformer_engine_spec()
    if megatron_core_attention:
        # Everything TE but the core attention: isolates what is bitwise from what is not.
        spec.submodules.self_attention.submodules.core_attention = MegatronCoreAttention
    te_model = _gpt(spec, tp, sp, llama)
    local = _gpt(megatron_cpu.local_spec(norm, sp, 2), tp, sp, llama)
    te_params = dict(te_model.named_parameters())
    kinds = (te.DotProductAttention, te.LayerNormLinear, te.Linear, te.LayerNorm, te.RMSNorm)
    out: dict[str, Any] = {"te_classes": sorted({k.__name__ for m in te_model.modules() for k in kinds
                                                 if isinstance(m, k)})}
    out["names_map"] = sorted(_te_name(n) for n, _ in local.named_parameters()) == sorted(te_params)
    with torch.no_grad():
        for n, p in local.named_parameters():
            p.copy_(te_params[_te_name(n)])
    tokens, pos, labels = _batch(0)
    logits = [m(tokens, pos, None) for m in (te_model, local)]  # [b, s, V/tp]
    out["logits_equal"] = torch.equal(logits[0], logits[1])
    out["logits_rel"] = ((logits[0] - logits[1]).abs().max() / logits[1].abs().max()).item()
    losses = []
    for m in (te_model, local):
        loss = m(tokens, pos, None, labels=labels).mean()
        loss.backward()
        megatron_cpu.allreduce_sequence_parallel_grads(m, group)
        losses.append(loss.detach())
    out["loss_equal"] = torch.equal(losses[0], losses[1])
    rel = {}
    for n, p in local.named_parameters():
        g_te = te_params[_te_name(n)].grad
        rel[n] = ((g_te.double() - p.grad.double()).abs().max() / p.grad.double().abs().max().clamp_min(1e-30)).item()
    out["grad_rel"] = max(rel.values())
    out["grad_count"] = len(rel)
    out["grad_bitwise"] = sum(v == 0.0 for v in rel.values())
    out["grad_not_bitwise"] = sorted(n for n, v in rel.items() if v != 0.0)
    return out


def _case(name: str, tp: int, sp: bool, llama: bool, megatron_core_attention: bool = False) -> None:
    def run(rank: int, world: int) -> Any:
        if not HAVE_MEGATRON:
            return {"skipped": "megatron.core is not installed"}
        return _spec_equivalence(tp, sp, llama, megatron_core_attention)

    _CASES[name] = run


for _name, _tp, _sp, _llama in (("gpt_tp1", 1, False, False), ("gpt_tp2_sp", 2, True, False),
                                ("llama_tp1", 1, False, True), ("llama_tp2_sp", 2, True, True)):
    _case(_name, _tp, _sp, _llama)
    _case(_name + "_megatron_core_attention", _tp, _sp, _llama, megatron_core_attention=True)


def _fp8_hybrid(rank: int, world: int) -> Any:
    if not HAVE_MEGATRON:
        return {"skipped": "megatron.core is not installed"}
    _setup(2)
    import megatron_cpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    group = dist.new_group(list(range(world)))
    model = _gpt(get_gpt_layer_with_transformer_engine_spec(), 2, True, False, fp8="hybrid")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens, pos, labels = _batch(1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(tokens, pos, None, labels=labels).mean()
        loss.backward()
        megatron_cpu.allreduce_sequence_parallel_grads(model, group)
        opt.step()
        losses.append(loss.item())
    meta = model.decoder.layers[0].self_attention.linear_qkv.fp8_meta
    return {"losses": losses, "recipe": type(meta["recipe"]).__name__,
            "fwd_scales": meta["scaling_fwd"].scale[:2].tolist()}


_CASES["fp8_hybrid_tp2_sp"] = _fp8_hybrid


def _launcher_build(rank: int, world: int) -> Any:
    """What ``+model=megatron_gpt model.spec=te parallel.tp=2`` builds (launch/models/megatron.py)."""
    if not HAVE_MEGATRON:
        return {"skipped": "megatron.core is not installed"}
    _setup(2)
    import tp_fuse as te
    from tp_fuse.launch.models.megatron import build_megatron_gpt
    from tp_fuse.layers import GPTConfig
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    group = dist.new_group(list(range(world)))
    gpt = GPTConfig(vocab_size=V, max_seq_len=S, hidden_size=32, num_layers=2, num_heads=4)
    model = build_megatron_gpt(gpt, tp_group=group, sequence_parallel=False, dtype=torch.float32,
                               device=torch.device("cpu"), seed=3, overlap=TPOverlap(OverlapConfig(enabled=False)),
                               spec="te")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, _, labels = _batch(2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(tokens, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses,
            "te_layers": sum(isinstance(m, (te.LayerNormLinear, te.Linear, te.DotProductAttention))
                             for m in model.modules()),
            "all_tagged": all(hasattr(p, "tp_shard") for p in model.parameters()),
            "sharded": sorted(n for n, p in model.named_parameters() if p.tp_shard is not None)}


_CASES["launcher_build_tp2"] = _launcher_build


def _run_all(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    return run_cases(_CASES, rank, world)


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(2, _run_all, timeout=500)


_SPECS = ["gpt_tp1", "gpt_tp2_sp", "llama_tp1", "llama_tp2_sp"]


@pytest.mark.parametrize("name", _SPECS)
def test_te_spec_matches_local_spec(results, name: str) -> None:
    """The whole TE spec (tp_fuse's DotProductAttention = SDPA) vs the local spec: equal up to
    the core attention's summation order (SDPA's blocked softmax vs megatron's baddbmm + softmax)."""
    for v in case_values(results, name):
        assert {"DotProductAttention", "LayerNormLinear", "Linear"} <= set(v["te_classes"]), v
        assert v["names_map"], "TE spec parameters do not map 1:1 onto the local spec's"
        assert v["logits_rel"] <= 1e-5 and v["grad_rel"] <= 1e-5, v


@pytest.mark.parametrize("name", _SPECS)
def test_te_spec_with_megatron_core_attention_is_bitwise_equal(results, name: str) -> None:
    """TE's linears, fused norms and final norm on tp_fuse, megatron's core attention: logits
    and loss bitwise equal (fp32) to the local spec; GPT style (LayerNorm, GELU) every parameter
    gradient too. Llama style's gradients are not bitwise: tp_fuse's RMSNorm dgrad and SwiGLU
    backward (tp_fuse.kernels) evaluate their formulas in another order than torch autograd
    through ``torch.nn.RMSNorm`` / ``silu(a) * b`` (the local spec): ~1 ulp, asserted <= 1e-6."""
    for v in case_values(results, name + "_megatron_core_attention"):
        assert "DotProductAttention" not in v["te_classes"] and "LayerNormLinear" in v["te_classes"], v
        assert v["logits_equal"] and v["loss_equal"], v
        if name.startswith("gpt"):
            assert v["grad_bitwise"] == v["grad_count"], v
        else:
            assert v["grad_rel"] <= 1e-6, v


def test_launcher_builds_the_te_spec(results) -> None:
    for v in case_values(results, "launcher_build_tp2"):
        assert v["te_layers"] == 2 * 5, v  # per layer: linear_qkv, linear_proj, fc1, fc2, core attention
        assert v["all_tagged"] and "model.decoder.layers.0.self_attention.linear_qkv.weight" in v["sharded"], v
        assert v["losses"][-1] < v["losses"][0], v


def test_te_spec_fp8_hybrid_trains(results) -> None:
    for v in case_values(results, "fp8_hybrid_tp2_sp"):
        losses = v["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert losses[-1] < losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
        assert v["recipe"] == "TEDelayedScaling"  # megatron's subclass of TE's (here tp_fuse's) DelayedScaling
        assert all(s != 1.0 for s in v["fwd_scales"]), v  # delayed scaling updated the scales: FP8 ran
