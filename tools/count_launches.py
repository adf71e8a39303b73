#!/usr/bin/env python
"""Kernels per training step on the CUDA path, counted on this CPU (no GPU needed).

Counts, for each scenario and variant, the kernel launches of one forward + backward
step (after warm-up steps: steady state; gradients set to None first, so no accumulation
into existing ``.grad`` tensors is counted) with ``tp_fuse.kernels.launch_count``:

* ``block``: LayerNorm -> Linear -> GELU -> Linear (TE's basic-op Sequential for tp_fuse,
  ``nn.LayerNorm``/``nn.Linear``/``F.gelu`` for plain torch), bf16;
* ``gpt_layer``: one ``tp_fuse.layers.TransformerLayer`` built like the default GPT's
  (``configs/model/gpt.yaml``: 4 heads, FFN 4x hidden, LayerNorm, GELU, bias) at hidden 64
  instead of 128, bf16.

Variants: ``torch_bf16`` (the same layer in plain torch), ``tp_fuse_bf16``, ``fp8_delayed``,
``fp8_current``.

The process must follow the CUDA path (``TP_FUSE_SIMULATE_CUDA=1``,
``TRITON_INTERPRET=1``): when started without it, the script re-runs itself with that
environment. ``python tools/count_launches.py`` prints one table per count;
``--json PATH`` writes ``{"block": {"fp8_delayed": {"total": 21, "syncs": 0,
"by_kernel": {...}}, ...}, ...}`` (tests/test_launch_budget.py reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import tp_fuse as te
from tp_fuse.kernels.launch_count import LaunchCount, count_launches, simulated_cuda_env
from tp_fuse.layers import TransformerLayer
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling
from tp_fuse.strict import simulating_cuda

DTYPE = torch.bfloat16
# Shapes are the smallest multiples of 16 (cuBLASLt's FP8 rules, checked in simulation):
# the Triton kernels run in the interpreter, whose cost grows with the shape, while the
# counts do not (the JSON at 64/128 hidden was identical to this one's).
BLOCK_HIDDEN, BLOCK_TOKENS = 16, 16
GPT_HIDDEN, GPT_HEADS, GPT_SEQ, GPT_BATCH = 64, 4, 16, 2
RECIPES: dict[str, Optional[Callable[[], Any]]] = {
    "tp_fuse_bf16": None,
    "fp8_delayed": DelayedScaling,
    "fp8_current": Float8CurrentScaling,
}


def _block_torch() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.nn.Module]]:
    h = BLOCK_HIDDEN
    ln, fc1, fc2 = torch.nn.LayerNorm(h, dtype=DTYPE), torch.nn.Linear(h, 4 * h, dtype=DTYPE), \
        torch.nn.Linear(4 * h, h, dtype=DTYPE)
    return (lambda x: fc2(F.gelu(fc1(ln(x)), approximate="tanh"))), [ln, fc1, fc2]


def _block_tp_fuse() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.nn.Module]]:
    h = BLOCK_HIDDEN
    seq = te.ops.Sequential(te.ops.LayerNorm(h, dtype=DTYPE), te.ops.Linear(h, 4 * h, dtype=DTYPE), te.ops.GELU(),
                            te.ops.Linear(4 * h, h, dtype=DTYPE))
    return seq, [seq]


class _TorchGPTLayer(torch.nn.Module):
    """The default GPT's layer in plain torch (pre-norm, fused qkv, causal SDPA, GELU MLP)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(h, dtype=DTYPE), torch.nn.LayerNorm(h, dtype=DTYPE)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h, dtype=DTYPE), torch.nn.Linear(h, h, dtype=DTYPE)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h, dtype=DTYPE), torch.nn.Linear(4 * h, h, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, hd]
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def _gpt_layer_torch() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.nn.Module]]:
    layer = _TorchGPTLayer(GPT_HIDDEN, GPT_HEADS)
    return layer, [layer]


def _gpt_layer() -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.nn.Module]]:
    layer = TransformerLayer(GPT_HIDDEN, 4 * GPT_HIDDEN, GPT_HEADS, dtype=DTYPE)
    return layer, [layer]


def _step(build: Callable[[], tuple], shape: tuple[int, ...], recipe: Optional[Any]) -> Callable[[], None]:
    torch.manual_seed(0)
    fn, modules = build()
    x = torch.randn(*shape, dtype=DTYPE, requires_grad=True)
    dy = torch.randn(*shape, dtype=DTYPE)

    def step() -> None:
        for m in modules:
            for p in m.parameters():
                p.grad = None
        x.grad = None
        if recipe is None:
            y = fn(x)
        else:
            with te.autocast(recipe=recipe):
                y = fn(x)
        y.backward(dy)

    return step


def count_step(step: Callable[[], None], warmup: int = 1) -> LaunchCount:
    """The launches of ``step()`` in steady state (after ``warmup`` uncounted calls).

    One warm-up call is enough: only the first step differs (lazy buffers, the first
    amax); from the second on every step does the same work (the counts of the third step
    were identical to the second's for every scenario and variant)."""
    for _ in range(warmup):
        step()
    return count_launches(step)


def scenarios() -> dict[str, dict[str, Callable[[], None]]]:
    block_shape = (BLOCK_TOKENS, BLOCK_HIDDEN)
    gpt_shape = (GPT_SEQ, GPT_BATCH, GPT_HIDDEN)
    out: dict[str, dict[str, Callable[[], None]]] = {"block": {"torch_bf16": _step(_block_torch, block_shape, None)}}
    for name, recipe in RECIPES.items():
        out["block"][name] = _step(_block_tp_fuse, block_shape, recipe and recipe())
    out["gpt_layer"] = {"torch_bf16": _step(_gpt_layer_torch, gpt_shape, None)}
    for name, recipe in RECIPES.items():
        out["gpt_layer"][name] = _step(_gpt_layer, gpt_shape, recipe and recipe())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the counts as JSON to this path")
    args = parser.parse_args()
    if not simulating_cuda():
        # The simulation is decided at import (Triton's interpreter too): start again with it.
        env = {**os.environ, **simulated_cuda_env()}
        return subprocess.call([sys.executable, *sys.argv], env=env)
    results: dict[str, dict[str, Any]] = {}
    for scenario, variants in scenarios().items():
        results[scenario] = {}
        for variant, step in variants.items():
            count = count_step(step)
            results[scenario][variant] = {"total": count.total, "syncs": count.syncs,
                                          "by_kernel": dict(count.by_kernel.most_common())}
            print(f"== {scenario} / {variant}: {count.total} kernels, {count.syncs} syncs")
            print(count.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
