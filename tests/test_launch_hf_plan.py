"""``+model=hf model.plan=...`` (issue 22): the user chooses the wrap plan, checked before any
process starts. A built-in plan by name, or a ``.yaml`` file of ``{module glob: style}``
(Hydra's override grammar cannot spell glob keys); anything else is one ValueError listing
the available plans and styles. Config only: no process group, nothing downloaded."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[hf])")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e .[hf])")

from tp_fuse.launch.api import compose, train  # noqa: E402
from tp_fuse.launch.config import CONFIG_DIR  # noqa: E402
from tp_fuse.launch.config_errors import precheck  # noqa: E402
from tp_fuse.launch.models.hf_plan import resolve_plan  # noqa: E402
from test_launch_hf import _model_dir  # noqa: E402
from tp_fuse.layers import FusedColumn  # noqa: E402

GATED = "model.layers.*.mlp.gate_proj: column\nmodel.layers.*.mlp.up_proj: column\nmodel.layers.*.mlp.down_proj: row\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _model_dir(tmp_path_factory.mktemp("llama"), weights=False)


def test_default_is_the_family_plan(model_dir) -> None:
    cfg = compose(["+model=hf", f"model.path={model_dir}"])
    assert cfg.model.plan is None and resolve_plan(None, object()) is None


def test_a_builtin_plan_by_name(model_dir) -> None:
    cfg = compose(["+model=hf", f"model.path={model_dir}", "model.plan=mistral"])
    assert cfg.model.plan == "mistral" and cfg.to_dict()["model"]["plan"] == "mistral"

    class Config:
        num_attention_heads, num_key_value_heads, hidden_size = 4, 2, 32

    assert resolve_plan("mistral", Config())["model.layers.*.self_attn.q_proj"] == "column"


def test_a_plan_file(model_dir, tmp_path) -> None:
    (tmp_path / "mlp.yaml").write_text(GATED)
    cfg = compose(["+model=hf", f"model.path={model_dir}", f"model.plan={tmp_path / 'mlp.yaml'}"])
    assert cfg.model.plan == {"model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
                              "model.layers.*.mlp.down_proj": "row"}
    assert resolve_plan(cfg.model.plan, object()) == cfg.model.plan


def test_unknown_plan_lists_the_available_ones(model_dir) -> None:
    msg = precheck(["+model=hf", f"model.path={model_dir}", "model.plan=lama"], CONFIG_DIR, 1)
    assert msg is not None and msg.startswith("model.plan: no built-in wrap plan named 'lama'; available: bloom, "), msg
    assert "llama" in msg and "olmo2" in msg and "column, row, sequence_parallel, sharded_norm" in msg, msg


@pytest.mark.parametrize("text,needle", [
    ("model.layers.*.mlp.up_proj: diagonal\n", "model.plan['model.layers.*.mlp.up_proj']: unknown style 'diagonal'"),
    ("- column\n", "must hold a YAML mapping {module glob: style}, got list"),
    ("!!python/object:os.system {}\n", "model.plan: plan file "),
])
def test_bad_plan_file_is_one_error(model_dir, tmp_path, text, needle) -> None:
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ValueError, match=None) as e:
        compose(["+model=hf", f"model.path={model_dir}", f"model.plan={tmp_path / 'p.yaml'}"])
    assert needle in str(e.value), str(e.value)


def test_only_hf_takes_a_plan() -> None:
    with pytest.raises(ValueError, match="model.plan: only \\+model=hf takes a wrap plan"):
        compose(["+model=gpt", "+model.plan=llama"])


# ---- model.plan=<module>:<attribute>: a plan in the user's own Python code

_PLAN_MODULE = '''
from tp_fuse.layers import FusedColumn
from tp_fuse.layers.wrap.hf_plans import FAMILIES

CALLS = []
MLP = {"model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
       "model.layers.*.mlp.down_proj": "row"}
FUSED = {"model.layers.*.mlp.gate_proj": FusedColumn(2)}
NOT_A_PLAN = 3
BAD_STYLE = {"model.layers.*.mlp.up_proj": "diagonal"}


def llama(config):
    CALLS.append(config.num_attention_heads)
    return FAMILIES["llama"].plan_for(config)


# GLM has no built-in plan: its attention is llama's, its MLP a fused [gate; up].
GLM = {**{k: v for k, v in FAMILIES["llama"].plan_for(None).items() if ".self_attn." in k},
       "model.layers.*.mlp.gate_up_proj": FusedColumn(2), "model.layers.*.mlp.down_proj": "row"}
'''


@pytest.fixture()
def plan_module(tmp_path, monkeypatch) -> str:
    """A module of plans in the current directory, under a name no other test imports."""
    name = f"user_plans_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(_PLAN_MODULE)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_a_plan_in_python_code(model_dir, plan_module) -> None:
    cfg = compose(["+model=hf", f"model.path={model_dir}", f"model.plan={plan_module}:MLP"])
    assert cfg.model.plan == f"{plan_module}:MLP"  # the config keeps the name, every rank imports it
    assert resolve_plan(cfg.model.plan, object())["model.layers.*.mlp.down_proj"] == "row"
    assert isinstance(resolve_plan(f"{plan_module}:FUSED", object())["model.layers.*.mlp.gate_proj"], FusedColumn)

    class Config:
        num_attention_heads, num_key_value_heads, hidden_size = 4, 2, 32

    got = resolve_plan(f"{plan_module}:llama", Config())  # a function: called with the model's config
    assert got["model.layers.*.self_attn.q_proj"] == "column" and sys.modules[plan_module].CALLS == [4]


@pytest.mark.parametrize("attr,needle", [
    ("NOT_A_PLAN", "expected a mapping {module glob: style} or a callable plan(config) -> mapping, got int"),
    ("BAD_STYLE", "['model.layers.*.mlp.up_proj']: unknown style 'diagonal'"),
    ("MISSING", "has no attribute 'MISSING'"),
])
def test_bad_plan_object_is_one_error(model_dir, plan_module, attr, needle) -> None:
    msg = precheck(["+model=hf", f"model.path={model_dir}", f"model.plan={plan_module}:{attr}"], CONFIG_DIR, 1)
    assert msg is not None and needle in msg, msg


def test_unimportable_plan_module_is_one_error(model_dir) -> None:
    msg = precheck(["+model=hf", f"model.path={model_dir}", "model.plan=no_such_plans_module:PLAN"], CONFIG_DIR, 1)
    assert msg is not None and "cannot import module 'no_such_plans_module'" in msg and "PYTHONPATH" in msg, msg


def test_launcher_trains_with_a_plan_function(model_dir, plan_module, tmp_path) -> None:
    result = train(["+model=hf", f"model.path={model_dir}", f"model.plan={plan_module}:llama", "data.seq_len=16",
                    "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "trainer.max_steps=2",
                    "trainer.log_interval=1", "trainer.val_interval=0", "logger=none", "trainer.progress=false",
                    "checkpoint.save_final=false"], str(tmp_path / "run"))
    assert sorted(result.losses) == [1, 2] and sys.modules[plan_module].CALLS == [4]


# ---- a family without a built-in plan (issue 39): the launcher takes the user's plan


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory) -> str:
    return _model_dir(tmp_path_factory.mktemp("glm"), weights=False, family="glm", head_dim=8)


def test_family_without_builtin_plan_needs_model_plan(glm_dir) -> None:
    msg = precheck(["+model=hf", f"model.path={glm_dir}"], CONFIG_DIR, 1)
    assert msg is not None and msg.startswith("model.plan: wrap has no built-in plan for model_type 'glm'"), msg


def test_launcher_trains_glm_with_its_plan(glm_dir, plan_module, tmp_path) -> None:
    result = train(["+model=hf", f"model.path={glm_dir}", f"model.plan={plan_module}:GLM", "data.seq_len=16",
                    "trainer.global_batch_size=2", "trainer.micro_batch_size=2", "trainer.max_steps=2",
                    "trainer.log_interval=1", "trainer.val_interval=0", "logger=none", "trainer.progress=false",
                    "checkpoint.save_final=false"], str(tmp_path / "run"))
    assert sorted(result.losses) == [1, 2]
