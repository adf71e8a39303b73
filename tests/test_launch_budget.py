"""Kernel launches per training step on the CUDA path, counted on CPU and pinned.

On a GPU host every launched kernel costs tens of microseconds of Python and launch, so
until a step is captured its launch count is its time. The counts are deterministic:
``tools/count_launches.py`` runs each step once in a process that follows the CUDA path
(``TP_FUSE_SIMULATE_CUDA=1``: Triton kernels in the interpreter, CUDA's ``_scaled_mm``;
``tp_fuse.kernels.launch_count``), after warm-up steps, gradients reset (accumulation
into existing ``.grad`` tensors is not counted). One subprocess serves the whole module.

Budgets (the FP8 speed issue; Transformer Engine's pipeline needs about 17 for the block):

* bf16 at most plain torch's count + 2;
* FP8 delayed at most 24 per LayerNorm -> Linear -> GELU -> Linear block: one kernel per
  FP8 tensor, one scale update per direction;
* FP8 current at most 30 per block: one amax reduction plus one cast per FP8 tensor.

A default-GPT layer holds two such blocks (attention: norm, qkv, core attention, proj;
MLP: norm, fc1, GELU, fc2), so its FP8 budgets are plain torch's count plus twice a
block's FP8 allowance over torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tp_fuse.kernels.launch_count import simulated_cuda_env

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_FP8_BUDGET = {"fp8_delayed": 24, "fp8_current": 30}
BF16_OVER_TORCH = 2


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("launches") / "counts.json"
    env = {**os.environ, **simulated_cuda_env()}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "count_launches.py"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _total(counts: dict, scenario: str, variant: str) -> int:
    entry = counts[scenario][variant]
    assert entry["syncs"] == 0, f"{scenario}/{variant}: a device-to-host sync in the step: {entry['by_kernel']}"
    return entry["total"]


def test_launch_budget_block_bf16(counts):
    torch_count = _total(counts, "block", "torch_bf16")
    ours = _total(counts, "block", "tp_fuse_bf16")
    assert ours <= torch_count + BF16_OVER_TORCH, counts["block"]["tp_fuse_bf16"]["by_kernel"]


@pytest.mark.parametrize("variant", ["fp8_delayed", "fp8_current"])
def test_launch_budget_block_fp8(counts, variant):
    assert _total(counts, "block", variant) <= BLOCK_FP8_BUDGET[variant], counts["block"][variant]["by_kernel"]


def test_launch_budget_block_fp8_casts_are_single_kernels(counts):
    """The fusions the budget rests on: every delayed cast is one Triton launch with no
    fill, maximum or reciprocal around it, the scale update one launch per direction,
    and current scaling computes its scale inside the cast."""
    delayed = counts["block"]["fp8_delayed"]["by_kernel"]
    for op in ("aten.zeros", "aten.maximum", "aten.reciprocal", "aten.roll", "aten.where"):
        assert op not in delayed, delayed
    assert delayed["triton._delayed_update_kernel"] == 2
    current = counts["block"]["fp8_current"]["by_kernel"]
    for op in ("aten.reciprocal", "aten.where", "aten.clamp", "aten.div", "aten.add"):
        assert op not in current, current


def test_launch_budget_gpt_layer_bf16(counts):
    torch_count = _total(counts, "gpt_layer", "torch_bf16")
    ours = _total(counts, "gpt_layer", "tp_fuse_bf16")
    assert ours <= torch_count + BF16_OVER_TORCH, counts["gpt_layer"]["tp_fuse_bf16"]["by_kernel"]


@pytest.mark.parametrize("variant", ["fp8_delayed", "fp8_current"])
def test_launch_budget_gpt_layer_fp8(counts, variant):
    block_torch = _total(counts, "block", "torch_bf16")
    allowance = BLOCK_FP8_BUDGET[variant] - block_torch
    budget = _total(counts, "gpt_layer", "torch_bf16") + 2 * allowance
    assert _total(counts, "gpt_layer", variant) <= budget, counts["gpt_layer"][variant]["by_kernel"]
