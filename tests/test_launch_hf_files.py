"""+model=hf reads a model directory through the libraries made for it, and still refuses
crafted files: config.json through ``transformers.AutoConfig`` (no remote code: an
``auto_map`` is ignored), weight headers through ``safetensors`` (launch/models/hf_config.py,
launch/models/hf_weights.py)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402

from tp_fuse.launch.models import hf_config, hf_weights  # noqa: E402


def _config_dir(tmp_path, **extra) -> str:
    path = str(tmp_path / "model")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(path)
    if extra:
        file = os.path.join(path, "config.json")
        with open(file) as f:
            data = json.load(f)
        data.update(extra)
        with open(file, "w") as f:
            json.dump(data, f)
    return path


def test_config_is_transformers_own_reading(tmp_path) -> None:
    path = _config_dir(tmp_path)
    config = hf_config.hf_config(path)
    assert type(config) is transformers.LlamaConfig
    fields = hf_config.gpt_fields(path)
    assert (fields["hidden_size"], fields["num_heads"], fields["num_query_groups"]) == (32, 4, 2)
    assert fields["tie_embeddings"] == config.tie_word_embeddings


def test_auto_map_runs_no_code(tmp_path) -> None:
    marker = tmp_path / "ran"
    path = _config_dir(tmp_path, auto_map={"AutoConfig": "evil.EvilConfig",
                                           "AutoModelForCausalLM": "evil.EvilModel"})
    with open(os.path.join(path, "evil.py"), "w") as f:
        f.write(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert type(hf_config.hf_config(path)) is transformers.LlamaConfig
    hf_config.gpt_fields(path)
    assert not marker.exists()


def test_a_field_transformers_refuses_is_one_config_error(tmp_path) -> None:
    path = _config_dir(tmp_path, num_attention_heads=None)
    with pytest.raises(ValueError, match=r"config.json: transformers cannot read it as a llama config"):
        hf_config.gpt_fields(path)


def _weights(path: str) -> str:
    file = os.path.join(path, "model.safetensors")
    save_file({"lm_head.weight": torch.zeros(4, 4)}, file, metadata={"format": "pt"})
    return file


@pytest.mark.parametrize("content", [
    b"abc",  # shorter than the 8-byte header length
    struct.pack("<Q", 2**40) + b"{}",  # a header larger than the library's bound
    struct.pack("<Q", 5) + b"{{{{{",  # not JSON
    struct.pack("<Q", 2) + b"[]",  # JSON, not an object
    struct.pack("<Q", 10**5) + b"[" * 10**5,  # deeply nested
    struct.pack("<Q", 60) + b'{"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}',  # truncated
])
def test_crafted_safetensors_headers_are_refused_naming_the_file(tmp_path, content) -> None:
    path = _config_dir(tmp_path)
    with open(_weights(path), "wb") as f:
        f.write(content)
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        hf_weights.check_weight_files(path)


def test_a_fifo_weight_file_is_refused_not_waited_on(tmp_path) -> None:
    path = _config_dir(tmp_path)
    os.mkfifo(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors is a FIFO"):
        hf_weights.check_weight_files(path)


def test_float_weights_pass_the_header_check(tmp_path) -> None:
    path = _config_dir(tmp_path)
    _weights(path)
    hf_weights.check_weight_files(path)
