"""Launcher configuration: Hydra composition, typed conversion, validation errors.

Single process, no process groups: validation must run before any of that exists.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tp_fuse.launch.api import compose
from tp_fuse.launch.config import CONFIG_DIR
from tp_fuse.launch.config_parse import from_dict
from tp_fuse.launch.config_validate import validate
from tp_fuse.launch.config_errors import precheck
from tp_fuse.launch.optim import lr_at
from tp_fuse.launch.runtime import rank_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _validate(overrides: list[str], world: int = 1):
    return validate(compose(overrides), world)


def test_default_config_composes_and_validates():
    cfg = compose(["+model=gpt"])
    layout = validate(cfg, 1)
    assert (layout.tp, layout.dp, layout.grad_accum_steps) == (1, 1, 2)
    assert cfg.fp8.recipe == "none" and not cfg.overlap.enabled and cfg.logger.kind == "wandb"
    assert cfg.seq_len == cfg.model.gpt.max_seq_len == 128
    # The overrides users type keep their names.
    cfg = compose([
        "+model=gpt", "trainer.max_steps=7", "trainer.log_interval=3", "trainer.seed=5", "parallel.tp=2",
        "parallel.sequence_parallel=true", "fp8=delayed", "overlap=on", "logger=none", "checkpoint.dir=/x",
        "checkpoint.interval=4", "checkpoint.resume=true",
    ])
    assert (cfg.trainer.max_steps, cfg.trainer.log_interval, cfg.trainer.seed) == (7, 3, 5)
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel and cfg.overlap.enabled
    assert cfg.fp8.recipe == "delayed" and cfg.logger.kind == "none"
    assert (cfg.checkpoint.dir, cfg.checkpoint.interval, cfg.checkpoint.resume) == ("/x", 4, True)
    layout = validate(cfg, 4)
    assert (layout.tp, layout.dp) == (2, 2)


@pytest.mark.parametrize(
    "preset, world",
    [("gpt", 1), ("gpt", 2), ("gpt-125m", 4), ("gpt-350m", 8), ("llama", 2), ("llama-1b", 8)],
)
def test_model_presets_validate(preset, world):
    cfg = compose([f"+model={preset}", "fp8=delayed", "trainer.micro_batch_size=2", "trainer.global_batch_size=16"])
    layout = validate(cfg, world)
    assert layout.tp == world  # tp=auto: every rank
    if preset.startswith("llama"):
        g = cfg.model.gpt
        assert (g.normalization, g.activation, g.position_embedding) == ("RMSNorm", "swiglu", "rope")
        assert g.kv_groups < g.num_heads


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["model.num_heads=3", "model.hidden_size=96", "parallel.tp=2"], 2, "must divide model.num_heads (3)"),
        (["model.num_query_groups=1", "parallel.tp=2"], 2, "must divide model.num_query_groups (1)"),
        (["model.ffn_hidden_size=100", "model.num_heads=8", "parallel.tp=8", "trainer.global_batch_size=8"], 8,
         "must divide model.ffn_hidden_size (100)"),
        (["model.vocab_size=257", "parallel.tp=2"], 2, "must divide model.vocab_size (257)"),
        (["model.hidden_size=132", "model.num_heads=4", "parallel.tp=8", "model.num_query_groups=8",
          "trainer.global_batch_size=8"], 8, "model.num_heads (4) must be divisible by model.num_query_groups (8)"),
        (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel=true needs parallel.tp > 1"),
        (["parallel.tp=3"], 2, "parallel.tp (3) must divide the world size (2)"),
        (["fp8=delayed", "model.hidden_size=72"], 1, "needs GEMM dimensions divisible by 16: model.hidden_size = 72"),
        (["fp8=current", "parallel.tp=2", "model.hidden_size=112", "model.num_heads=2"], 2,
         "model.hidden_size / parallel.tp = 56"),
        (["fp8=delayed", "data.seq_len=9", "trainer.micro_batch_size=1", "trainer.global_batch_size=1"], 1,
         "tokens per micro-batch"),
        (["trainer.global_batch_size=12"], 2, "trainer.global_batch_size (12) must be a multiple of"),
        (["overlap=on"], 1, "overlap=on needs parallel.tp > 1"),
        (["data.seq_len=4096"], 1, "data.seq_len (4096) must be in [2, model.max_seq_len=128]"),
        (["optim.min_lr=1.0"], 1, "optim.min_lr must be in [0, optim.lr"),
        (["data=text"], 1, "data.paths must list at least one file"),
        (["trainer.fail_at_step=1000"], 1, "trainer.fail_at_step must be in [1, trainer.max_steps=300]"),
        ([f"debug.config={os.path.join(ROOT, 'configs', 'debug', 'example_features.yaml')}"], 1,
         "enables LogFp8TensorStats, which needs FP8: use fp8=delayed or fp8=current"),
        (["debug.config=/no/such.yaml"], 1, "debug.config=/no/such.yaml: debug config: no such file"),
    ],
)
def test_validation_errors_name_the_field(overrides, world, message):
    with pytest.raises(ValueError) as info:
        _validate(["+model=gpt", *overrides], world)
    assert message in str(info.value)


def test_type_and_unknown_key_errors():
    with pytest.raises(ValueError, match=r"trainer\.max_steps: expected an int, got 'ten'"):
        compose(["+model=gpt", "trainer.max_steps=ten"])
    with pytest.raises(ValueError, match=r"parallel\.tp: expected int \| 'auto', got True"):
        compose(["+model=gpt", "parallel.tp=true"])
    with pytest.raises(ValueError, match=r"fp8\.group: expected one of 'tp' \| 'dp' \| 'world', got 'node'"):
        compose(["+model=gpt", "fp8=delayed", "fp8.group=node"])
    # Keys that Hydra lets through with '+' are still unknown to the typed config.
    with pytest.raises(ValueError, match=r"unknown key\(s\) trainer\.max_step; known keys of trainer: max_steps"):
        compose(["+model=gpt", "+trainer.max_step=3"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) model\.hiden_size"):
        compose(["+model=gpt", "+model.hiden_size=3"])
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) extra"):
        compose(["+model=gpt", "+extra=1"])
    with pytest.raises(ValueError, match=r"model: no model selected; add \+model=gpt"):
        compose([])
    base = {"model": {"name": "gpt"}, "trainer": {"seed": 1.5}}
    with pytest.raises(ValueError, match=r"trainer\.seed: expected an int, got 1\.5"):
        from_dict(base)


def test_cli_reports_config_error_before_starting(tmp_path):
    """The command line fails fast with the field name (no process group, no run)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train.py"), "+model=gpt", "fp8=delayed",
         "model.hidden_size=72", "logger=none"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "model.hidden_size = 72" in proc.stderr
    assert "ParallelTopology" not in proc.stderr  # validation ran before start-up
    assert not (tmp_path / "outputs").exists()  # checked before Hydra makes a run directory


def test_lr_schedule_warmup_then_cosine():
    cfg = compose(["+model=gpt", "optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10"]).optim
    assert lr_at(1, cfg, 110) == pytest.approx(0.1)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)


def test_rank_overrides(monkeypatch):
    for var in ("RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    assert rank_overrides([]) == []  # plain python: Hydra's defaults
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RANK", "1")
    extra = rank_overrides(["hydra.run.dir=/some/where"])
    assert "hydra.output_subdir=null" in extra and "hydra.run.dir=." in extra  # rank 1 writes nothing
    monkeypatch.setenv("RANK", "0")
    assert rank_overrides(["hydra.run.dir=/some/where"]) == []  # rank 0 honours the user's dir
    (auto,) = rank_overrides([])
    # Deterministic per torchrun agent (our parent here): the same on every call/rank/restart.
    assert auto.startswith("hydra.run.dir=outputs/") and auto.endswith(f"-{os.getppid()}")
    assert rank_overrides([]) == [auto]


@pytest.mark.parametrize("text, message", [
    ("a: !!python/object/apply:os.system ['touch {marker}']\n",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
    ("a: !!python/name:os.system\n", "python/name:os.system"),
    ("a: !custom {{}}\n", "could not determine a constructor for the tag '!custom'"),
])
def test_unsafe_yaml_tag_in_debug_config_is_one_config_error(tmp_path, text, message):
    """Issue 24 item 8: yaml.safe_load's ConstructorError (not a ValueError) escaped the
    config check as a traceback. Now one line naming the file, line and column; nothing runs."""
    marker = tmp_path / "ran"
    config = tmp_path / "debug.yaml"
    config.write_text(text.format(marker=marker))
    msg = precheck(["+model=gpt", f"debug.config={config}"], CONFIG_DIR, 1)
    assert msg is not None and "\n" not in msg, msg
    assert msg.startswith(f"debug.config={config}: debug config {config}: line 1, column 4:"), msg
    assert message in msg and "no !!python or other tags" in msg, msg
    assert not marker.exists()


def test_malformed_debug_config_yaml_is_one_config_error(tmp_path):
    config = tmp_path / "debug.yaml"
    config.write_text("a: [1, 2\nb: 3\n")
    msg = precheck(["+model=gpt", f"debug.config={config}"], CONFIG_DIR, 1)
    assert msg is not None and "\n" not in msg and "not valid YAML: line " in msg, msg
