"""GPT under tensor parallelism (gloo, CPU): TP=2 and TP=4 against TP=1 on the same seed.

One process start per world size runs every case; each case returns what the parent
checks, and a failing case is reported on its own (with the rank's traceback). The TP=1
reference runs inside the same ranks (``tp_group=None``) on identical data.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

SMALL = dict(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=2, num_heads=4)
# Llama-style: RMSNorm, SwiGLU, RoPE, GQA, untied output, no biases.
LLAMA = dict(SMALL, activation="swiglu", normalization="RMSNorm", position_embedding="rope",
             num_query_groups=2, tie_embeddings=False, bias=False)
CONFIGS = {"gpt": SMALL, "llama": LLAMA}
SEQ, BATCH = 16, 2
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


def _data(step: int = 0, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=gen), torch.randint(0, vocab, (BATCH, SEQ), generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for two zero tensors)."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def _run_model(model, tp_group, tokens, labels) -> dict[str, Any]:
    from tp_fuse.layers import full_grads, grad_norm
    from tp_fuse.layers.tp_regions import all_gather_last_dim

    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    loss.backward()
    logits = model(tokens).detach()
    if tp_group is not None:
        logits = all_gather_last_dim(logits, tp_group)
    return {"loss": loss.detach(), "logits": logits, "grads": full_grads(model, tp_group),
            "grad_norm": grad_norm(model, tp_group)}


def _compare(tp: dict, ref: dict) -> dict[str, float]:
    assert tp["grads"].keys() == ref["grads"].keys(), sorted(set(tp["grads"]) ^ set(ref["grads"]))
    missing = [k for k, g in ref["grads"].items() if g is None or tp["grads"][k] is None]
    assert not missing, f"parameters without gradient: {missing}"
    return {
        "loss": _rel(tp["loss"], ref["loss"]),
        "logits": _rel(tp["logits"], ref["logits"]),
        "grads": max(_rel(tp["grads"][k], g) for k, g in ref["grads"].items()),
        "grad_norm": _rel(tp["grad_norm"], ref["grad_norm"]),
    }


def _perturbed(model, tp_group, seed: int = 9):
    """Add seeded noise to every parameter (same full tensors at any TP size), so that
    biases and norm weights are not at their trivial init (zeros/ones hide bugs)."""
    from tp_fuse.layers import full_state_dict, load_full_state_dict

    gen = torch.Generator().manual_seed(seed)
    full = full_state_dict(model, tp_group)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(full.items())}
    load_full_state_dict(model, noisy, tp_group)
    return model


def _tp_vs_tp1(world_size: int, names: tuple[str, ...]) -> dict[str, Any]:
    from tp_fuse.layers import GPT, GPTConfig

    group = dist.new_group(list(range(world_size)))
    tokens, labels = _data()
    out = {}
    for name in names:
        cfg = GPTConfig(**CONFIGS[name])
        ref = _run_model(_perturbed(GPT(cfg, seed=3), None), None, tokens, labels)
        for sp in (False, True):
            model = _perturbed(GPT(cfg, tp_group=group, sequence_parallel=sp, seed=3), group)
            got = _run_model(model, group, tokens, labels)
            out[f"{name}/sp={sp}"] = _compare(got, ref)
            out[f"{name}/sp={sp}/loss_value"] = got["loss"].item()
    return out


@case
def tp_matches_tp1(rank: int, world_size: int) -> dict[str, Any]:
    return _tp_vs_tp1(world_size, ("gpt", "llama"))


@case
def overlap_off_matches_overlap_on(rank: int, world_size: int) -> dict[str, float]:
    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    group = dist.new_group(list(range(world_size)))
    tokens, labels = _data(1)
    cfg = GPTConfig(**SMALL)
    out = {}
    for sp in (False, True):
        on = _run_model(GPT(cfg, tp_group=group, sequence_parallel=sp, seed=2, overlap=TPOverlap()), group, tokens, labels)
        off_overlap = TPOverlap(OverlapConfig(enabled=False))
        off = _run_model(GPT(cfg, tp_group=group, sequence_parallel=sp, seed=2, overlap=off_overlap), group, tokens, labels)
        out[f"sp={sp}"] = _compare(on, off)
    return out


@case
def overlap_fusions_happen(rank: int, world_size: int) -> dict[str, list[str]]:
    """The TP blocks are built so the overlap fusions take their comm ops (SP and not)."""
    from tp_fuse.layers import GPT, GPTConfig

    group = dist.new_group(list(range(world_size)))
    tokens, _ = _data()
    out = {}
    for sp in (False, True):
        model = GPT(GPTConfig(**SMALL), tp_group=group, sequence_parallel=sp)
        model(tokens)
        layer = model.layers[0]
        for label, seq in (("qkv", layer.attention.qkv.ops), ("proj", layer.attention.proj),
                           ("fc1", layer.mlp.fc1), ("fc2", layer.mlp.fc2), ("output", model.output)):
            fwd, bwd = [], []
            for fuser in seq.fusers():
                fwd += [type(op).__name__ for op, _ in fuser.forward_ops]
                bwd += [type(op).__name__ for op, _ in fuser.backward_ops]
            out[f"sp={sp}/{label}"] = [fwd, bwd]
    return out


@case
def hidden_dropout_without_sp_matches_tp1(rank: int, world_size: int) -> dict[str, float]:
    """Replicated activations draw replicated masks: TP=2 reproduces TP=1's dropout exactly."""
    from tp_fuse.layers import GPT, GPTConfig

    group = dist.new_group(list(range(world_size)))
    tokens, labels = _data(2)
    cfg = GPTConfig(**{**SMALL, "hidden_dropout": 0.3})
    ref, tp = GPT(cfg, seed=4), GPT(cfg, tp_group=group, seed=4)
    out = {}
    for step in range(2):  # the streams advance identically
        out[f"step{step}"] = _rel(tp(tokens, labels).detach(), ref(tokens, labels).detach())
    return out


def _delayed_quantizers(linear) -> list:
    from tp_fuse.quantization import DelayedScalingQuantizer

    return [q for q in linear._quantizers.quantizers.values() if isinstance(q, DelayedScalingQuantizer)]


def _quantizer_state(model) -> torch.Tensor:
    """Scale and amax history of every delayed-scaling quantizer, flattened in module order."""
    from tp_fuse.ops import BasicLinear

    parts = []
    for module in model.modules():
        if isinstance(module, BasicLinear):
            for q in _delayed_quantizers(module):
                parts += [q.scale.reshape(1), q.amax_history]
    return torch.cat(parts) if parts else torch.zeros(0)


@case
def fp8_tp_matches_tp1_and_reduces_once(rank: int, world_size: int) -> dict[str, Any]:
    import tp_fuse
    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.recipe import DelayedScaling

    group = dist.new_group(list(range(world_size)))
    world = dist.group.WORLD
    cfg = GPTConfig(**SMALL)
    n_linear = 4 * cfg.num_layers
    out: dict[str, Any] = {}
    for sp in (False, True):
        recipe = DelayedScaling(amax_history_len=4)
        ref, tp = GPT(cfg, seed=6), GPT(cfg, tp_group=group, sequence_parallel=sp, seed=6)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.3)
        opt_tp = torch.optim.SGD(tp.parameters(), lr=0.3)
        rel, max_calls = [], []
        for step in range(3):
            tokens, labels = _data(10 + step)
            with tp_fuse.autocast(recipe=recipe, amax_reduction_group=world):
                loss_ref = ref(tokens, labels)
            loss_ref.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            calls: list[tuple[int, Any]] = []
            original = dist.all_reduce

            def counting(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
                calls.append((tensor.numel(), kwargs.get("op", args[0] if args else None)))
                return original(tensor, *args, **kwargs)

            dist.all_reduce = counting
            try:
                with tp_fuse.autocast(recipe=recipe, amax_reduction_group=world):
                    loss_tp = tp(tokens, labels)
                loss_tp.backward()
            finally:
                dist.all_reduce = original
            opt_tp.step()
            opt_tp.zero_grad()
            rel.append(abs(loss_tp.item() - loss_ref.item()) / abs(loss_ref.item()))
            max_calls.append(sorted(n for n, op in calls if op == dist.ReduceOp.MAX))
        out[f"sp={sp}/rel"] = rel
        out[f"sp={sp}/max_calls"] = max_calls
        out[f"sp={sp}/expected_max_calls"] = sorted([2 * n_linear, n_linear, SEQ * BATCH])
        out[f"sp={sp}/fp8_state"] = _quantizer_state(tp)
        out[f"sp={sp}/n_quantizers"] = sum(len(_delayed_quantizers(m)) for m in tp.modules()
                                           if type(m).__name__ == "BasicLinear")
    return out


@case
def tp_size_errors_name_the_field(rank: int, world_size: int) -> dict[str, str]:
    from tp_fuse.layers import GPT, ColumnParallelLinear, GPTConfig, LayerNormMLP, MultiheadAttention

    group = dist.new_group(list(range(world_size)))
    singles = [dist.new_group([r]) for r in range(world_size)]  # collective: all ranks create all

    def fp8_with_dp_only_amax_group() -> None:
        import tp_fuse

        model = GPT(GPTConfig(**SMALL), tp_group=group, sequence_parallel=True)
        with tp_fuse.autocast(amax_reduction_group=singles[rank]):
            model(torch.zeros(2, 16, dtype=torch.long))

    attempts = {
        "num_heads": lambda: GPT(GPTConfig(**{**SMALL, "num_heads": 1, "hidden_size": 32}), tp_group=group),
        "vocab_size": lambda: GPT(GPTConfig(**{**SMALL, "vocab_size": 63}), tp_group=group),
        "ffn_hidden_size": lambda: GPT(GPTConfig(**{**SMALL, "ffn_hidden_size": 33}), tp_group=group),
        "num_query_groups": lambda: MultiheadAttention(32, 4, num_query_groups=1, tp_group=group),
        "mlp_ffn": lambda: LayerNormMLP(32, 33, tp_group=group),
        "column_out": lambda: ColumnParallelLinear(8, 7, tp_group=group),
        "sp_seq": lambda: GPT(GPTConfig(**SMALL), tp_group=group, sequence_parallel=True)(
            torch.zeros(2, 15, dtype=torch.long)),
        "fp8_group": fp8_with_dp_only_amax_group,
    }
    messages = {}
    for key, attempt in attempts.items():
        try:
            attempt()
            messages[key] = "no error"
        except ValueError as e:
            messages[key] = str(e)
    return messages


def _run_all_cases(rank: int, world_size: int, names: tuple[str, ...]) -> dict[str, tuple[str, Any]]:
    torch.manual_seed(0)
    results: dict[str, tuple[str, Any]] = {}
    for name in names:
        try:
            results[name] = ("ok", _CASES[name](rank, world_size))
        except Exception:  # noqa: BLE001 - reported to the parent per case
            results[name] = ("fail", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def tp2() -> list[dict[str, tuple[str, Any]]]:
    names = tuple(n for n in _CASES if n != "tp4_matches_tp1")
    return run_distributed(2, _run_all_cases, names, timeout=240)


def _values(results: list[dict], name: str) -> list[Any]:
    values = []
    for rank, res in enumerate(results):
        status, value = res[name]
        if status != "ok":
            pytest.fail(f"case {name} failed on rank {rank}:\n{value}", pytrace=False)
        values.append(value)
    return values


def _assert_matches(metrics: dict[str, Any], tol: float = 1e-5) -> None:
    for key, value in metrics.items():
        if isinstance(value, dict):
            for what, rel in value.items():
                assert rel <= tol, f"{key}: {what} differs from TP=1 by {rel:.3g} (relative)"


def test_tp2_matches_tp1_loss_logits_grads(tp2) -> None:
    r0, r1 = _values(tp2, "tp_matches_tp1")
    _assert_matches(r0)
    # Same loss on both TP ranks, and sequence parallelism does not change it.
    for name in CONFIGS:
        assert r0[f"{name}/sp=False/loss_value"] == r1[f"{name}/sp=False/loss_value"]
        assert r0[f"{name}/sp=True/loss_value"] == pytest.approx(r0[f"{name}/sp=False/loss_value"], rel=1e-6)


def test_sequence_parallel_and_overlap_do_not_change_results(tp2) -> None:
    r0, _ = _values(tp2, "overlap_off_matches_overlap_on")
    _assert_matches(r0)


def test_overlap_fusions_take_the_tp_comm_ops(tp2) -> None:
    r0, _ = _values(tp2, "overlap_fusions_happen")
    for key, (fwd, bwd) in r0.items():
        names = " ".join(fwd + bwd)
        column_without_sp = key.startswith("sp=False/") and key.split("/")[1] in ("qkv", "fc1", "output")
        if column_without_sp:
            # Nothing to overlap in forward: the input is replicated (identity); the
            # backward all-reduce of dx is the CopyToTensorParallelRegion op.
            assert "CopyToTensorParallelRegion" in fwd and "Userbuffers" not in names, (key, fwd, bwd)
            continue
        assert "Userbuffers" in names, f"{key}: no overlap fusion (forward {fwd}, backward {bwd})"
        leftover = {"AllGather", "ReduceScatter", "AllReduce"} & set(fwd)
        assert not leftover, f"{key}: comm op left unfused in forward: {fwd}"


def test_hidden_dropout_masks_are_replicated_without_sp(tp2) -> None:
    r0, _ = _values(tp2, "hidden_dropout_without_sp_matches_tp1")
    for step, rel in r0.items():
        assert rel <= 1e-5, f"{step}: {rel}"


def test_fp8_tp2_matches_tp1_one_amax_reduction_per_direction(tp2) -> None:
    r0, r1 = _values(tp2, "fp8_tp_matches_tp1_and_reduces_once")
    for sp in (False, True):
        assert max(r0[f"sp={sp}/rel"]) <= 1e-3, r0[f"sp={sp}/rel"]
        # Per step: one forward amax all-reduce (input+weight slots), one backward
        # (grad_output slots), and the cross-entropy's logits max -- nothing else.
        for calls in r0[f"sp={sp}/max_calls"]:
            assert calls == r0[f"sp={sp}/expected_max_calls"], calls
        assert r0[f"sp={sp}/n_quantizers"] == 3 * 4 * SMALL["num_layers"]
        # Every rank ends the step with identical scales and histories in every layer.
        assert r0[f"sp={sp}/fp8_state"].numel() > 0
        assert torch.equal(r0[f"sp={sp}/fp8_state"], r1[f"sp={sp}/fp8_state"])


def test_tp_size_errors_name_the_field(tp2) -> None:
    r0, _ = _values(tp2, "tp_size_errors_name_the_field")
    expect = {
        "num_heads": "model.num_heads",
        "vocab_size": "model.vocab_size",
        "ffn_hidden_size": "model.ffn_hidden_size",
        "num_query_groups": "num_query_groups",
        "mlp_ffn": "ffn_hidden_size",
        "column_out": "output features",
        "sp_seq": "sequence length (15) must be divisible by the tensor-parallel size (2)",
        "fp8_group": "must include the tensor-parallel group",
    }
    for key, needle in expect.items():
        assert needle in r0[key], f"{key}: {r0[key]!r} does not mention {needle!r}"


@case
def tp4_matches_tp1(rank: int, world_size: int) -> dict[str, Any]:
    return _tp_vs_tp1(world_size, ("gpt",))


@pytest.mark.slow
def test_tp4_matches_tp1() -> None:
    results = run_distributed(4, _run_all_cases, ("tp4_matches_tp1",), timeout=240)
    values = _values(results, "tp4_matches_tp1")
    _assert_matches(values[0])
    assert len({v["gpt/sp=True/loss_value"] for v in values}) == 1
