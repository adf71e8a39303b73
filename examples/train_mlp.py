"""Train a small residual MLP stack with tp_fuse ops, in FP8 or high precision.

A teacher network generates targets; the student (LayerNorm -> Linear -> GELU
-> Linear + residual, repeated) learns them with AdamW. The loss must fall.

    python examples/train_mlp.py [--steps 200] [--fp8 delayed|current|none]
"""

import argparse

import torch

import tp_fuse as te
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling


class Block(torch.nn.Module):
    """Pre-norm MLP block: x + fc2(gelu(fc1(layernorm(x))))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = te.ops.Sequential(
            te.ops.MakeExtraOutput(),  # the residual branch leaves here
            te.ops.LayerNorm(hidden),
            te.ops.Linear(hidden, 4 * hidden),
            te.ops.GELU(),
        )
        self.fc2 = te.ops.Sequential(
            te.ops.Linear(4 * hidden, hidden),
            te.ops.AddExtraInput(),  # ... and comes back here
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, residual = self.fc1(x)
        return self.fc2(h, residual)


class Student(torch.nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(hidden) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--fp8", choices=["none", "delayed", "current"], default="delayed")
    args = parser.parse_args()

    torch.manual_seed(0)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, args.hidden)
    ).requires_grad_(False)
    model = Student(args.hidden, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    recipe = {"delayed": DelayedScaling(amax_history_len=16), "current": Float8CurrentScaling()}.get(args.fp8)

    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.hidden)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y, teacher(x))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1 or step % 20 == 0:
            print(f"step {step:4d}  loss {loss.item():.5f}")
    print(te.explain(model.blocks[0]))


if __name__ == "__main__":
    main()
