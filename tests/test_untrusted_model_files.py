"""A +model=hf directory's JSON config files as a user (or whoever filled the directory)
hands them over (issue 40 point 6/8): read with a size bound that the error names, never
read whole from a sparse or special file."""

from __future__ import annotations

import json
import os

import pytest

from tp_fuse.launch.models import hf_config


def _model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


def _sparse(path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def test_oversized_config_json_names_the_file_and_the_limit(tmp_path):
    d = _model_dir(tmp_path)
    _sparse(d / "config.json", 1 << 34)
    with pytest.raises(ValueError) as e:
        hf_config.read_hf_config(str(d))
    msg = str(e.value)
    assert f"{d / 'config.json'} is larger than {64 * 2**20} bytes" in msg and "not valid JSON" not in msg, msg


def test_generation_config_json_is_bounded_before_transformers_reads_it(tmp_path):
    d = _model_dir(tmp_path)
    _sparse(d / "generation_config.json", 1 << 34)  # transformers' from_pretrained reads it whole
    with pytest.raises(ValueError, match=rf"{d / 'generation_config.json'} is larger than {64 * 2**20} bytes"):
        hf_config.read_hf_config(str(d))
    os.unlink(d / "generation_config.json")
    os.mkfifo(d / "generation_config.json")  # transformers would wait for a writer forever
    with pytest.raises(ValueError, match=r"generation_config.json is a FIFO, not a regular file"):
        hf_config.read_hf_config(str(d))
    os.unlink(d / "generation_config.json")
    (d / "generation_config.json").write_text("{}")
    assert hf_config.read_hf_config(str(d)) == {"model_type": "llama"}


def test_config_json_link_to_dev_zero_is_named(tmp_path):
    d = _model_dir(tmp_path)
    os.unlink(d / "config.json")
    os.symlink("/dev/zero", d / "config.json")
    with pytest.raises(ValueError, match=r"config.json is a character device, not a regular file"):
        hf_config.read_hf_config(str(d))
