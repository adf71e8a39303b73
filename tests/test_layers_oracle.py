"""PyTorch's own tensor parallelism as an independent oracle (gloo, CPU, 2 ranks).

The same full weights go into (a) our sharded ``LayerNormMLP`` / ``MultiheadAttention``
and (b) plain ``nn.Linear`` modules parallelized with
``torch.distributed.tensor.parallel`` (``ColwiseParallel`` / ``RowwiseParallel``, plus
``SequenceParallel`` for the norm with sequence parallelism) on a ``DeviceMesh``.
Outputs, input gradients and (full) weight gradients must agree. Both run in float64 so
that the comparison is tight (1e-9): in float32 the two SDPA backward paths round
differently (up to ~3e-5 relative on the GQA query-weight gradient).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

S, B, H = 8, 2, 32
DT = torch.float64
TOL = 1e-9
_CASES: dict[str, Callable[[int, int], Any]] = {}


def case(fn: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    _CASES[fn.__name__] = fn
    return fn


class TorchMLP(nn.Module):
    """Reference MLP from plain torch modules: ``fc2(act(fc1(norm(x))))``."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.swiglu = swiglu
        if swiglu:
            self.gate, self.up = nn.Linear(hidden, ffn), nn.Linear(hidden, ffn)
        else:
            self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = F.silu(self.gate(h)) * self.up(h) if self.swiglu else F.gelu(self.fc1(h), approximate="tanh")
        return self.fc2(h)


class TorchAttention(nn.Module):
    """Reference causal GQA attention with separate q/k/v projections (local heads from shapes)."""

    def __init__(self, hidden: int, heads: int, groups: int) -> None:
        super().__init__()
        self.d = hidden // heads
        self.norm = nn.LayerNorm(hidden)
        self.wq = nn.Linear(hidden, heads * self.d)
        self.wk = nn.Linear(hidden, groups * self.d)
        self.wv = nn.Linear(hidden, groups * self.d)
        self.wo = nn.Linear(heads * self.d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        s, b = q.shape[:2]
        # Local head counts follow from the (sharded) projection widths.
        q, k, v = (t.reshape(s, b, t.shape[-1] // self.d, self.d).permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


def _parallelize(module: nn.Module, mesh, column: list[str], row: list[str], sp: bool) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    plan: dict[str, Any] = {}
    for name in column:
        plan[name] = ColwiseParallel(input_layouts=Shard(0)) if sp else ColwiseParallel()
    for name in row:
        plan[name] = RowwiseParallel(output_layouts=Shard(0)) if sp else RowwiseParallel()
    if sp:
        plan["norm"] = SequenceParallel(sequence_dim=0)  # activations are [s, b, h]
    parallelize_module(module, mesh, plan)


def _full_grad(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def _inputs(rank: int, world: int, sp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(S, B, H, generator=gen, dtype=DT)
    dy = torch.randn(S, B, H, generator=gen, dtype=DT)  # upstream gradient
    if sp:
        x, dy = x.chunk(world)[rank], dy.chunk(world)[rank]
    return x, dy, gen


def _run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@case
def mlp_matches_dtensor_tp(rank: int, world: int) -> dict[str, dict[str, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from tp_fuse.layers import LayerNormMLP, full_grads, full_state_dict

    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    out = {}
    for activation in ("gelu", "swiglu"):
        for sp in (False, True):
            ours = LayerNormMLP(H, 64, activation=activation, tp_group=group, sequence_parallel=sp, seed=1, dtype=DT)
            full = full_state_dict(ours, group)
            ref = TorchMLP(H, 64, activation == "swiglu").to(DT)
            with torch.no_grad():
                ref.norm.weight.copy_(full["fc1.norm.weight"] + 0.1)  # a non-trivial gain...
                ref.norm.bias.copy_(full["fc1.norm.bias"] - 0.1)  # ...and shift, in both models
                ours.fc1.norm.weight.copy_(ref.norm.weight)
                ours.fc1.norm.bias.copy_(ref.norm.bias)
                w1, b1 = full["fc1.linear.weight"], full["fc1.bias.bias"] + 0.01
                ours.fc1.bias.bias.add_(0.01)
                if activation == "swiglu":
                    (wg, wu), (bg, bu) = w1.chunk(2), b1.chunk(2)  # TP=1 layout [gate; up]
                    ref.gate.weight.copy_(wg), ref.gate.bias.copy_(bg)
                    ref.up.weight.copy_(wu), ref.up.bias.copy_(bu)
                else:
                    ref.fc1.weight.copy_(w1), ref.fc1.bias.copy_(b1)
                ref.fc2.weight.copy_(full["fc2.linear.weight"])
                ref.fc2.bias.copy_(full["fc2.bias.bias"] + 0.02)
                ours.fc2.bias.bias.add_(0.02)
            _parallelize(ref, mesh, ["gate", "up"] if activation == "swiglu" else ["fc1"], ["fc2"], sp)
            x, dy, _ = _inputs(rank, world, sp)
            y_ours, dx_ours = _run(ours, x, dy)
            y_ref, dx_ref = _run(ref, x, dy)
            g = full_grads(ours, group)
            ref_g1 = (torch.cat([_full_grad(ref.gate.weight), _full_grad(ref.up.weight)])
                      if activation == "swiglu" else _full_grad(ref.fc1.weight))
            out[f"{activation}/sp={sp}"] = {
                "y": _rel(y_ours, y_ref),
                "dx": _rel(dx_ours, dx_ref),
                "dW1": _rel(g["fc1.linear.weight"], ref_g1),
                "dW2": _rel(g["fc2.linear.weight"], _full_grad(ref.fc2.weight)),
                "db2": _rel(g["fc2.bias.bias"], _full_grad(ref.fc2.bias)),
                "dnorm": _rel(g["fc1.norm.weight"], _full_grad(ref.norm.weight)),
            }
    return out


@case
def attention_matches_dtensor_tp(rank: int, world: int) -> dict[str, dict[str, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from tp_fuse.layers import MultiheadAttention, full_grads, full_state_dict

    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    heads, out = 4, {}
    for groups in (4, 2):
        for sp in (False, True):
            ours = MultiheadAttention(H, heads, num_query_groups=groups, tp_group=group, sequence_parallel=sp, seed=2, dtype=DT)
            with torch.no_grad():
                # Non-trivial biases; the reference takes the gathered full tensors.
                ours.qkv.bias.copy_(torch.randn(ours.qkv.bias.shape, generator=torch.Generator().manual_seed(3)))
                ours.proj.bias.bias.fill_(0.05)
            full = full_state_dict(ours, group)
            d, qpg = H // heads, heads // groups
            wqkv = full["qkv.ops.linear.weight"].view(groups, qpg + 2, d, H)  # Megatron's grouped layout
            bqkv = full["qkv.ops.bias.bias"].view(groups, qpg + 2, d)
            ref = TorchAttention(H, heads, groups).to(DT)
            with torch.no_grad():
                ref.norm.weight.copy_(full["qkv.ops.norm.weight"])
                ref.norm.bias.copy_(full["qkv.ops.norm.bias"])
                ref.wq.weight.copy_(wqkv[:, :qpg].reshape(-1, H)), ref.wq.bias.copy_(bqkv[:, :qpg].reshape(-1))
                ref.wk.weight.copy_(wqkv[:, qpg].reshape(-1, H)), ref.wk.bias.copy_(bqkv[:, qpg].reshape(-1))
                ref.wv.weight.copy_(wqkv[:, qpg + 1].reshape(-1, H)), ref.wv.bias.copy_(bqkv[:, qpg + 1].reshape(-1))
                ref.wo.weight.copy_(full["proj.linear.weight"]), ref.wo.bias.copy_(full["proj.bias.bias"])
            _parallelize(ref, mesh, ["wq", "wk", "wv"], ["wo"], sp)
            x, dy, _ = _inputs(rank, world, sp)
            y_ours, dx_ours = _run(ours, x, dy)
            y_ref, dx_ref = _run(ref, x, dy)
            g = full_grads(ours, group)
            dqkv = g["qkv.ops.linear.weight"].view(groups, qpg + 2, d, H)
            out[f"groups={groups}/sp={sp}"] = {
                "y": _rel(y_ours, y_ref),
                "dx": _rel(dx_ours, dx_ref),
                "dWq": _rel(dqkv[:, :qpg].reshape(-1, H), _full_grad(ref.wq.weight)),
                "dWk": _rel(dqkv[:, qpg].reshape(-1, H), _full_grad(ref.wk.weight)),
                "dWv": _rel(dqkv[:, qpg + 1].reshape(-1, H), _full_grad(ref.wv.weight)),
                "dWo": _rel(g["proj.linear.weight"], _full_grad(ref.wo.weight)),
                "dnorm": _rel(g["qkv.ops.norm.weight"], _full_grad(ref.norm.weight)),
            }
    return out


def _run_all_cases(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    results: dict[str, tuple[str, Any]] = {}
    for name, fn in _CASES.items():
        try:
            results[name] = ("ok", fn(rank, world))
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = ("fail", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(2, _run_all_cases, timeout=180)


@pytest.mark.parametrize("name", ["mlp_matches_dtensor_tp", "attention_matches_dtensor_tp"])
def test_matches_pytorch_tensor_parallel(results, name: str) -> None:
    for rank, res in enumerate(results):
        status, value = res[name]
        if status != "ok":
            pytest.fail(f"case {name} failed on rank {rank}:\n{value}", pytrace=False)
        assert len(value) == 4
        for key, metrics in value.items():
            for what, rel in metrics.items():
                assert rel <= TOL, f"rank {rank} {key}: {what} differs from DTensor TP by {rel:.3g}"
