"""Gradient handling of the training loop on 2 gloo ranks: TP-aware norm, DP averaging, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed

from tp_fuse.comm import ParallelTopology
from tp_fuse.launch.grads import allreduce_dp_grads, clip_grads, global_grad_norm
from tp_fuse.layers import GPT, GPTConfig

CFG = dict(vocab_size=256, max_seq_len=32, hidden_size=64, num_layers=2, num_heads=2)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1], tokens[:, 1:])


def _reference_norm(tokens: torch.Tensor, config: GPTConfig) -> tuple[float, dict[str, torch.Tensor]]:
    model = GPT(config, seed=7)
    _loss(model, tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values())), grads


def _cases(rank: int, world: int) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 4, 17), generator=gen)  # two DP batches
    for tie, act in ((True, "gelu"), (False, "swiglu")):
        config = GPTConfig(**CFG, tie_embeddings=tie, activation=act)
        ref_norm, _ = _reference_norm(tokens[0], config)
        tp = ParallelTopology(tp=2, dp=1)
        for sp in (False, True):
            model = GPT(config, tp_group=tp.tp_group, sequence_parallel=sp, seed=7)
            _loss(model, tokens[0]).backward()
            norm = float(global_grad_norm(model, tp.tp_group, 2))
            out[f"tp2 sp={sp} tie={tie}"] = (norm, ref_norm)
            # Clipping to half the norm leaves exactly half.
            params = list(model.parameters())
            coef = clip_grads(params, torch.tensor(norm, dtype=torch.float64), norm / 2)
            out[f"clip sp={sp} tie={tie}"] = (float(global_grad_norm(model, tp.tp_group, 2)), norm / 2, coef)

    # DP: each rank its own batch; averaged grads equal the grad of the mean loss.
    config = GPTConfig(**CFG)
    dp = ParallelTopology(tp=1, dp=2)
    model = GPT(config, seed=7)
    _loss(model, tokens[rank]).backward()
    allreduce_dp_grads(list(model.parameters()), dp.dp_group, 2)
    ref = GPT(config, seed=7)
    (0.5 * (_loss(ref, tokens[0]) + _loss(ref, tokens[1]))).backward()
    err = max(float((p.grad - r.grad).abs().max()) for p, r in zip(model.parameters(), ref.parameters()))
    out["dp"] = err
    return out


@pytest.mark.multirank
def test_grad_norm_clipping_and_dp_average_on_two_ranks():
    results = run_distributed(2, _cases, timeout=180)
    for res in results:
        for key, value in res.items():
            if key.startswith("tp2"):
                norm, ref = value
                # Sharded parameters summed over TP, replicated ones counted once.
                assert norm == pytest.approx(ref, rel=1e-5), key
            elif key.startswith("clip"):
                after, target, coef = value
                assert coef < 1 and after == pytest.approx(target, rel=1e-5), key
            else:
                assert value < 1e-6, key
    assert results[0] == results[1]  # every rank computes the same norm
