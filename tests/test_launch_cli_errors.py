"""Config errors on the command line: our message (valid keys, closest match), printed once,
no traceback, non-zero exit, no run directory -- alone and under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tp_fuse.launch.config import MEGATRON_NEEDS_CUDA
from tp_fuse.launch.config_errors import CONFIG_DIR, closest, override_key_error, precheck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "WANDB_MODE": "disabled"})
    return env


def test_typo_in_existing_group_names_valid_keys_and_closest_match():
    msg = override_key_error("trainer.max_step=5")
    assert msg is not None
    assert "unknown key trainer.max_step" in msg and "known keys of trainer: max_steps" in msg
    assert msg.endswith("did you mean trainer.max_steps?")
    assert "did you mean model.hidden_size?" in override_key_error("model.hiden_size=64")
    assert "did you mean trainer?" in override_key_error("trainr.max_steps=5")
    # Valid keys, group selections, additions and Hydra's own keys are left alone.
    for ok in ("trainer.max_steps=5", "fp8=delayed", "+trainer.extra=1", "hydra.run.dir=x", "model.hidden_size=8"):
        assert override_key_error(ok) is None, ok
    assert closest("zzz", ["max_steps"]) is None
    assert "replaced by trainer.val_tokens" in override_key_error("trainer.val_batches=4")


def test_precheck_reports_every_kind_of_config_error():
    assert precheck(["+model=gpt"], CONFIG_DIR, 1) is None
    assert "did you mean trainer.max_steps?" in precheck(["+model=gpt", "trainer.max_step=5"], CONFIG_DIR, 1)
    # An unknown option of a config group: the options and the closest one (issue 25).
    msg = precheck(["+model=gpt", "fp8=delayd"], CONFIG_DIR, 1)
    assert msg == ("unknown option 'delayd' of config group fp8 in 'fp8=delayd'; options: blockwise, current, "
                   "delayed, mxfp8, none, nvfp4, rowwise; did you mean 'delayed'?")
    assert precheck(["+model=gtp"], CONFIG_DIR, 1).endswith("did you mean 'gpt'?")
    assert "did you mean" not in precheck(["+model=gpt", "fp8=zzzz"], CONFIG_DIR, 1)
    # ... and a mistyped value of a field with fixed choices.
    assert precheck(["+model=gpt", "fp8.recipe=delayd"], CONFIG_DIR, 1).endswith("got 'delayd'; did you mean 'delayed'?")
    assert precheck(["+model=gpt", "trainer.peak_flops=remesure"], CONFIG_DIR, 1).endswith("did you mean 'remeasure'?")
    # Hydra's own errors keep their content, without the config search path.
    msg = precheck(["+model=gpt", "optim=adamw,x"], CONFIG_DIR, 1)
    assert "Ambiguous value for argument 'optim=adamw,x'" in msg and "search path" not in msg
    assert precheck(["+model=gpt", "parallel.tp=3"], CONFIG_DIR, 2) == "parallel.tp (3) must divide the world size (2)"
    # A '+' addition of an unknown key is caught by the typed config, with the closest match too.
    assert "did you mean trainer.max_steps?" in precheck(["+model=gpt", "+trainer.max_step=3"], CONFIG_DIR, 1)


def test_cli_typo_one_line_no_traceback_no_run_dir(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "+model=gpt",
                           "trainer.max_step=5"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert out.strip().splitlines() == [
        "[tp-fuse] config error: unknown key trainer.max_step in 'trainer.max_step=5'; known keys of trainer: "
        + out.split("known keys of trainer: ", 1)[1].strip()
    ]
    assert "did you mean trainer.max_steps?" in out
    assert "To append to your config" not in out and "Traceback" not in out
    assert os.listdir(tmp_path) == []  # no run directory


@pytest.mark.multirank
def test_torchrun_config_error_printed_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", os.path.join(ROOT, "launch", "train.py"), "+model=gpt",
           "trainer.max_step=5"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("[tp-fuse] config error:") == 1, out
    assert "did you mean trainer.max_steps?" in out
    # No traceback from the training processes (torchrun's own failure report is torchrun's).
    assert "launch/train.py\", line" not in out and "To append to your config" not in out
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for machines without CUDA")
def test_megatron_model_without_cuda_is_a_config_error_before_start_up():
    # Used to pass validation and fail inside the Trainer with a Hydra traceback.
    assert precheck(["+model=megatron_gpt"], CONFIG_DIR, 1) == MEGATRON_NEEDS_CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for machines without CUDA")
def test_megatron_te_spec_on_cpu_passes_validation_with_learned_positions_and_no_sp():
    # model.spec=te builds on CPU (issue 38); what still needs CUDA is named before start-up.
    assert precheck(["+model=megatron_gpt", "model.spec=te"], CONFIG_DIR, 1) is None
    rope = precheck(["+model=megatron_gpt", "model.spec=te", "model.position_embedding=rope"], CONFIG_DIR, 1)
    assert "model.position_embedding=learned" in rope
    sp = precheck(["+model=megatron_gpt", "model.spec=te", "parallel.tp=2", "parallel.sequence_parallel=true"],
                  CONFIG_DIR, 2)
    assert "parallel.sequence_parallel=false" in sp
    assert "model.spec" in precheck(["+model=gpt", "+model.spec=te"], CONFIG_DIR, 1)
    assert "expected one of local, te" in precheck(["+model=megatron_gpt", "model.spec=tex"], CONFIG_DIR, 1)
