"""A quiet, informative launcher run (2 ranks, TP=2 + SP + FP8 + overlap, one elastic restart):

* no UserBufferPool growth warnings (the launcher presizes the overlap workspaces);
* a Megatron overlap YAML with GPU-only knobs: one short line, printed once;
* the start report (parameters, resolved config, validation set, MFU formula and peak, W&B mode);
* log lines with step time, tokens/s, MFU, memory and ETA, also in train.log;
* the elastic restart continues the same W&B run.
"""

from __future__ import annotations

import glob
import os

import pytest

from tp_fuse.launch.logging.metrics import read_jsonl
from test_launch_train import TINY, torchrun

MEGATRON_YAML = """\
qkv_fprop: {method: ring_exchange, aggregate: 0}
qkv_dgrad: {method: bulk, num_sm: 4, cga_size: 2, set_sm_margin: 0}
fc1_fprop: {method: ring_exchange}
proj_fprop: {method: pipeline, num_sm: 24, cga_size: 2, num_splits: 4, set_sm_margin: 1}
fc2_fprop: {method: pipeline, num_sm: 16, cga_size: 2, num_splits: 4, set_sm_margin: 1}
"""


@pytest.mark.multirank
def test_quiet_informative_run_with_restart(tmp_path):
    ub = tmp_path / "ub_cfg.yaml"
    ub.write_text(MEGATRON_YAML)
    proc = torchrun([*TINY, "trainer.max_steps=4", "trainer.log_interval=1", "trainer.val_interval=2",
                     "trainer.val_tokens=512", "parallel.tp=2", "parallel.sequence_parallel=true", "fp8=delayed",
                     "overlap=on", f"overlap.config={ub}", "checkpoint.interval=2", "trainer.fail_at_step=3"],
                    cwd=str(tmp_path), extra=("--max-restarts=1",), env={"HOME": str(tmp_path / "home")},
                    timeout=400)
    out = proc.stdout + proc.stderr
    assert "grows from" not in out  # no UserBufferPool growth warnings
    knob_lines = [line for line in out.splitlines() if "have no effect on this build" in line]
    assert len(knob_lines) == 2  # once per attempt (rank 0 only), short
    assert all(len(line) < 300 and "num_sm" in line for line in knob_lines)
    for needle in ("[tp-fuse] parameters: ", "[tp-fuse] resolved config:", "[tp-fuse] validation set: 16 sequences",
                   "[tp-fuse] MFU = tokens/s x", "[tp-fuse] W&B: offline, run ", "wandb sync "):
        assert needle in out, needle

    (run_dir,) = glob.glob(str(tmp_path / "outputs" / "*" / "*"))
    log = open(os.path.join(run_dir, "train.log")).read()
    assert "step      4/4" in log and "ms/step" in log and "ETA" in log and "MFU" in log
    assert "[tp-fuse] parameters: " in log
    # The run directory, every save and the end-of-run summary are in train.log too (issue 25).
    assert f"[tp-fuse] run dir: {run_dir}" in log
    assert f"[tp-fuse] saved checkpoint step 4 -> {run_dir}/checkpoints/step_00000004" in log
    assert "[tp-fuse] run summary:" in log and f"  run dir          {run_dir}" in log and "wandb sync " in log
    last = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[-1]
    assert last["step"] == 4
    assert {"step_time_s", "tokens_per_s", "eta_s", "mfu", "peak_mem_gib"} <= set(last)
    assert 0 < last["mfu"] < 1 and last["peak_mem_gib"] > 0 and last["eta_s"] == 0
    # FP8 statistics still flow with the presized workspaces (the presizing forward is not recorded).
    fp8 = read_jsonl(os.path.join(run_dir, "fp8_stats.jsonl"))
    assert [r["step"] for r in fp8] == [1, 2, 3, 4]
    assert fp8[-1]["fp8/layers.0/fc1/input/amax"] > 0
    # Two attempts, one W&B run id.
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(runs) == 2
    assert len({r.rsplit("-", 1)[1] for r in runs}) == 1
