"""Poisoned FP8 state is refused at load, naming the key (issue: reliability round 3, case 4).

Delayed-scaling state that no training run produces -- NaN/inf/0/negative scales, NaN or
3e38 amax histories, negative counters, recipe fields out of range -- used to load
silently: a resumed checkpoint with inf scales and a 3e38 history trained at a worse loss
for a whole history length, exit 0. Both ways in are checked: a module's
``load_state_dict`` (``_extra_state``) and the launcher's resume from a DCP checkpoint
whose manifest hashes the attacker recomputed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tp_fuse as te
from tp_fuse.launch.checkpoint import safe_dcp
from tp_fuse.launch.api import train
from tp_fuse.launch.checkpoint.manager import MANIFEST, CheckpointError
from tp_fuse.launch.checkpoint.files import file_table, read_manifest
from test_checkpoint_resume import COMMON
from tp_fuse import ops
from tp_fuse.recipe import DelayedScaling

SMALL = [*COMMON, "trainer.max_steps=4"]

# ---- load_state_dict (_extra_state) -------------------------------------------------------


def _trained_linear() -> ops.BasicLinear:
    lin = ops.BasicLinear(16, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        lin(torch.randn(8, 16))
    return lin


def _edit_extra_state(sd: dict, edit) -> dict:
    """``sd`` with its ``_extra_state`` JSON changed by ``edit(doc)`` (an attacker needs no pickle)."""
    key = next(k for k in sd if k.endswith("_extra_state"))
    doc = json.loads(bytes(sd[key].numpy().tobytes()))
    edit(doc)
    return {**sd, key: torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8).clone()}


def _set_values(field: str, values, dtype=torch.float32):
    def edit(doc):
        entry = doc["quantizers"]["roles"]["input"][field]
        t = torch.frombuffer(bytearray(base64.b64decode(entry["data"])), dtype=torch.uint8).view(dtype).clone()
        for i, v in values.items():
            t.view(-1)[i] = v
        entry["data"] = base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode()
    return edit


@pytest.mark.parametrize("field, values, dtype, match", [
    ("scale", {0: float("inf")}, torch.float32, r"roles\.input\.scale is inf: an FP8 scale must be finite and > 0"),
    ("scale", {0: float("nan")}, torch.float32, r"roles\.input\.scale is nan"),
    ("scale", {0: 0.0}, torch.float32, r"roles\.input\.scale is 0:"),
    ("scale", {0: -2.0}, torch.float32, r"roles\.input\.scale is -2:"),
    ("amax_history", {1: float("nan")}, torch.float32, r"roles\.input\.amax_history is \[1\] = nan: an FP8 amax"),
    ("amax_history", {2: 3e38}, torch.float32, r"roles\.input\.amax_history is \[2\] = 3e\+38: an FP8 amax "
                                               r"must be finite, >= 0 and <= 2\*\*64"),
    ("amax_history", {0: -1.0}, torch.float32, r"roles\.input\.amax_history is \[0\] = -1:"),
    ("last_amax", {0: float("inf")}, torch.float32, r"roles\.input\.last_amax is inf"),
    ("nonfinite_amax_count", {0: -3}, torch.int64, r"roles\.input\.nonfinite_amax_count is -3: a counter must be"),
])
def test_load_state_dict_refuses_poisoned_quantizer_state(field, values, dtype, match):
    src = _trained_linear()
    dst = _trained_linear()
    before = {k: v.clone() for k, v in dst._quantizers.quantizers["input"].__dict__.items() if torch.is_tensor(v)}
    sd = _edit_extra_state(src.state_dict(), _set_values(field, values, dtype))
    with pytest.raises(ValueError, match=r"BasicLinear _extra_state\.quantizers\." + match):
        dst.load_state_dict(sd)
    after = dst._quantizers.quantizers["input"]
    assert all(torch.equal(getattr(after, k), v) for k, v in before.items())  # nothing half-loaded


@pytest.mark.parametrize("key, value, match", [
    ("margin", 1000, r"recipe\.margin is 1000, expected an int in \[0, 64\]"),
    ("margin", -1, r"recipe\.margin is -1"),
    ("amax_history_len", 10**12, r"recipe\.amax_history_len is 1000000000000, expected an int in \[1, 1048576\]"),
    ("amax_history_len", 0, r"recipe\.amax_history_len is 0"),
    ("reduce_amax", "yes", r"recipe\.reduce_amax is 'yes', expected a bool"),
])
def test_a_fresh_op_refuses_recipe_fields_out_of_range(key, value, match):
    sd = _edit_extra_state(_trained_linear().state_dict(), lambda doc: doc["quantizers"]["recipe"].update({key: value}))
    with pytest.raises(ValueError, match=match):
        ops.BasicLinear(16, 16).load_state_dict(sd)  # a fresh op builds its quantizers from the recipe


def test_valid_state_still_loads_exactly():
    src, dst = _trained_linear(), ops.BasicLinear(16, 16)
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst._quantizers.quantizers["input"].amax_history, src._quantizers.quantizers["input"].amax_history)


# ---- launcher resume (DCP checkpoint, manifest recomputed) ---------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ck = tmp_path_factory.mktemp("fp8_ck")
    train([*SMALL, "trainer.max_steps=2", "checkpoint.interval=2", f"checkpoint.dir={ck}"],
          str(tmp_path_factory.mktemp("run")))
    return ck


def _poison(step_dir, edit) -> str:
    """Load the checkpoint's tensors, change them with ``edit(sd)``, save them again and
    recompute the manifest's sizes and hashes: what an attacker with write access can do."""
    md = safe_dcp.read_metadata(str(step_dir))
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=safe_dcp.SafeFileSystemReader(str(step_dir)), planner=safe_dcp.SafeLoadPlanner(),
             no_dist=True)
    key = edit(sd)
    for name in os.listdir(step_dir):
        if name != MANIFEST:
            os.remove(step_dir / name)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(step_dir)), no_dist=True)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] = file_table(str(step_dir))
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    return key


def _set(suffix: str, index, value):
    def edit(sd):
        key = sorted(k for k in sd if k.endswith(suffix))[0]
        sd[key].view(-1)[index] = value
        return key
    return edit


def _inf_scale_and_huge_history(sd):
    """The issue's poison: every scale inf, every history 3e38 (it trained at a worse loss, exit 0)."""
    for k in sd:
        if "/fp8/" in k and k.endswith("/scale"):
            sd[k].fill_(float("inf"))
        if "/fp8/" in k and k.endswith("/amax_history"):
            sd[k].fill_(3e38)
    return sorted(k for k in sd if k.endswith("/amax_history"))[0]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _poison's single-process DCP
@pytest.mark.parametrize("edit, match", [
    (_inf_scale_and_huge_history, r"rank0/fp8/\S+/amax_history is \[0\] = 3e\+38: an FP8 amax must be"),
    (_set("/scale", 0, float("inf")), r"rank0/fp8/\S+/scale is inf: an FP8 scale must be finite and > 0"),
    (_set("/amax_history", 5, 3e38), r"rank0/fp8/\S+/amax_history is \[5\] = 3e\+38"),
    (_set("/amax_history", 0, float("nan")), r"rank0/fp8/\S+/amax_history is \[0\] = nan"),
    (_set("/nonfinite_amax_count", 0, -1), r"rank0/fp8/\S+/nonfinite_amax_count is -1: a counter must be >= 0"),
    (_set("train/consumed_samples", 0, -8), r"train/consumed_samples is -8: a counter must be >= 0"),
], ids=["issue_poison", "inf_scale", "huge_history", "nan_history", "negative_counter", "negative_position"])
def test_resume_refuses_a_poisoned_fp8_checkpoint(saved, tmp_path, edit, match):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    key = _poison(ck / "step_00000002", edit)
    with pytest.raises(CheckpointError, match=rf"checkpoint .*step_00000002: {match}.*refusing to resume") as err:
        train([*SMALL, "checkpoint.resume=true", f"checkpoint.dir={ck}"], str(tmp_path / "run"))
    assert f": {key} is " in str(err.value)  # names the exact key


@pytest.mark.parametrize("field, value, match", [
    ("amax_history_len", -1, r"field 'amax_history_len' is -1, expected an int >= 1 or null"),
    ("amax_history_len", True, r"field 'amax_history_len' is True"),
    ("step", -5, r"field 'step' is -5, out of range"),
    ("tp", 0, r"field 'tp' is 0, out of range"),
])
def test_manifest_fields_out_of_range_are_refused(saved, tmp_path, field, value, match):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    path = ck / "step_00000002" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest[field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=match):
        read_manifest(str(ck / "step_00000002"))
