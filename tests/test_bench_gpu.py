"""``examples/bench_gpu.py --smoke --json``: every (shape, variant) row runs at tiny sizes on
CPU, and the JSON has the schema that ``make gpu-check`` and docs/gpu.md read (issue 35,
point 5). One subprocess (about 15 s on one core); the numbers themselves are not checked,
only that they are there and that the plain-torch references compute what tp_fuse does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ("host_bound", "gemm_bound", "llama_layer", "gpt_default", "gpt_1b")
VARIANTS = ("torch_bf16", "tp_fuse_bf16", "fp8_delayed", "fp8_current", "fp8_rowwise", "fp8_blockwise")
NUMBERS = ("wall_us", "host_us", "tflops", "ratio_vs_torch_bf16", "parity")
INFO = ("device", "torch", "date", "dtype")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    path = tmp_path_factory.mktemp("bench_gpu") / "rows.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "bench_gpu.py"), "--smoke", "--json",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(path) as f:
        return proc, json.load(f)


def test_every_row_is_present_and_ran(smoke):
    proc, rows = smoke
    assert [(r["shape"], r["variant"]) for r in rows] == [(s, v) for s in SHAPES for v in VARIANTS]
    for r in rows:  # on CPU every recipe runs: nothing may be skipped
        assert r["status"] == "ok", r
    assert "| shape | variant | wall us |" in proc.stdout


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
