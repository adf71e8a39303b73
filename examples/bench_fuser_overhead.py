"""Fuser overhead: tp_fuse.ops.Sequential vs the same math in plain torch.nn.

Block: LayerNorm -> Linear -> GELU -> Linear, hidden 256, 512 tokens, fp32,
CPU. Both models share parameters; forward+backward is timed alternately
(A, B, A, B, ...) so machine noise hits both sides alike, and the ratio of
medians is printed.

    python examples/bench_fuser_overhead.py [--hidden 256] [--tokens 512] [--repeats 200]
"""

import argparse
import statistics
import time

import torch

import tp_fuse as te


class TorchBlock(torch.nn.Module):
    def __init__(self, ops: te.ops.Sequential) -> None:
        super().__init__()
        ln, fc1, _, fc2 = list(ops)
        self.ln, self.fc1, self.fc2 = ln, fc1, fc2  # shared parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, x.shape[-1:], self.ln.weight, self.ln.bias, self.ln.eps)
        h = torch.nn.functional.linear(h, self.fc1.weight, self.fc1.bias)
        h = torch.nn.functional.gelu(h, approximate="tanh")
        return torch.nn.functional.linear(h, self.fc2.weight, self.fc2.bias)


def step_time(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> float:
    start = time.perf_counter()
    y = model(x)
    y.backward(dy)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    h = args.hidden
    ops = te.ops.Sequential(
        te.ops.LayerNorm(h), te.ops.Linear(h, 4 * h), te.ops.GELU(), te.ops.Linear(4 * h, h)
    )
    ref = TorchBlock(ops)
    x = torch.randn(args.tokens, h, requires_grad=True)
    dy = torch.randn(args.tokens, h)
    torch.testing.assert_close(ops(x), ref(x), rtol=1e-5, atol=1e-5)

    times = {"tp_fuse": [], "torch": []}
    for i in range(args.warmup + args.repeats):
        for name, model in (("tp_fuse", ops), ("torch", ref)):
            t = step_time(model, x, dy)
            if i >= args.warmup:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads={torch.get_num_threads()} hidden={h} tokens={args.tokens} repeats={args.repeats}")
    print(f"{'model':10s} {'median fwd+bwd (ms)':>20s}")
    for k, v in med.items():
        print(f"{k:10s} {v * 1e3:20.3f}")
    print(f"fuser overhead (tp_fuse / torch): {med['tp_fuse'] / med['torch']:.3f}x  (issue 20 target <= 1.05x)")
    print(te.explain(ops))


if __name__ == "__main__":
    main()
