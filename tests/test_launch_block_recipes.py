"""The launcher with every block-scaled recipe: ``fp8=blockwise|mxfp8|rowwise|nvfp4`` at TP=2 with
sequence parallelism and overlap on (the block-scaled all-gathers fused), a few steps each;
and the config check for rows that would split a block between ranks.

The four TP=2 runs are ``tp_fuse.launch.api.train`` in ONE start of 2 gloo ranks (the process
group is reused, new meshes per run), as in ``test_fsdp_launch.py``: the torchrun entry
point itself is tested in ``test_launch_train.py``; here what matters is each recipe
through the launcher's model, TP/SP/overlap wiring, metrics and FP8 statistics."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest

from dist_utils import run_distributed
from tp_fuse.launch.api import compose
from tp_fuse.launch.config_validate import validate
from tp_fuse.launch.logging.metrics import read_jsonl
from test_launch_train import TINY

RECIPES = ["blockwise", "mxfp8", "rowwise", "nvfp4"]


def _tp_runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from tp_fuse.launch.api import train

    os.environ.update({"WORLD_SIZE": str(world_size), "RANK": str(rank)})
    # 4 sequences x 64 tokens / 2 ranks = 128 rows per rank: whole 1x128 / 1x32 blocks.
    args = [a for a in TINY if not a.startswith("data.seq_len")] + ["data.seq_len=64"]
    # An exception propagates: run_distributed reports its traceback and stops the other
    # rank at once (returned as a result, it left the other rank waiting in a collective).
    out: dict[str, Any] = {}
    for recipe in RECIPES:
        train([*args, "trainer.max_steps=3", "trainer.log_interval=1", "trainer.val_interval=0", "logger=none",
               f"fp8={recipe}", "parallel.tp=2", "parallel.sequence_parallel=true", "overlap=on"],
              os.path.join(root, recipe))
        out[recipe] = "done"
    return out


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("block_recipes_tp"))
    results = run_distributed(2, _tp_runs, root, timeout=600)
    assert all(r == {recipe: "done" for recipe in RECIPES} for r in results), results
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", RECIPES)
def test_launcher_trains_with_block_recipe_tp_sp_overlap(tp_runs, recipe):
    run_dir = os.path.join(tp_runs, recipe)
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    # Block-scale statistics per GEMM tensor, in the FP8 stats JSONL.
    last = read_jsonl(os.path.join(run_dir, "fp8_stats.jsonl"))[-1]
    for tensor in ("input", "weight", "grad_output"):
        for stat in ("block_scale_inv_min", "block_scale_inv_max", "block_scale_inv_std", "underflow_pct",
                     "overflow_pct", "mse", "amax"):
            value = last[f"fp8/layers.0/fc1/{tensor}/{stat}"]
            assert math.isfinite(value), (tensor, stat, value)
        assert 0 < last[f"fp8/layers.0/fc1/{tensor}/block_scale_inv_min"] <= last[f"fp8/layers.0/fc1/{tensor}/block_scale_inv_max"]


def test_config_refuses_rows_that_split_blocks_between_ranks():
    base = ["+model=gpt", "parallel.tp=2", "parallel.sequence_parallel=true", "overlap=on",
            "data.seq_len=64", "trainer.micro_batch_size=2"]  # 2 * 64 / 2 = 64 rows per rank
    validate(compose([*base, "fp8=mxfp8"]), 2)  # 64 % 32 == 0
    validate(compose([*base, "fp8=rowwise"]), 2)  # one scale per row: any row count
    with pytest.raises(ValueError, match=r"fp8.recipe=blockwise .* = 64\) to be a multiple of the 128-row block"):
        validate(compose([*base, "fp8=blockwise"]), 2)
    validate(compose([*base, "fp8=blockwise", "overlap=off"]), 2)  # unfused: gathers in high precision
    validate(compose([*base, "fp8=nvfp4"]), 2)  # 64 % 16 == 0
    odd = [a for a in base if not a.startswith("data.seq_len")] + ["data.seq_len=24"]  # 2 * 24 / 2 = 24 rows
    with pytest.raises(ValueError, match=r"fp8.recipe=nvfp4 .* = 24\) to be a multiple of the 16-row block"):
        validate(compose([*odd, "fp8=nvfp4"]), 2)


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "nvfp4"])
def test_checkpoint_resume_with_block_recipe_continues_bitwise(tmp_path, recipe):
    import shutil

    from tp_fuse.launch.api import train

    # Checkpoint at step 2 of 4; the resumed run's steps 3 and 4 (the second one after a whole
    # resumed optimizer step) equal the uninterrupted run's, bit for bit.
    run = [*TINY, "trainer.max_steps=4", "trainer.log_interval=1", "trainer.val_interval=0", "logger=none",
           f"fp8={recipe}", "fp8.stats=false", "checkpoint.interval=2", "checkpoint.keep=2"]
    train([*run, f"checkpoint.dir={tmp_path / 'ck'}"], str(tmp_path / "a"))
    ck = tmp_path / "ck2"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck" / "step_00000002", ck / "step_00000002")
    result = train([*run, "checkpoint.resume=true", f"checkpoint.dir={ck}"], str(tmp_path / "b"))
    assert result.start_step == 2
    full = {r["step"]: r["loss"] for r in read_jsonl(str(tmp_path / "a" / "metrics.jsonl"))}
    resumed = {r["step"]: r["loss"] for r in read_jsonl(str(tmp_path / "b" / "metrics.jsonl"))}
    assert sorted(resumed) == [3, 4]
    assert resumed == {s: full[s] for s in (3, 4)}
