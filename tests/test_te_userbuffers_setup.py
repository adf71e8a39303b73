"""Transformer Engine's userbuffers setup, ``te.module.base.initialize_ub(...)`` /
``destroy_ub()`` / ``UserBufferQuantizationMode``, called as TE's
``test_fusible_ops_with_userbuffers.py`` calls it, on 2 gloo ranks: the ``ub_cfgs`` dict
reaches the overlap fusions (``fc1_dgrad: ring_exchange`` instead of the default bulk),
a window picks the object registered for its quantization mode, explicit ``TPOverlap``
objects win, and ``destroy_ub`` makes fusers re-decide. Argument checks run in one
process. All 2-rank cases run in one start (module fixture).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import tp_fuse as te
from dist_utils import case_values, run_cases, run_distributed
from tp_fuse import ops
from tp_fuse.ops.fused import UserbuffersBackwardLinear, UserbuffersForwardLinear
from tp_fuse.overlap import userbuffers_setup
from tp_fuse.overlap.config import TPOverlap
from tp_fuse.recipe import DelayedScaling

ROWS, HIDDEN = 16, 16  # TE: [sequence_length * batch_size, num_heads * head_dim]
UB_CFGS = {"fc1_dgrad": {"method": "ring_exchange", "fp8_buf": False}}  # TE's test dict


def _init(modes, world: int, ub_cfgs=UB_CFGS) -> None:
    base = te.module.base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fp8_buf: reported as without effect
        base.initialize_ub(
            [ROWS, HIDDEN],
            world,
            quantization_modes=modes,
            dtype=torch.float32,
            bootstrap_backend="gloo",
            ub_cfgs=ub_cfgs,
            with_cublasmp=False,
        )


def _column(rank: int, world: int, fp8: bool, overlap=None) -> dict:
    """TE's column case (``comm_name="fc1"``, frozen weight), checked against float64."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.float64)
    dy = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    cols = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    options = {"comm_name": "fc1"} if overlap is None else {"comm_name": "fc1", "overlap": overlap}
    lin = ops.BasicLinear(HIDDEN, HIDDEN, tensor_parallel_mode="column", tensor_parallel_group=group,
                          sequence_parallel=True, userbuffers_options=options)
    with torch.no_grad():
        lin.weight.copy_(w[cols])
    lin.weight.requires_grad_(False)
    model = ops.Sequential(lin)
    xt = x[rows].float().requires_grad_()
    with te.autocast(enabled=fp8, recipe=DelayedScaling() if fp8 else None):
        y = model(xt)
    y.backward(dy[:, cols].float())
    if not fp8:
        torch.testing.assert_close(y.double(), (x @ w.t())[:, cols], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xt.grad.double(), (dy @ w)[rows], rtol=1e-5, atol=1e-5)
    fwd, bwd = model._module_groups[0]._forward_ops, model._module_groups[0]._backward_ops
    assert len(fwd) == 1 and isinstance(fwd[0][0], UserbuffersForwardLinear)
    assert len(bwd) == 1 and isinstance(bwd[0][0], UserbuffersBackwardLinear)
    return {"model": model, "fwd": fwd[0][0].plan, "bwd": bwd[0][0].plan}


def _row(rank: int, world: int) -> dict:
    """TE's row case: ``[BasicLinear(comm_name="proj"), Bias, ReduceScatter]``."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.float64)
    b = torch.randn(world, HIDDEN, generator=gen, dtype=torch.float64)
    dy = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    ks = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    lin = ops.BasicLinear(HIDDEN // world, HIDDEN, userbuffers_options={"comm_name": "proj"})
    bias = ops.Bias(HIDDEN)
    with torch.no_grad():
        lin.weight.copy_(w[:, ks])
        bias.bias.copy_(b[rank])
    model = ops.Sequential(lin, bias, ops.ReduceScatter(group))
    xt = x[:, ks].float().requires_grad_()
    y = model(xt)
    y.backward(dy[rows].float())
    torch.testing.assert_close(y.double(), (x @ w.t() + b.sum(0))[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.bias.grad.double(), dy.sum(0), rtol=1e-5, atol=1e-5)
    fwd = model._module_groups[0]._forward_ops
    assert isinstance(fwd[0][0], UserbuffersForwardLinear)
    return {"fwd": fwd[0][0].plan}


def _te_literal_call(rank: int, world: int) -> dict:
    base = te.module.base
    _init([base.UserBufferQuantizationMode.NONE], dist.get_world_size(dist.group.WORLD))
    try:
        col, row = _column(rank, world, fp8=False), _row(rank, world)
        registered = base.get_ub("fc1_dgrad", False)
        return {
            "initialized": base.is_ub_initialized(),
            "fc1_fprop": (col["fwd"].key, col["fwd"].entry.method, col["fwd"].overlap is registered),
            "fc1_dgrad": (col["bwd"].key, col["bwd"].entry.method, col["bwd"].overlap is registered),
            "proj_fprop": (row["fwd"].key, row["fwd"].entry.method, row["fwd"].overlap is registered),
        }
    finally:
        base.destroy_ub()


def _fp8_mode(rank: int, world: int) -> dict:
    base = te.module.base
    modes = [base.UserBufferQuantizationMode.NONE, base.UserBufferQuantizationMode.FP8]
    _init(modes, world, ub_cfgs=[{}, UB_CFGS])  # one dict per mode: only FP8 overrides fc1_dgrad
    try:
        hp, q = _column(rank, world, fp8=False), _column(rank, world, fp8=True)
        return {
            "hp": (hp["bwd"].entry.method, hp["bwd"].overlap is base.get_ub("fc1_dgrad", False)),
            "fp8": (q["bwd"].entry.method, q["bwd"].overlap is base.get_ub("fc1_dgrad", True)),
        }
    finally:
        base.destroy_ub()


def _missing_mode(rank: int, world: int) -> str:
    _init([te.module.base.UserBufferQuantizationMode.NONE], world)
    try:
        with pytest.raises(ValueError, match="UserBufferQuantizationMode.FP8") as info:
            _column(rank, world, fp8=True)
        return str(info.value)
    finally:
        te.module.base.destroy_ub()


def _explicit_wins_and_destroy_refuses(rank: int, world: int) -> dict:
    _init([te.module.base.UserBufferQuantizationMode.NONE], world)
    mine = TPOverlap()
    explicit = _column(rank, world, fp8=False, overlap=mine)
    registered = _column(rank, world, fp8=False)
    te.module.base.destroy_ub()
    model = registered["model"]
    x = torch.randn(ROWS // world, HIDDEN, requires_grad=True)
    model(x).sum().backward()  # same Sequential, after destroy_ub: decided again
    after = model._module_groups[0]._backward_ops[0][0].plan
    return {
        "explicit": explicit["bwd"].overlap is mine,
        "before": registered["bwd"].entry.method,
        "after": (after.entry.method, after.overlap is registered["bwd"].overlap),
        "initialized": te.module.base.is_ub_initialized(),
    }


def _tp_size_mismatch(rank: int, world: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        te.module.base.initialize_ub([ROWS, HIDDEN], 1, quantization_modes=[
            te.module.base.UserBufferQuantizationMode.NONE], dtype=torch.float32)
    try:
        with pytest.raises(ValueError, match="tp_size=1") as info:
            _column(rank, world, fp8=False)
        return str(info.value)
    finally:
        te.module.base.destroy_ub()


CASES = {
    "te_literal_call": _te_literal_call,
    "fp8_mode": _fp8_mode,
    "missing_mode": _missing_mode,
    "explicit_and_destroy": _explicit_wins_and_destroy_refuses,
    "tp_size_mismatch": _tp_size_mismatch,
}


def _all(rank: int, world: int) -> dict:
    return run_cases(CASES, rank, world)


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, _all, timeout=300)


@pytest.mark.multirank
def test_te_literal_initialize_ub_reaches_the_ops(results) -> None:
    for r in case_values(results, "te_literal_call"):
        assert r["initialized"] is True
        assert r["fc1_fprop"] == ("fc1_fprop", "ring_exchange", True)
        assert r["fc1_dgrad"] == ("fc1_dgrad", "ring_exchange", True)  # ub_cfgs; default: bulk
        assert r["proj_fprop"] == ("proj_fprop", "pipeline", True)


@pytest.mark.multirank
def test_windows_use_their_quantization_mode(results) -> None:
    for r in case_values(results, "fp8_mode"):
        assert r["hp"] == ("bulk", True)
        assert r["fp8"] == ("ring_exchange", True)


@pytest.mark.multirank
def test_unregistered_mode_is_an_error(results) -> None:
    for message in case_values(results, "missing_mode"):
        assert "registered only ['NONE']" in message


@pytest.mark.multirank
def test_explicit_objects_win_and_destroy_ub_redecides(results) -> None:
    for r in case_values(results, "explicit_and_destroy"):
        assert r["explicit"] is True
        assert r["before"] == "ring_exchange"
        assert r["after"] == ("bulk", False)  # back to the comm op's own default
        assert r["initialized"] is False


@pytest.mark.multirank
def test_tp_size_must_match_the_window(results) -> None:
    for message in case_values(results, "tp_size_mismatch"):
        assert "2 ranks" in message


# ---- single process: TE's signature and argument checks -------------------------------


def test_module_path_and_names() -> None:
    base = te.module.base
    assert base.initialize_ub is userbuffers_setup.initialize_ub
    assert [m.value for m in base.UserBufferQuantizationMode] == ["none", "fp8"]
    assert base.is_ub_initialized() is False and base.using_cublasmp_backend() is False
    with pytest.raises(ValueError, match="not initialized"):
        base.get_ub("fc1_fprop", False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shape": [16]}, "shape must be"),
        ({"quantization_modes": "fp8"}, "must be a list"),
        ({"quantization_modes": ["fp8"]}, "UserBufferQuantizationMode values"),
        ({"ub_cfgs": [{}, {}]}, "2 ub_cfgs for 1 quantization_modes"),
        ({"ub_cfgs": {"fc1_fprop": {"method": "pipeline"}}}, "'pipeline' method needs a reduce-scatter"),
        ({"ub_cfgs": {"fc1_dgrad": {"method": "ring_exchange"}, "fc1_wgrad": {"method": "bulk"}}},
         "drop one of them"),
        ({"ub_cfgs": {"proj_fprop": {"method": "pipeline", "is_reduce_scatter": False}}},
         "is_reduce_scatter"),
        ({"ub_cfgs": {"fc1_fprop": {"method": "external"}}}, "only for"),
        ({"ub_cfgs": {"fc1_fprop": {"method": "ring_exchange", "atomic_gemm": True}}}, "atomic_gemm"),
        ({"ub_cfgs": {"lm_head_fprop": {"method": "bulk"}}}, "unknown GEMM name"),
        ({"with_cublasmp": True}, "cuBLASMp"),
        ({}, "torch.distributed must be initialized"),
    ],
)
def test_argument_errors(kwargs, match) -> None:
    base = te.module.base
    args = {"shape": [16, 16], "tp_size": 2,
            "quantization_modes": [base.UserBufferQuantizationMode.NONE], **kwargs}
    with pytest.raises(ValueError, match=match):
        base.initialize_ub(**args)
    assert not base.is_ub_initialized()


def test_use_fp8_is_deprecated_as_in_te() -> None:
    with pytest.warns(DeprecationWarning, match="use_fp8 is deprecated"):
        with pytest.raises(ValueError, match="torch.distributed must be initialized"):
            te.module.base.initialize_ub([16, 16], 2, use_fp8=True)


def test_te_defaults_fill_fields_given_without_a_method() -> None:
    """TE merges a partial entry into its default (``num_splits`` for the default pipeline)."""
    cfg = userbuffers_setup._translate({"proj_fprop": {"num_splits": 8}}, te.module.base.UserBufferQuantizationMode.NONE)
    assert cfg == {"proj_fprop": {"num_splits": 8, "method": "pipeline"}}
