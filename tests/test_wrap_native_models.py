"""``wrap()`` on models that are not Hugging Face's (issue 39): nanoGPT and torchtitan's Llama.

Gloo, CPU, 2 ranks, one start; hidden 48, 6 heads (torchtitan: 2 KV heads), vocabulary 97,
TP=2, float64, every parameter perturbed. Both take token ids (nanoGPT's ``idx``,
torchtitan's ``tokens``), so ``wrap`` builds its automatic probe for them and verifies
by default:

* nanoGPT (``tests/native_models.py``: a copy of karpathy's ``model.py``, its
  flash-attention path):

  - ``"column"`` on the fused ``c_attn`` is refused at ``wrap()`` time naming
    ``FusedColumn(3)``, with ``verify=False`` too (the trace runs on the probe anyway);
  - the plan a user writes (``c_attn`` ``FusedColumn(3)``, ``c_proj`` row, ``mlp.c_fc``
    column, ``mlp.c_proj`` row) is refused at ``wrap()`` time with one message: nanoGPT's
    attention takes its head size from its input's width (``C // self.n_head`` with
    ``C = x.size(-1)``), which stays whole on every rank, so no attribute wrap can set
    makes it run on half of the heads. The refusal names the attention, its plan entries
    and the exclude; with that exclude (the MLP sharded, the attention replicated) the
    model matches the unwrapped one;
  - the same plan on a nanoGPT whose attention reads its widths from its attributes
    (``self.n_embd // self.n_head``) matches the unwrapped model: wrap halves ``n_head``
    and ``n_embd`` (the fused parts' size, where ``c_attn``'s output is split);

* torchtitan's Llama (a copy, ``tests/native_models.py``) with a naive sequence-parallel plan (its norms ``"sequence_parallel"``,
  ``sequence_parallel=True``, nothing scattering the sequence or slicing ``freqs_cis``) is
  refused at ``wrap()`` time naming those plan entries and ``sequence_parallel=False``;
  that plan with ``sequence_parallel=False`` matches the unwrapped model.

Outside the ranks: which models get an automatic probe, and its length.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import case_values, run_cases, run_distributed
from native_models import (GPT, NANO_PLAN, POSITIONS, TITAN_SP, V, AttributeWidthAttention, CausalSelfAttention,
                           GPTConfig, ModelArgs, Transformer)
from tp_fuse.layers.wrap.probe import auto_probe, token_input
from tp_fuse.layers.wrap.verify import TOLERANCE

F64 = torch.float64
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


# ---- the ranks -----------------------------------------------------------------------------


def _perturbed(model: nn.Module) -> nn.Module:
    """``model`` in float64 with every parameter moved off its init (norm weights 1, biases
    0 would hide a misplaced shard); the same on every rank."""
    g = torch.Generator().manual_seed(7)
    model = model.to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=F64))
    return model


def _nanogpt(attention: type = CausalSelfAttention) -> nn.Module:
    torch.manual_seed(0)
    return _perturbed(GPT(GPTConfig(attention=attention)))


def _titan() -> nn.Module:
    torch.manual_seed(0)
    return _perturbed(Transformer(ModelArgs()))


def _plan(plan: dict[str, str]) -> dict[str, Any]:
    from tp_fuse.layers import FusedColumn

    return {k: FusedColumn(3) if v == "FusedColumn(3)" else v for k, v in plan.items()}


def _wrap(model: nn.Module, **kw: Any) -> str:
    """``"verified: ..."`` or the error's text."""
    from tp_fuse.layers import wrap

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = wrap(model, dist.new_group([0, 1]), verbose=False, **kw)
    except Exception as e:  # noqa: BLE001 - the tests read what kind of error it was
        return f"{type(e).__name__}: {e}"
    return f"verified: {wrapped.tp_fuse_wrap_report.verified}"


def _against_unwrapped(make: Callable[[], nn.Module], **kw: Any) -> dict[str, Any]:
    """Wrap ``make()`` (verified by default), then one forward and backward on a batch that
    is not the probe against the unwrapped model: the largest relative difference of the
    logits and of every gradient (sharded ones gathered)."""
    from tp_fuse.layers import wrap
    from tp_fuse.layers.sharding import gather_tensor

    group = dist.new_group([0, 1])
    ref = make()
    model = wrap(copy.deepcopy(ref), group, verbose=False, **kw)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (ref, model):
        out = m(ids)
        logits = out[0] if isinstance(out, tuple) else out
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
        (logits * w).sum().backward()
        outs.append(logits.detach())
    params = dict(model.named_parameters())
    grads = {}
    for name, p in ref.named_parameters():
        got = gather_tensor(params[name].grad, getattr(params[name], "tp_shard", None), group)
        grads[name] = ((got - p.grad).abs().max() / p.grad.abs().max()).item()
    report = model.tp_fuse_wrap_report
    return {"verified": report.verified, "localized": report.localized,
            "converted": [n for n, _ in report.converted],
            "logits": ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item(), "grads": grads}


@case
def nanogpt(rank: int, world: int) -> Any:
    column = {**NANO_PLAN, "transformer.h.*.attn.c_attn": "column"}
    return {
        "column": _wrap(_nanogpt(), plan=column),
        "column_unverified": _wrap(_nanogpt(), plan=column, verify=False),
        "fused": _wrap(_nanogpt(), plan=_plan(NANO_PLAN)),
        # What the refusal of "fused" says to do.
        "excluded": _against_unwrapped(_nanogpt, plan=_plan(NANO_PLAN), exclude=["transformer.h.*.attn"]),
        "attribute_widths": _against_unwrapped(lambda: _nanogpt(AttributeWidthAttention), plan=_plan(NANO_PLAN)),
    }


@case
def torchtitan(rank: int, world: int) -> Any:
    return {
        "sp": _wrap(_titan(), plan=TITAN_SP, sequence_parallel=True),
        # What the refusal says to write.
        "no_sp": _against_unwrapped(_titan, plan=TITAN_SP, sequence_parallel=False),
    }


def _run_all_cases(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    return run_cases(_CASES, rank, world)


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(2, _run_all_cases, timeout=300)


def _one_refusal(text: str) -> None:
    """Refused before anything changed, in one message."""
    assert text.startswith("ValueError: wrap: cannot convert the model:"), text
    assert text.count("\n  - ") == 1, text


def _matches(v: dict[str, Any]) -> None:
    tol = TOLERANCE[F64]
    assert v["verified"].startswith("outputs and every gradient match the original on the probe"), v["verified"]
    assert v["logits"] < tol, v["logits"]
    worst = max(v["grads"], key=v["grads"].get)
    assert v["grads"][worst] < tol, (worst, v["grads"][worst])


@pytest.mark.multirank
def test_nanogpt_fused_c_attn_as_column_refused_naming_the_fused_column(results) -> None:
    v = case_values(results, "nanogpt")[0]
    for key in ("column", "column_unverified"):
        _one_refusal(v[key])
        assert ("transformer.h.*.attn.c_attn: plan['transformer.h.*.attn.c_attn'] = 'column', but the model's forward "
                "(split in transformer.h.*.attn) has its output cut into parts of [48, 48, 48] features") in v[key], v
        assert "Write plan['transformer.h.*.attn.c_attn'] = FusedColumn(3)" in v[key], v[key]


@pytest.mark.multirank
def test_nanogpt_attention_refused_at_wrap_time_and_its_exclude_is_correct(results) -> None:
    v = case_values(results, "nanogpt")[0]
    lines = v["fused"].split("\n  - ")
    assert lines[0].startswith("ValueError: wrap(verify=...): the wrapped model does not match"), v["fused"]
    assert lines[1].startswith("TP ranks 0, 1: the wrapped model raised in transformer.h.0.attn (RuntimeError: "
                               "shape '[2, 8, 3, 16]' is invalid"), v["fused"]
    assert "a width read from the module's input, which stays whole: nanoGPT's C = x.size(-1)" in lines[1], lines[1]
    assert ("Plan entries sharding transformer.h.0.attn: transformer.h.0.attn.c_attn: "
            "plan['transformer.h.*.attn.c_attn'] = FusedColumn(3)") in lines[1], lines[1]
    assert "Exclude 'transformer.h.*.attn' (it stays replicated)" in lines[1], lines[1]
    excluded = v["excluded"]
    _matches(excluded)
    assert excluded["converted"] == ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                                     "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj"], excluded["converted"]


@pytest.mark.multirank
def test_nanogpt_attention_with_attribute_widths_matches_the_unwrapped_model(results) -> None:
    v = case_values(results, "nanogpt")[0]["attribute_widths"]
    _matches(v)
    assert ("transformer.h.0.attn", "n_head 6 -> 3, n_embd 48 -> 24") in v["localized"], v["localized"]
    assert "transformer.h.1.attn.c_attn" in v["converted"], v["converted"]


@pytest.mark.multirank
def test_naive_sequence_parallel_plan_on_torchtitan_refused_naming_the_entries(results) -> None:
    v = case_values(results, "torchtitan")[0]
    _one_refusal(v["sp"])
    assert ("plan['layers.*.attention_norm'] = 'sequence_parallel', plan['layers.*.ffn_norm'] = 'sequence_parallel', "
            "plan['norm'] = 'sequence_parallel' with wrap(sequence_parallel=True)") in v["sp"], v["sp"]
    assert "Transformer embeds token ids itself (tok_embeddings)" in v["sp"], v["sp"]
    assert "Write wrap(..., sequence_parallel=False)" in v["sp"], v["sp"]
    _matches(v["no_sp"])
    assert len(v["no_sp"]["converted"]) == 19, v["no_sp"]["converted"]  # 14 projections, 5 norms kept


def test_automatic_probe_for_models_that_take_token_ids() -> None:
    nano = token_input(GPT(GPTConfig()))
    assert (nano.vocab, nano.positions, nano.keyword, nano.embedding) == (V, POSITIONS, False, "transformer.wte")
    titan = token_input(Transformer(ModelArgs(max_seq_len=6)))
    assert (titan.vocab, titan.positions, titan.embedding) == (V, 6, "tok_embeddings"), titan
    # The probe is as long as the model allows, and no head count (6 heads, 2 KV heads).
    ids = auto_probe(Transformer(ModelArgs(max_seq_len=6)))(_Record())
    assert ids.shape == (2, 5) and int(ids.max()) < V, ids


class _Record(nn.Module):
    """Returns the probe's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class _Positional(nn.Module):
    """megatron-core GPTModel's signature: more required arguments than the token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, 8)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids + position_ids)


class _Activations(nn.Module):
    """A model on activations (``x``): no token ids to draw."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("model", [_Positional, _Activations, lambda: nn.Linear(2, 2)])
def test_no_automatic_probe_without_token_ids(model: Callable[[], nn.Module]) -> None:
    assert token_input(model()) is None and auto_probe(model()) is None
