"""``examples/bench_gpu.py --smoke --json``: every (shape, variant) row runs at tiny sizes on
CPU, and the JSON has the schema that ``make gpu-check`` and docs/gpu.md read (issue 35,
point 5). The script's ``main`` runs in this process (one interpreter start less than the
subprocess it was: ~5 CPU-s), with one intra-op thread as that subprocess had
(``OMP_NUM_THREADS=1``); the numbers themselves are not checked, only that they are there
and that the plain-torch references compute what tp_fuse does."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ("host_bound", "gemm_bound", "llama_layer", "gpt_default", "gpt_1b")
VARIANTS = ("torch_bf16", "tp_fuse_bf16", "fp8_delayed", "fp8_current", "fp8_rowwise", "fp8_blockwise")
NUMBERS = ("wall_us", "host_us", "tflops", "ratio_vs_torch_bf16", "parity")
INFO = ("device", "torch", "date", "dtype")


def _bench_gpu():
    """examples/bench_gpu.py as a module (it imports its examples/ neighbours by name)."""
    examples = os.path.join(REPO, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    return importlib.import_module("bench_gpu")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[str, list[dict]]:
    path = tmp_path_factory.mktemp("bench_gpu") / "rows.json"
    threads = torch.get_num_threads()
    out = io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            rc = _bench_gpu().main(["--smoke", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, out.getvalue()[-3000:]
    with open(path) as f:
        return out.getvalue(), json.load(f)


def test_every_row_is_present_and_ran(smoke):
    stdout, rows = smoke
    assert [(r["shape"], r["variant"]) for r in rows] == [(s, v) for s in SHAPES for v in VARIANTS]
    for r in rows:  # on CPU every recipe runs: nothing may be skipped
        assert r["status"] == "ok", r
    assert "| shape | variant | wall us |" in stdout


def test_row_schema(smoke):
    _, rows = smoke
    for r in rows:
        for key in NUMBERS:
            assert isinstance(r[key], float) and r[key] == r[key], (key, r)  # a number, not NaN
        for key in ("wall_us", "host_us", "tflops", "ratio_vs_torch_bf16"):
            assert r[key] > 0, (key, r)
        assert isinstance(r["kernels"], int) and r["kernels"] > 0, r
        assert r["kernels"] == r["kernels_counted"]  # on CPU the count is the measurement
        assert all(isinstance(r[k], str) and r[k] for k in INFO), r
        assert r["smoke"] is True and r["dtype"] == "float32"
        assert r["parity_metric"] in ("output_rel_l2_vs_torch_bf16", "final_loss_rel_diff_vs_torch_bf16")
    for r in rows:
        if r["variant"] == "torch_bf16":
            assert r["ratio_vs_torch_bf16"] == 1.0 and r["parity"] == 0.0


def test_references_compute_what_tp_fuse_computes(smoke):
    """tp_fuse without a recipe matches the plain-torch reference to float32 rounding (the
    references copy tp_fuse's initial weights); FP8 stays within FP8's error."""
    _, rows = smoke
    for r in rows:
        if r["variant"] == "tp_fuse_bf16":
            assert abs(r["parity"]) < 1e-5, r
        elif r["variant"].startswith("fp8_"):
            assert abs(r["parity"]) < 0.1, r
