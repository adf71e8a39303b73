"""Validation is one fixed token set, whatever the TP/DP layout (issue: it counted per DP rank).

Unit: the DP shards of the validation set are a partition of the same windows for dp = 1, 2, 4.
End to end: one process vs. 2 ranks as DP=2 -- the same validation loss (the 2 ranks are
``tp_fuse.launch.api.train`` in one start of 2 gloo ranks: the launcher's path without
torchrun's start, which test_launch_train.py covers).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tp_fuse.launch.api import train
from tp_fuse.launch.config import DataConfig
from tp_fuse.launch.data import BatchLoader, TokenData
from tp_fuse.launch.logging.metrics import read_jsonl
from dist_utils import run_distributed
from test_launch_train import TINY
from tolerances import tols


def _loader(data, dp_rank, dp_size):
    return BatchLoader(data, global_batch_size=24, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size,
                       seed=1, device=torch.device("cpu"))


def test_validation_set_is_the_same_for_every_dp_size():
    data = TokenData.build(DataConfig(), seq_len=32, vocab_size=256)
    val_tokens = 50 * 32 + 7  # 50 whole windows (the remainder does not make a window)

    def rows(dp):
        out = []
        for r in range(dp):
            for tokens, _ in _loader(data, r, dp).val_batches(val_tokens):
                out.extend(tuple(row.tolist()) for row in tokens)
        return sorted(out)

    ref = rows(1)
    assert len(ref) == 50
    assert rows(2) == ref and rows(4) == ref and rows(3) == ref
    # Capped at the validation split; at least one window.
    loader = _loader(data, 0, 1)
    assert loader.val_windows(10**12) == data.num_val_windows
    assert loader.val_windows(1) == 1


def _train_dp2(rank: int, world_size: int, args: list[str], run_dir: str) -> None:
    """One rank of the DP=2 run (inside run_distributed)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    train(args, run_dir)


@pytest.mark.multirank
def test_validation_loss_does_not_depend_on_the_layout(tmp_path):
    common = [*TINY, "trainer.max_steps=2", "trainer.log_interval=1", "trainer.val_interval=2",
              "trainer.val_tokens=1600", "logger=none"]
    single = train(common, run_dir=str(tmp_path / "one"))
    run_distributed(2, _train_dp2, [*common, "parallel.tp=1"], str(tmp_path / "dp2"), timeout=300)  # DP=2
    metrics = read_jsonl(str(tmp_path / "dp2" / "metrics.jsonl"))
    dp2_val = metrics[-1]["val_loss"]
    assert math.isfinite(dp2_val)
    assert dp2_val == pytest.approx(single.val_losses[2], rel=tols(torch.float32)["rtol"])
    assert metrics[-1]["loss"] == pytest.approx(single.losses[2], rel=tols(torch.float32)["rtol"])
