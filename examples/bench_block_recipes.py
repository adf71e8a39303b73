"""Block-scaled recipes on CPU: wire bytes per element and the emulation's cost.

1. **Wire bytes per element** of the overlapped all-gather (the packed tensor the ring moves:
   FP8 bytes plus each row's scales), for the activations of the default GPT (K = hidden =
   128) and of its fc2 input (K = 4 * hidden = 512). ``tests/test_block_recipes_tp.py``
   checks that the ring sends exactly these bytes.
2. **Cost of a linear layer step** (fprop + dgrad + wgrad, quantization included) under each
   recipe, as a ratio to per-tensor current scaling (``Float8CurrentScaling``, whose GEMMs run
   through ``torch._scaled_mm``), measured side by side in one run: median of ``--repeats``
   after warm-up. Block recipes run the exact emulation (per-block dequantization + fp32 GEMM)
   on CPU; row-wise runs ``torch._scaled_mm`` with row-wise scales. NVFP4 is timed with TE's
   defaults (RHT on the wgrad operands, stochastic rounding of gradients, 16x16 weight blocks)
   and without RHT and stochastic rounding.

    nice python examples/bench_block_recipes.py [--tokens 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tp_fuse
from tp_fuse import ops
from tp_fuse.quantization.block import wire as block_wire
from tp_fuse.quantization.op_quantizers import make_quantizer
from tp_fuse.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = {
    "fp32 (no FP8)": None,
    "per-tensor current": Float8CurrentScaling(fp8_format=Format.E4M3),
    "per-tensor delayed": DelayedScaling(fp8_format=Format.E4M3),
    "blockwise": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "rowwise": Float8RowwiseScaling(),
    "nvfp4": NVFP4BlockScaling(),
    "nvfp4 (no RHT, no SR)": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
}


def wire_table(rows: int) -> None:
    print("wire bytes per element, overlapped all-gather of an activation [rows, K]")
    print(f"{'recipe':<22} {'K=128':>8} {'K=512':>8}")
    print(f"{'fp32':<22} {4.0:>8.4f} {4.0:>8.4f}")
    print(f"{'bf16':<22} {2.0:>8.4f} {2.0:>8.4f}")
    print(f"{'per-tensor FP8':<22} {1.0:>8.4f} {1.0:>8.4f}")
    for name in ("blockwise", "mxfp8", "rowwise", "nvfp4"):
        q = make_quantizer(RECIPES[name], "input")
        cells = []
        for k in (128, 512):
            t = q.quantize(torch.randn(rows, k))
            cells.append(block_wire.rowwise_wire(t).numel() / t.numel())
        print(f"{name:<22} {cells[0]:>8.4f} {cells[1]:>8.4f}")


def time_step(recipe, tokens: int, fin: int, fout: int, repeats: int) -> float:
    torch.manual_seed(0)
    lin = ops.BasicLinear(fin, fout)
    x = torch.randn(tokens, fin, requires_grad=True)
    dy = torch.randn(tokens, fout)

    def step() -> None:
        with tp_fuse.autocast(recipe=recipe, enabled=recipe is not None):
            y = lin(x)
        y.backward(dy)
        x.grad = None
        lin.weight.grad = None

    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    wire_table(args.tokens)
    print()
    shapes = [(128, 512), (512, 128)]  # the default GPT's fc1 and fc2
    print(f"linear step (fwd+dgrad+wgrad), {args.tokens} tokens, median of {args.repeats}, 1 thread; "
          "ratio to per-tensor current scaling")
    print(f"{'recipe':<22} " + " ".join(f"{f'{a}->{b} ms':>12} {'ratio':>6}" for a, b in shapes))
    base = {s: time_step(RECIPES["per-tensor current"], args.tokens, *s, args.repeats) for s in shapes}
    for name, recipe in RECIPES.items():
        cells = []
        for s in shapes:
            t = base[s] if name == "per-tensor current" else time_step(recipe, args.tokens, *s, args.repeats)
            cells.append(f"{t * 1e3:>12.2f} {t / base[s]:>6.2f}")
        print(f"{name:<22} " + " ".join(cells))


if __name__ == "__main__":
    main()
