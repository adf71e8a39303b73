"""Fused vs unfused time of the Transformer Engine fusions added with GroupedLinear:
ForwardLinearScaleAdd (+ BackwardLinearScale), BackwardAddRMSNorm, and GroupedLinear vs one
BasicLinear per group. Prints median forward+backward times and their ratio, measured side
by side (interleaved) in one run.

    python examples/bench_te_fusions.py [--tokens 2048] [--hidden 1024] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tp_fuse as te
from tp_fuse.ops import (
    AddExtraInput,
    BasicLinear,
    ConstantScale,
    GroupedLinear,
    MakeExtraOutput,
    RMSNorm,
    Sequential,
)


def _time(fn, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _pair(fused, unfused, repeats: int) -> tuple[float, float]:
    """Interleave the two so that load changes hit both alike; return the medians."""
    a, b = [], []
    for _ in range(repeats):
        a += _time(fused, 1, warmup=0 if a else 2)
        b += _time(unfused, 1, warmup=0 if b else 2)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    n, h, g = args.tokens, args.hidden, args.groups
    x = torch.randn(n, h, requires_grad=True)
    dy = torch.randn(n, h)

    # [BasicLinear, ConstantScale, AddExtraInput(in_place=True)]: fused group vs one op per fuser.
    ops = [BasicLinear(h, h), ConstantScale(0.5), AddExtraInput(in_place=True)]
    seq = Sequential(*ops)
    residual = torch.randn(n, h)

    def scale_add_fused():
        seq(x, residual.clone()).backward(dy)

    def scale_add_unfused():
        ops[2](ops[1](ops[0](x)), residual.clone()).backward(dy)

    # [MakeExtraOutput, RMSNorm] backward.
    norm = RMSNorm(h)
    seq_norm = Sequential(MakeExtraOutput(), norm)
    plain_extra = MakeExtraOutput()

    def add_rmsnorm_fused():
        y, r = seq_norm(x)
        torch.autograd.backward([y, r], [dy, dy])

    def add_rmsnorm_unfused():
        r, y = plain_extra(x)
        torch.autograd.backward([norm(y), r], [dy, dy])

    # GroupedLinear vs a Python loop of BasicLinears (equal splits).
    grouped = GroupedLinear(g, h, h, bias=False)
    linears = [BasicLinear(h, h) for _ in range(g)]
    sizes = torch.full((g,), n // g)

    def grouped_fwd_bwd():
        grouped(x, sizes).backward(dy)

    def loop_fwd_bwd():
        torch.cat([lin(xi) for lin, xi in zip(linears, x.split(n // g))]).backward(dy)

    rows = [
        ("ForwardLinearScaleAdd+BackwardLinearScale", scale_add_fused, scale_add_unfused),
        ("BackwardAddRMSNorm", add_rmsnorm_fused, add_rmsnorm_unfused),
        (f"GroupedLinear({g}) vs {g} BasicLinear", grouped_fwd_bwd, loop_fwd_bwd),
    ]
    print(f"tokens={n} hidden={h} repeats={args.repeats} threads={torch.get_num_threads()} (fwd+bwd, ms)")
    for name, fused, unfused in rows:
        for recipe in (None, te.recipe.Float8CurrentScaling()):
            def run(f, recipe=recipe):
                def go():
                    with te.autocast(enabled=recipe is not None, recipe=recipe):
                        f()
                return go

            tf, tu = _pair(run(fused), run(unfused), args.repeats)
            tag = "fp8-current" if recipe is not None else "fp32"
            print(f"{name:45s} {tag:12s} fused {tf * 1e3:8.2f}  unfused {tu * 1e3:8.2f}  fused/unfused {tf / tu:.3f}")


if __name__ == "__main__":
    main()
