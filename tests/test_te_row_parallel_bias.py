"""Row-parallel ``ops.Linear(..., tensor_parallel_mode="row", bias=True)`` on 2 gloo ranks
computes what Transformer Engine computes: every rank adds its own bias BEFORE the
reduction, ``y = sum_r (x_r W_r^T + b_r)``, and every rank's bias gradient is the sum of
``dy`` over the whole sequence (also under sequence parallelism).

Checked against a float64 reference of that formula in fp32 and under FP8 (delayed and
current scaling), with the overlap fusions on (asserting that the bias went into the
fused GEMM) and off. The data are on the grid that E4M3 and E5M2 both represent exactly
(multiples of 0.5 up to 2) and FP8 scales are powers of two, so the FP8 GEMMs are exact
and the tolerance can be tight: the old convention (one bias after the reduction) misses
the other rank's bias by >= 0.5 and, under SP, half of the bias gradient.

``row_parallel_bias="after_reduction"`` keeps Megatron-LM's convention (what
``tp_fuse.layers`` builds): ``y = sum_r x_r W_r^T + b``.

All cases run in one 2-rank start (module fixture).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_fuse as te
from dist_utils import case_values, run_cases, run_distributed
from tp_fuse import ops
from tp_fuse.overlap.config import OverlapConfig, TPOverlap
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

SEQ, IN, OUT = 16, 32, 16  # global sizes; each rank holds IN/2 input features
TOL = dict(rtol=1e-5, atol=1e-5)
PRECISIONS = ("fp32", "delayed", "current")


def _grid(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """float64 values in {-2, -1.5, ..., 2}: exact in E4M3 and E5M2."""
    return (torch.randint(-4, 5, shape, generator=gen) * 0.5).to(torch.float64)


def _data(world: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(23)
    return {
        "x": _grid(gen, SEQ, IN),
        "w": _grid(gen, OUT, IN),
        "b": _grid(gen, world, OUT) + 0.5 * (torch.arange(world, dtype=torch.float64)[:, None] + 1),
        "dy": _grid(gen, SEQ, OUT),
    }


def _recipe(precision: str):
    if precision == "delayed":
        return DelayedScaling()  # first step: scale 1
    if precision == "current":
        return Float8CurrentScaling(power_2_scale=True)
    return None


def _run_linear(rank: int, world: int, *, sp: bool, precision: str, fused: bool, bias_mode: str) -> dict:
    group = dist.group.WORLD
    d = _data(world)
    ks = slice(rank * IN // world, (rank + 1) * IN // world)
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    overlap = TPOverlap() if fused else TPOverlap(OverlapConfig(enabled=False))
    lin = ops.Linear(IN, OUT, bias=True, tensor_parallel_mode="row", tensor_parallel_group=group,
                     sequence_parallel=sp, userbuffers_options={"comm_name": "fc2", "overlap": overlap},
                     row_parallel_bias=bias_mode)
    with torch.no_grad():
        lin.weight.copy_(d["w"][:, ks])
        lin.bias.copy_(d["b"][rank])
    seq = ops.Sequential(lin)
    x = d["x"][:, ks].float().requires_grad_()
    dy = (d["dy"][rows] if sp else d["dy"]).float()
    recipe = _recipe(precision)
    with te.autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group):
        y = seq(x)
    y.backward(dy)
    fuser = seq.fusers()[0]
    return {
        "y": y.detach().double(), "dx": x.grad.double(), "dw": lin.weight.grad.double(),
        "db": lin.bias.grad.double(),
        "basic": [type(o).__name__ for o in lin.basic_op_list],
        "fwd": [(type(op).__name__, [type(fuser.basic_ops[i]).__name__ for i in idxs])
                for op, idxs in fuser.forward_ops],
        "bwd": [(type(op).__name__, [type(fuser.basic_ops[i]).__name__ for i in idxs])
                for op, idxs in fuser.backward_ops],
    }


def _reference(rank: int, world: int, *, sp: bool, bias_mode: str) -> dict[str, torch.Tensor]:
    """float64: TE's ``y = sum_r (x_r W_r^T + b_r)`` (or Megatron's ``+ b`` once)."""
    d = _data(world)
    x, w, b, dy = (d[k].clone().requires_grad_(k != "dy") for k in ("x", "w", "b", "dy"))
    bias = b.sum(0) if bias_mode == "per_rank" else b[rank]
    y = x @ w.t() + bias
    y.backward(dy)
    ks = slice(rank * IN // world, (rank + 1) * IN // world)
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    db = b.grad[rank]
    if bias_mode == "after_reduction":
        db = dy[rows].sum(0) if sp else dy.sum(0)  # this rank's rows only (Megatron's partial)
    return {"y": y.detach()[rows] if sp else y.detach(), "dx": x.grad[:, ks], "dw": w.grad[:, ks], "db": db}


def _case(sp: bool, precision: str, fused: bool, bias_mode: str = "per_rank"):
    def run(rank: int, world: int) -> dict:
        got = _run_linear(rank, world, sp=sp, precision=precision, fused=fused, bias_mode=bias_mode)
        want = _reference(rank, world, sp=sp, bias_mode=bias_mode)
        for key in ("y", "dx", "dw", "db"):
            torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
        return {k: got[k] for k in ("basic", "fwd", "bwd")}

    return run


def _name(sp: bool, precision: str, fused: bool, bias_mode: str = "per_rank") -> str:
    return f"{bias_mode}-{'sp' if sp else 'nosp'}-{precision}-{'fused' if fused else 'unfused'}"


CASES = {
    _name(sp, p, fused): _case(sp, p, fused)
    for sp in (False, True) for p in PRECISIONS for fused in (True, False)
}
CASES.update({
    _name(sp, "fp32", True, "after_reduction"): _case(sp, "fp32", True, "after_reduction")
    for sp in (False, True)
})


def _bias_tp(rank: int, world: int) -> dict:
    """TE's ``Bias(size, tensor_parallel=True)`` splits ``size`` over the group."""
    b = ops.Bias(8, tensor_parallel=True, tensor_parallel_group=dist.group.WORLD)
    return {"sizes": (b.size, b.local_size, b.global_size, b.tensor_parallel_size, b.tensor_parallel),
            "shape": tuple(b.bias.shape)}


CASES["bias_tensor_parallel"] = _bias_tp


def _all_cases(rank: int, world: int) -> dict:
    return run_cases(CASES, rank, world)


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, _all_cases, timeout=300)


@pytest.mark.multirank
@pytest.mark.parametrize("sp", (False, True), ids=("nosp", "sp"))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_row_parallel_bias_before_reduction_fused(results, sp: bool, precision: str) -> None:
    """Values (checked in the ranks) and the overlap fusion with the bias in its GEMM."""
    (meta, _) = case_values(results, _name(sp, precision, True))
    comm = "ReduceScatter" if sp else "AllReduce"
    assert meta["basic"] == ["BasicLinear", "Bias", comm]
    fused_fwd = "UserbuffersForwardLinear" if sp else "UserbuffersForwardLinearAllReduce"
    assert meta["fwd"] == [(fused_fwd, ["BasicLinear", "Bias", comm])], meta["fwd"]
    if sp:
        assert meta["bwd"] == [("UserbuffersBackwardLinear", ["BasicLinear", "Bias", comm])], meta["bwd"]


@pytest.mark.multirank
@pytest.mark.parametrize("sp", (False, True), ids=("nosp", "sp"))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_row_parallel_bias_before_reduction_unfused(results, sp: bool, precision: str) -> None:
    (meta, _) = case_values(results, _name(sp, precision, False))
    assert not any(name.startswith("Userbuffers") for name, _ in meta["fwd"] + meta["bwd"])
    # The per-rank bias sits between GEMM and collective, in the GEMM's epilogue here too.
    assert ("ForwardLinearBiasActivation", ["BasicLinear", "Bias"]) in meta["fwd"], meta["fwd"]


@pytest.mark.multirank
@pytest.mark.parametrize("sp", (False, True), ids=("nosp", "sp"))
def test_row_parallel_bias_after_reduction_is_megatron(results, sp: bool) -> None:
    (meta, _) = case_values(results, _name(sp, "fp32", True, "after_reduction"))
    comm = "ReduceScatter" if sp else "AllReduce"
    assert meta["basic"] == ["BasicLinear", comm, "Bias"]
    assert meta["fwd"][0] == ("UserbuffersForwardLinear" if sp else "UserbuffersForwardLinearAllReduce",
                              ["BasicLinear", comm])


def test_row_parallel_bias_argument() -> None:
    with pytest.raises(ValueError, match="row_parallel_bias must be one of"):
        ops.Linear(4, 4, tensor_parallel_mode="row", row_parallel_bias="megatron")
    # Without torch.distributed (TP size 1) both conventions are a plain linear.
    lin = ops.Linear(4, 3, tensor_parallel_mode="row")
    assert [type(o).__name__ for o in lin.basic_op_list] == ["BasicLinear", "Bias", "AllReduce"]
    assert "row_parallel_bias='per_rank'" in repr(lin)


@pytest.mark.multirank
def test_bias_tensor_parallel_on_two_ranks(results) -> None:
    for value in case_values(results, "bias_tensor_parallel"):
        assert value == {"sizes": (4, 4, 8, 2, True), "shape": (4,)}


def test_bias_tensor_parallel_arguments() -> None:
    """TE's ``Bias(size, tensor_parallel=True)``: ``size`` is global; TP size 1 here."""
    b = ops.Bias(6, tensor_parallel=True)
    assert (b.size, b.local_size, b.global_size, b.tensor_parallel) == (6, 6, 6, False)
    with pytest.raises(ValueError, match="tensor_parallel must be a bool"):
        ops.Bias(6, tensor_parallel="yes")
