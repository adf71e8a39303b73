"""The floor of an eager FP8 training step on CPU: the fewest ATen ops, no framework.

``examples/bench_cpu_speed.py`` times tp_fuse's FP8 step at tiny shapes (LayerNorm ->
Linear -> GELU -> Linear, hidden 64, 16 tokens) against plain torch. This script asks
what ANY eager implementation of the same FP8 delayed-scaling step must cost: the step
written out by hand as the fewest ATen calls that compute it -- per FP8 cast a scale
multiply, a saturating clamp, the cast, the amax (abs + amax) folded into the history slot
and the reciprocal scale; per GEMM a decode of each operand, the fp32 matmul and the two
scale multiplies; one batched scale update per direction -- with no autograd function,
no tensor subclass, no quantizer objects and no checks. It is not a usable training step
(no autograd, no process groups, nothing validated); it is a lower bound, timed side by
side with plain torch's fp32 step (autograd included) in one process.

    python examples/bench_fp8_floor.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from bench_cpu_speed import alternate, aten_ops, machine  # examples/: the same machine line, timing and op count

HIDDEN, TOKENS, HISTORY = 64, 16, 16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


class FloorStep:
    """The hand-written FP8 delayed-scaling step (forward, backward, both scale updates)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(TOKENS, HIDDEN, generator=g)
        self.dy = torch.randn(TOKENS, HIDDEN, generator=g)
        self.ln_w, self.ln_b = torch.ones(HIDDEN), torch.zeros(HIDDEN)
        self.w1, self.b1 = torch.randn(4 * HIDDEN, HIDDEN, generator=g) * 0.1, torch.zeros(4 * HIDDEN)
        self.w2, self.b2 = torch.randn(HIDDEN, 4 * HIDDEN, generator=g) * 0.1, torch.zeros(HIDDEN)
        # Six casts (x, W1, h, W2 forward; dy, dh backward), one history row each.
        self.history = torch.zeros(6, HISTORY)
        self.slot = self.history[:, 0]
        self.scale = torch.ones(6)
        self.fp8_max = torch.tensor([E4M3_MAX] * 4 + [E5M2_MAX] * 2, dtype=torch.float64)

    def cast(self, v: torch.Tensor, i: int, dtype: torch.dtype, fp8_max: float):
        data = (v * self.scale[i]).clamp_(-fp8_max, fp8_max).to(dtype)
        torch.maximum(self.slot[i], v.abs().amax(), out=self.slot[i])
        return data, torch.reciprocal(self.scale[i])

    def update(self) -> None:
        bad = ~(self.slot.abs() < float("inf"))
        self.slot.masked_fill_(bad, 0.0)
        amax = self.history.amax(dim=1).to(torch.float64)
        new = self.fp8_max / amax
        self.scale.copy_(torch.where(amax > 0, new.clamp_(max=3.4e38), self.scale))
        self.history.copy_(torch.roll(self.history, -1, 1))
        self.slot.zero_()

    @staticmethod
    def gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        out = torch.mm(a, b)
        out.mul_(sa)
        return out.mul_(sb)

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        h0, mean, rstd = torch.native_layer_norm(self.x, (HIDDEN,), self.ln_w, self.ln_b, 1e-5)
        xq, sx = self.cast(h0, 0, E4M3, E4M3_MAX)
        w1q, sw1 = self.cast(self.w1, 1, E4M3, E4M3_MAX)
        xd, w1d = xq.float(), w1q.float()
        pre = self.gemm(xd, sx, w1d.t(), sw1).add_(self.b1)
        act = torch.ops.aten.gelu(pre, approximate="tanh")
        aq, sa = self.cast(act, 2, E4M3, E4M3_MAX)
        w2q, sw2 = self.cast(self.w2, 3, E4M3, E4M3_MAX)
        ad, w2d = aq.float(), w2q.float()
        self.gemm(ad, sa, w2d.t(), sw2).add_(self.b2)
        self.update()
        dyq, sdy = self.cast(self.dy, 4, E5M2, E5M2_MAX)
        dyd = dyq.float()
        dact = self.gemm(dyd, sdy, w2d, sw2)
        self.gemm(dyd.t(), sdy, ad, sa)  # dW2
        self.dy.sum(0)  # db2
        dpre = torch.ops.aten.gelu_backward(dact, pre, approximate="tanh")
        dpre.sum(0)  # db1
        dq, sd = self.cast(dpre, 5, E5M2, E5M2_MAX)
        dd = dq.float()
        dh0 = self.gemm(dd, sd, w1d, sw1)
        self.gemm(dd.t(), sd, xd, sx)  # dW1
        dx, _, _ = torch.ops.aten.native_layer_norm_backward(
            dh0, self.x, (HIDDEN,), mean, rstd, self.ln_w, self.ln_b, [True, True, True]
        )
        self.update()
        return dx


class TorchStep:
    """Plain torch's fp32 step of the same block (autograd), bench_cpu_speed's reference."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.fc1, self.fc2 = torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)
        self.x = torch.randn(TOKENS, HIDDEN, generator=g, requires_grad=True)
        self.dy = torch.randn(TOKENS, HIDDEN, generator=g)

    def __call__(self) -> None:
        h = torch.nn.functional.gelu(self.fc1(self.ln(self.x)), approximate="tanh")
        self.fc2(h).backward(self.dy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(machine())
    variants = {"plain torch fp32": TorchStep(), "FP8 delayed floor": FloorStep()}
    times = alternate(variants, args.steps, warmup=20)
    base = statistics.median(times["plain torch fp32"])
    print(f"{'variant':<20} {'median us':>10} {'/ torch':>8} {'aten ops':>9}")
    for name, step in variants.items():
        med = statistics.median(times[name])
        print(f"{name:<20} {med * 1e6:10.1f} {med / base:7.2f}x {aten_ops(step):9d}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
