"""FSDP2 x TP (gloo, 4 CPU ranks, one process start for the module).

TP=2 x FSDP=2 trains like TP=2 x DP=2 (replicated data parallelism with the bucketed
all-reduce): same losses within 1e-5 (fp32) for 6 SGD-momentum steps and the same final
parameters, with and without sequence parallelism; HSDP (replicate 2 x shard 2) like
DP=4; FP8 compute (delayed and current scaling) under FSDP2; meta-device init with only
local shards materialized equals the eager model; FP8 weights are refused clearly.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

SMALL = dict(vocab_size=64, max_seq_len=16, hidden_size=32, num_layers=2, num_heads=4)
LLAMA = dict(SMALL, activation="swiglu", normalization="RMSNorm", position_embedding="rope",
             num_query_groups=2, tie_embeddings=False, bias=False)
STEPS, SEQ, MICRO = 6, 16, 2
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Learnable: the label is the next token of a fixed random walk, so the loss falls.
    gen = torch.Generator().manual_seed(7000 + 100 * step + dp_rank)
    tokens = torch.randint(0, 64, (MICRO, SEQ), generator=gen)
    return tokens, (tokens * 5 + 3) % 64


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _full_params(model, tp_group) -> dict[str, torch.Tensor]:
    """Full (TP=1, unsharded) parameters, whatever the layout."""
    from torch.distributed.tensor import DTensor

    from tp_fuse.layers import gather_tensor

    out = {}
    for name, p in model.named_parameters():
        local = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = gather_tensor(local, p.tp_shard, tp_group)
    return out


def _train(model, *, tp_group, dp_group, dp_rank: int, dp_size: int, fsdp: bool, recipe=None,
           fp8_group=None, steps: int = STEPS) -> dict[str, Any]:
    import tp_fuse
    from tp_fuse.launch.grads import allreduce_dp_grads
    from tp_fuse.layers.fsdp import reduce_sequence_parallel_grads, sequence_parallel_params

    # SGD, not Adam: Adam maps gradient components that are ~0 (unused vocab rows, SP
    # partial sums that cancel) to steps of +-lr, so rounding-level differences of the
    # reduction order would show up as O(lr) parameter differences. SGD keeps parameter
    # differences proportional to gradient differences: a meaningful 1e-5 check.
    # lr 0.1: with lr 0.5 and momentum 0.9 the GPT's loss overshoots and is back below its
    # first value only around step 10 (step 6: 4.21 > 4.18); at lr 0.1 it falls by step 6
    # (4.18 -> 4.11) in every case here, so the "loss fell" check holds after 6 steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    sp_params = sequence_parallel_params(model) if fsdp else []
    losses = []
    for step in range(steps):
        tokens, labels = _batch(step, dp_rank)
        with tp_fuse.autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=fp8_group):
            loss = model(tokens, labels)
        loss.backward()
        if fsdp:
            reduce_sequence_parallel_grads(sp_params, tp_group)
        else:
            allreduce_dp_grads([p for p in model.parameters()], dp_group, dp_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp_group)
        losses.append(float(loss) / dp_size)
    return {"losses": losses, "params": _full_params(model, tp_group)}


def _compare(a: dict, b: dict) -> dict[str, Any]:
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    params = max(float((a["params"][k] - v).abs().max() / v.abs().max()) for k, v in b["params"].items())
    return {"loss_max_abs": loss, "param_max_rel": params, "steps": len(a["losses"]),
            "loss_first": a["losses"][0], "loss_last": a["losses"][-1]}


def _tp_x_dp(cfg: dict, sp: bool, recipe_fn=None, meta: bool = False) -> dict[str, float]:
    """TP=2 x FSDP=2 against TP=2 x DP=2 on the same data."""
    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.layers.fsdp import fully_shard_gpt
    from tp_fuse.layers.meta_init import deferred_inits, materialize

    mesh = _mesh((2, 2), ("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank = mesh.get_local_rank("dp")
    fp8_group = dist.group.WORLD if recipe_fn is not None else None

    def build(device="cpu"):
        return GPT(GPTConfig(**cfg), tp_group=tp_group, sequence_parallel=sp, seed=5, device=device)

    ddp = _train(build(), tp_group=tp_group, dp_group=dp_group, dp_rank=dp_rank, dp_size=2, fsdp=False,
                 recipe=recipe_fn() if recipe_fn else None, fp8_group=fp8_group)
    if meta:
        model = build("meta")
        inits = deferred_inits(model)
        fully_shard_gpt(model, mesh["dp"])
        materialize(model, "cpu", inits)
    else:
        model = fully_shard_gpt(build(), mesh["dp"])
    fsdp = _train(model, tp_group=tp_group, dp_group=dp_group, dp_rank=dp_rank, dp_size=2, fsdp=True,
                  recipe=recipe_fn() if recipe_fn else None, fp8_group=fp8_group)
    return _compare(fsdp, ddp)


@case
def tp2_fsdp2_matches_tp2_dp2(rank: int, world_size: int) -> dict[str, Any]:
    return {f"{name}/sp={sp}": _tp_x_dp(cfg, sp) for name, cfg in (("gpt", SMALL), ("llama", LLAMA))
            for sp in (False, True)}


@case
def hsdp_matches_dp4(rank: int, world_size: int) -> dict[str, Any]:
    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.layers.fsdp import fully_shard_gpt

    mesh = _mesh((2, 2), ("dp_replicate", "dp_shard"))
    world = dist.group.WORLD
    ddp = _train(GPT(GPTConfig(**SMALL), seed=5), tp_group=None, dp_group=world, dp_rank=rank, dp_size=4,
                 fsdp=False)
    model = fully_shard_gpt(GPT(GPTConfig(**SMALL), seed=5), mesh)
    hsdp = _train(model, tp_group=None, dp_group=world, dp_rank=rank, dp_size=4, fsdp=True)
    placements = {str(p.placements) for p in model.parameters()}
    return {"hsdp": _compare(hsdp, ddp), "placements": sorted(placements)}


@case
def fp8_compute_under_fsdp(rank: int, world_size: int) -> dict[str, Any]:
    from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

    return {
        "delayed": _tp_x_dp(SMALL, True, lambda: DelayedScaling(amax_history_len=4)),
        "current": _tp_x_dp(SMALL, False, lambda: Float8CurrentScaling()),
    }


@case
def meta_init_fsdp_equals_eager(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.layers.fsdp import fully_shard_gpt
    from tp_fuse.layers.meta_init import deferred_inits, materialize

    mesh = _mesh((2, 2), ("dp", "tp"))
    tp_group = mesh.get_group("tp")
    out: dict[str, Any] = {}
    for name, cfg in (("gpt", SMALL), ("llama", LLAMA)):
        eager = GPT(GPTConfig(**cfg), tp_group=tp_group, seed=21)
        model = GPT(GPTConfig(**cfg), tp_group=tp_group, seed=21, device="meta")
        inits = deferred_inits(model)
        fully_shard_gpt(model, mesh["dp"])
        materialize(model, "cpu", inits)
        local_numel = sum(p.to_local().numel() for p in model.parameters())
        tp_numel = sum(p.numel() for p in eager.parameters())
        diffs = []
        for (n, p), (_, e) in zip(model.named_parameters(), eager.named_parameters()):
            assert isinstance(p, DTensor), n
            diffs.append(float((p.full_tensor() - e.detach()).abs().max()))
        out[name] = {"max_abs": max(diffs), "local_fraction": local_numel / tp_numel}
        # And training continues identically from the meta-built model (1e-5 check).
    out["train"] = _tp_x_dp(SMALL, False, meta=True)
    return out


@case
def fp8_weights_with_fsdp_is_a_clear_error(rank: int, world_size: int) -> str:
    import tp_fuse
    from tp_fuse.layers import GPT, GPTConfig
    from tp_fuse.layers.fsdp import fully_shard_gpt

    mesh = _mesh((4,), ("dp",))
    with tp_fuse.quantized_model_init():
        model = GPT(GPTConfig(**SMALL), seed=1)
    try:
        fully_shard_gpt(model, mesh)
    except ValueError as e:
        return str(e)
    return "no error"


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
def ranks4() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(4, _run_all_cases, tuple(_CASES), timeout=600)


def _values(results: list[dict], name: str) -> list[Any]:
    values = []
    for rank, res in enumerate(results):
        status, value = res[name]
        if status != "ok":
            pytest.fail(f"case {name} failed on rank {rank}:\n{value}", pytrace=False)
        values.append(value)
    return values


def _assert_same_training(metrics: dict[str, Any], what: str, tol: Optional[float] = None) -> None:
    from tolerances import tols

    tol = tols(torch.float32)["atol"] if tol is None else tol
    assert metrics["steps"] == STEPS
    assert metrics["loss_last"] < metrics["loss_first"], f"{what}: loss did not fall: {metrics}"
    assert metrics["loss_max_abs"] <= tol, f"{what}: losses differ by {metrics['loss_max_abs']:.3g}"
    assert metrics["param_max_rel"] <= tol, f"{what}: parameters differ by {metrics['param_max_rel']:.3g} (relative)"


def test_tp2_fsdp2_matches_tp2_dp2(ranks4) -> None:
    for r in _values(ranks4, "tp2_fsdp2_matches_tp2_dp2"):
        for key, metrics in r.items():
            _assert_same_training(metrics, key)


def test_hsdp_matches_replicated_dp(ranks4) -> None:
    r = _values(ranks4, "hsdp_matches_dp4")[0]
    _assert_same_training(r["hsdp"], "hsdp")
    assert r["placements"] == ["(Replicate(), Shard(dim=0))"]


# FP8 under TP x FSDP vs TP x DP: the two reduce gradients in different orders (reduce-
# scatter vs all-reduce; with sequence parallelism also the norms' TP reduction), so the fp32
# weights differ in their last bits, and a weight value on an FP8 rounding boundary may then
# round to the neighbouring E4M3 value (2^-3 relative) in one run and not the other. Measured
# on an AVX512-FP16/AMX Xeon: 9.7e-05 relative after the test's steps with delayed scaling
# and SP (with torch's oneDNN FP8 GEMM as with tp_fuse's emulation), 0 for current scaling
# without SP.
FP8_FSDP_PARAM_TOL = 1e-3


def test_fp8_compute_under_fsdp(ranks4) -> None:
    for r in _values(ranks4, "fp8_compute_under_fsdp"):
        for key, metrics in r.items():
            _assert_same_training(metrics, f"fp8 {key}", tol=FP8_FSDP_PARAM_TOL)


def test_meta_init_materializes_local_shards_equal_to_eager(ranks4) -> None:
    for r in _values(ranks4, "meta_init_fsdp_equals_eager"):
        for name in ("gpt", "llama"):
            assert r[name]["max_abs"] == 0.0, r
            # Each rank holds about half of its TP shard (FSDP=2; uneven dims round up).
            assert r[name]["local_fraction"] <= 0.6, r
        _assert_same_training(r["train"], "meta-built TP x FSDP")


def test_fp8_weights_with_fsdp_is_a_clear_error(ranks4) -> None:
    msg = _values(ranks4, "fp8_weights_with_fsdp_is_a_clear_error")[0]
    assert "quantized_model_init" in msg and "FSDP2" in msg, msg
