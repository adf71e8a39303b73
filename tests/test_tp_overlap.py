"""Tensor-parallel overlap fusions on gloo (2 and 4 ranks): every fused op against the same
ops with overlap switched off in the config (the unfused path) and against a float64
reference; FP8 within the FP8 rounding bound and equal to the unfused FP8 path; bytes on
the wire of the FP8 all-gather; Megatron YAML driving the methods; errors on every rank.

Processes start once per world size (module-scoped fixtures); each rank runs every case,
collects failures by topic instead of stopping at the first, and returns them. Every rank
builds every TP rank's inputs from shared seeds, so references need no communication.
"""

from __future__ import annotations

import math
import os
import traceback
from collections import defaultdict
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

RTOL = 1e-5  # relative to the largest reference entry
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_overlap.yaml")
pytestmark = pytest.mark.multirank


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = _rel_err(got, ref)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def _gen(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


# ---------------------------------------------------------------- models and references


class Case:
    """One layer: kind "col" [AllGather, BasicLinear(, Bias)], "row" [BasicLinear(, Bias),
    ReduceScatter] or "ar" [BasicLinear(, Bias), AllReduce], with float64 data for every TP
    rank (x, W, b, dy) built from ``seed``."""

    def __init__(self, kind: str, tp: int, m: int, mid: tuple, fin: int, fout: int, bias: bool, seed: int):
        self.kind, self.tp, self.m, self.mid, self.fin, self.fout, self.bias = kind, tp, m, mid, fin, fout, bias
        rows = {"col": m, "row": tp * m, "ar": m}[kind]
        dy_rows = {"col": tp * m, "row": m, "ar": m}[kind]
        self.x = [_gen(seed + r, rows, *mid, fin) for r in range(tp)]
        self.w = [_gen(seed + 100 + r, fout, fin, scale=1 / math.sqrt(fin)) for r in range(tp)]
        self.b = [_gen(seed + 200 + r, fout) for r in range(tp)]
        self.dy = [_gen(seed + 300 + r, dy_rows, *mid, fout) for r in range(tp)]

    def build(self, r: int, group, overlap, name: Optional[str], dtype=torch.float32, via_linear: bool = False):
        from tp_fuse.ops import AllGather, AllReduce, BasicLinear, Bias, ReduceScatter, Sequential

        opts: dict[str, Any] = {} if name is None else {"comm_name": name}
        comm_kw = {"overlap": overlap}
        if via_linear:  # the TPOverlap given to the GEMM instead of the comm op
            opts["overlap"], comm_kw = overlap, {}
        lin = BasicLinear(self.fin, self.fout, dtype=dtype, userbuffers_options=opts)
        with torch.no_grad():
            lin.weight.copy_(self.w[r])
        ops: list = [lin]
        bias_op = None
        if self.bias:
            bias_op = Bias(self.fout, dtype=dtype)
            with torch.no_grad():
                bias_op.bias.copy_(self.b[r])
            ops.append(bias_op)
        if self.kind == "col":
            ops.insert(0, AllGather(group, **comm_kw))
        else:
            ops.append((ReduceScatter if self.kind == "row" else AllReduce)(group, **comm_kw))
        return Sequential(*ops), lin, bias_op

    def reference(self, r: int) -> dict[str, torch.Tensor]:
        """float64 y, dx, dW, db of TP rank ``r``."""
        tp, m, x, w, b, dy = self.tp, self.m, self.x, self.w, self.b, self.dy
        bias = (lambda q: b[q]) if self.bias else (lambda q: 0.0)
        if self.kind == "col":
            x_full = torch.cat(x)
            y = x_full @ w[r].t() + bias(r)
            dx = sum(dy[q] @ w[q] for q in range(tp))[r * m : (r + 1) * m]
            dw = dy[r].reshape(-1, self.fout).t() @ x_full.reshape(-1, self.fin)
            db = dy[r].reshape(-1, self.fout).sum(0)
        elif self.kind == "row":
            y = sum(x[q] @ w[q].t() + bias(q) for q in range(tp))[r * m : (r + 1) * m]
            dy_full = torch.cat(dy)
            dx = dy_full @ w[r]
            dw = dy_full.reshape(-1, self.fout).t() @ x[r].reshape(-1, self.fin)
            db = dy_full.reshape(-1, self.fout).sum(0)
        else:
            y = sum(x[q] @ w[q].t() + bias(q) for q in range(tp))
            dx = dy[r] @ w[r]
            dw = dy[r].reshape(-1, self.fout).t() @ x[r].reshape(-1, self.fin)
            db = dy[r].reshape(-1, self.fout).sum(0)
        out = {"y": y, "dx": dx, "dW": dw}
        if self.bias:
            out["db"] = db
        return out


def _step(seq, lin, bias_op, x64: torch.Tensor, dy64: torch.Tensor, dtype=torch.float32) -> dict:
    x = x64.to(dtype).requires_grad_()
    y = seq(x)
    y.backward(dy64.to(dtype))
    out = {"y": y.detach().clone(), "dx": x.grad.clone(), "dW": lin.weight.grad.clone()}
    if bias_op is not None:
        out["db"] = bias_op.bias.grad.clone()
    for p in seq.parameters():
        p.grad = None
    return out


def _op_types(seq) -> tuple[list[str], list[str]]:
    fuser = seq.fusers()[0]
    return ([type(op).__name__ for op, _ in fuser.forward_ops], [type(op).__name__ for op, _ in fuser.backward_ops])


def _expect_fused(seq, fwd: Optional[str], bwd: Optional[str], what: str) -> None:
    f, b = _op_types(seq)
    if fwd is None:
        assert not any(n.startswith("Userbuffers") for n in f), f"{what}: forward fused unexpectedly: {f}"
    else:
        assert fwd in f, f"{what}: {fwd} not in forward ops {f}\n{seq.explain()}"
    if bwd is None:
        assert not any(n.startswith("Userbuffers") for n in b), f"{what}: backward fused unexpectedly: {b}"
    else:
        assert bwd in b, f"{what}: {bwd} not in backward ops {b}\n{seq.explain()}"


_FWD = {"col": "UserbuffersForwardLinear", "row": "UserbuffersForwardLinear", "ar": "UserbuffersForwardLinearAllReduce"}
_BWD = {"col": "UserbuffersBackwardLinear", "row": "UserbuffersBackwardLinear", "ar": None}
_NAME = {"col": "fc1", "row": "fc2", "ar": "proj"}
_TOPIC = {"col": "column", "row": "row", "ar": "all_reduce"}


class Runner:
    """Runs cases on one rank, collecting failures per topic."""

    def __init__(self) -> None:
        self.failures: dict[str, list[str]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.data: dict[str, Any] = {}

    def run(self, topic: str, label: str, fn: Callable[[], Any]) -> None:
        self.counts[topic] += 1
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported to the test, per case
            self.failures[topic].append(f"{label}:\n{traceback.format_exc()}")

    def result(self) -> dict:
        return {"failures": dict(self.failures), "counts": dict(self.counts), "data": self.data}


class WireCounter:
    """Counts the bytes this rank sends point-to-point (the ring all-gathers and gloo's
    all-gather use ``batch_isend_irecv``), by wrapping torch.distributed's entry point."""

    def __enter__(self) -> "WireCounter":
        self.sent = 0
        self._orig = dist.batch_isend_irecv

        def counting(ops):
            for op in ops:
                # int64 tensors are strict mode's shape descriptors (TP_FUSE_STRICT_CUDA=1
                # sends one before each ring exchange), not payload.
                if op.op is dist.isend and op.tensor.dtype != torch.int64:
                    self.sent += op.tensor.numel() * op.tensor.element_size()
            return self._orig(ops)

        dist.batch_isend_irecv = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.batch_isend_irecv = self._orig


def _config(kind: str, **entries: dict) -> "Any":
    """Overlap config with entries (by stage) for the case's GEMM name."""
    from tp_fuse.overlap.config import OverlapConfig

    cfg = OverlapConfig()
    for stage, fields in entries.items():
        cfg = cfg.with_entry(f"{_NAME[kind]}_{stage}", **fields)
    return cfg


def _unfused() -> "Any":
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    return TPOverlap(OverlapConfig(enabled=False))


def _hp_case(case: Case, r: int, group, cfg, label: str, *, save: bool = False, via_linear: bool = False,
             expect=("fused", "fused"), steps: int = 2, dtype: torch.dtype = torch.float32) -> None:
    """Fused (by ``cfg``) vs unfused vs float64, over ``steps`` steps (workspaces reused)."""
    from tolerances import tols
    from tp_fuse.overlap.config import TPOverlap

    name = _NAME[case.kind]
    seq_f, lin_f, b_f = case.build(r, group, TPOverlap(cfg, save_gathered_input=save), name, dtype, via_linear)
    seq_u, lin_u, b_u = case.build(r, group, _unfused(), name, dtype)
    ref = case.reference(r)
    # bf16: the fused GEMM adds the bias in its epilogue, the unfused ops after a rounding.
    rtol = RTOL if dtype == torch.float32 else 2 * tols(dtype)["rtol"]
    for step in range(steps):
        got = _step(seq_f, lin_f, b_f, case.x[r], case.dy[r], dtype)
        base = _step(seq_u, lin_u, b_u, case.x[r], case.dy[r], dtype)
        for k in ref:
            _close(got[k], base[k], f"{label} step {step} {k}: fused vs unfused", rtol)
            _close(got[k], ref[k], f"{label} step {step} {k}: fused vs float64", rtol)
    fwd = _FWD[case.kind] if expect[0] == "fused" else None
    bwd = _BWD[case.kind] if expect[1] == "fused" else None
    _expect_fused(seq_f, fwd, bwd, label)
    _expect_fused(seq_u, None, None, label + " (unfused)")


def _hp_cases(run: Runner, r: int, tp: int, group, tag: str, full: bool = True) -> None:
    col_shapes = [(3, (), 5, 7), (4, (2,), 8, 6), (1, (), 3, 2)]
    row_shapes = [(3, (), 7, 5), (2, (3,), 6, 8), (1, (), 2, 3)]
    col_variants = [  # (dgrad method, num_splits, wgrad overlap on, save gathered input)
        ("bulk", 4, True, False), ("bulk", 4, False, True), ("pipeline", 1, True, False),
        ("pipeline", 2, True, True), ("pipeline", 3, True, False), ("ring_exchange", 4, True, False),
    ]
    if not full:
        col_shapes, row_shapes = col_shapes[1:2], row_shapes[:1]
        col_variants = [col_variants[0], col_variants[3], col_variants[5]]
    for si, (m, mid, fin, fout) in enumerate(col_shapes):
        for bias in (True, False):
            case = Case("col", tp, m, mid, fin, fout, bias, seed=10 * si)
            for vi, (method, splits, wgrad_on, save) in enumerate(col_variants):
                cfg = _config("col", dgrad={"method": method, "num_splits": splits}, wgrad={"enabled": wgrad_on})
                label = f"{tag} col {(m, mid, fin, fout)} bias={bias} dgrad={method}/{splits} wgrad={wgrad_on} save={save}"
                run.run("column", label, lambda: _hp_case(case, r, group, cfg, label, save=save, via_linear=vi % 2 == 1))
    for si, (m, mid, fin, fout) in enumerate(row_shapes):
        for bias in (True, False):
            case = Case("row", tp, m, mid, fin, fout, bias, seed=1000 + 10 * si)
            for method, splits in [("pipeline", 1), ("pipeline", 2), ("pipeline", 3), ("pipeline", 4), ("ring_exchange", 4)]:
                if not full and splits in (1, 3):
                    continue
                cfg = _config("row", fprop={"method": method, "num_splits": splits})
                label = f"{tag} row {(m, mid, fin, fout)} bias={bias} fprop={method}/{splits}"
                run.run("row", label, lambda: _hp_case(case, r, group, cfg, label, via_linear=splits == 2))
    for kind, shape in (("col", (4, (2,), 16, 8)), ("row", (4, (), 16, 8))):
        if not full:
            break
        case = Case(kind, tp, *shape, True, seed=2500)
        cfg = _config(kind, dgrad={"method": "pipeline", "num_splits": 2}) if kind == "col" else _config(kind)
        label = f"{tag} {kind} bf16 {shape}"
        run.run(_TOPIC[kind], label, lambda: _hp_case(case, r, group, cfg, label, dtype=torch.bfloat16))
    for si, (m, mid, fin, fout) in enumerate([(5, (), 6, 4), (2, (2,), 3, 5)][: 2 if full else 1]):
        for bias in (True, False):
            case = Case("ar", tp, m, mid, fin, fout, bias, seed=2000 + 10 * si)
            for splits in (1, 2, 4, 11):
                cfg = _config("ar", fprop={"method": "pipeline", "num_splits": splits})
                label = f"{tag} ar {(m, mid, fin, fout)} bias={bias} splits={splits}"
                run.run("all_reduce", label, lambda: _hp_case(case, r, group, cfg, label, expect=("fused", "unfused")))


def _mixed_cases(run: Runner, r: int, tp: int, group) -> None:
    """Forward and backward fusions chosen independently: one direction off per GEMM stage."""
    col = Case("col", tp, 3, (2,), 5, 4, True, seed=3000)
    row = Case("row", tp, 2, (), 6, 5, True, seed=3100)
    for case, stage, expect in [
        (col, "dgrad", ("fused", "unfused")),  # forward keeps the shard; unfused backward re-gathers
        (col, "fprop", ("unfused", "fused")),  # backward gets the gathered input from BasicLinear
        (row, "dgrad", ("fused", "unfused")),
        (row, "fprop", ("unfused", "fused")),
    ]:
        for save in (False, True):
            cfg = _config(case.kind, **{stage: {"enabled": False}})
            label = f"mixed {case.kind} {stage} disabled save={save}"
            run.run("mixed", label, lambda: _hp_case(case, r, group, cfg, label, save=save, expect=expect))
    run.run("mixed", "mlp block", lambda: _mlp_case(r, tp, group))


def _mlp_case(r: int, tp: int, group) -> None:
    """[AllGather, fc1, Bias, GELU, fc2, ReduceScatter] fused vs unfused vs float64 autograd."""
    from tp_fuse.ops import GELU, AllGather, BasicLinear, Bias, ReduceScatter, Sequential
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    h, f, m = 6, 5, 3
    x = [_gen(4000 + q, m, h) for q in range(tp)]
    w1 = [_gen(4100 + q, f, h, scale=0.4) for q in range(tp)]
    b1 = [_gen(4200 + q, f) for q in range(tp)]
    w2 = [_gen(4300 + q, h, f, scale=0.4) for q in range(tp)]
    dy = [_gen(4400 + q, m, h) for q in range(tp)]
    outs = []
    for ov in (TPOverlap(OverlapConfig()), _unfused()):
        fc1 = BasicLinear(h, f, userbuffers_options={"comm_name": "fc1"})
        bias = Bias(f)
        fc2 = BasicLinear(f, h, userbuffers_options={"comm_name": "fc2"})
        with torch.no_grad():
            fc1.weight.copy_(w1[r]), bias.bias.copy_(b1[r]), fc2.weight.copy_(w2[r])
        seq = Sequential(AllGather(group, overlap=ov), fc1, bias, GELU(), fc2, ReduceScatter(group, overlap=ov))
        xr = x[r].float().requires_grad_()
        y = seq(xr)
        y.backward(dy[r].float())
        outs.append((seq, [y, xr.grad, fc1.weight.grad, bias.bias.grad, fc2.weight.grad]))
    fwd, bwd = _op_types(outs[0][0])
    assert fwd.count("UserbuffersForwardLinear") == 2 and bwd.count("UserbuffersBackwardLinear") == 2, (fwd, bwd)
    # float64 reference with autograd over all TP ranks' shards.
    xs = [t.clone().requires_grad_() for t in x]
    p = [[t.clone().requires_grad_() for t in ws] for ws in (w1, b1, w2)]
    x_full = torch.cat(xs)
    gelu = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # noqa: E731 - tp_fuse GELU is tanh GELU
    y_full = sum(gelu(x_full @ p[0][q].t() + p[1][q]) @ p[2][q].t() for q in range(tp))
    (y_full * torch.cat(dy)).sum().backward()
    ref = [y_full[r * m : (r + 1) * m], xs[r].grad, p[0][r].grad, p[1][r].grad, p[2][r].grad]
    for k, (a, b, c) in enumerate(zip(outs[0][1], outs[1][1], ref)):
        _close(a, b, f"mlp tensor {k}: fused vs unfused")
        _close(a, c, f"mlp tensor {k}: fused vs float64")


# ---------------------------------------------------------------- FP8


def _fp8_bounds(case: Case, r: int, got: dict) -> None:
    """Each FP8 result within the rounding bound of its GEMM (float64 reference)."""
    from tolerances import FP8_UNIT_ROUNDOFF, assert_fp8_matmul_close

    e4, e5 = FP8_UNIT_ROUNDOFF["e4m3"], FP8_UNIT_ROUNDOFF["e5m2"]
    fin, fout, tp = case.fin, case.fout, case.tp

    def flat(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.reshape(-1, n)

    x, w, dy = case.x, case.w, case.dy
    bias = (lambda q: case.b[q]) if case.bias else (lambda q: None)
    if case.kind == "col":
        x_full = flat(torch.cat(x), fin)
        assert_fp8_matmul_close(flat(got["y"], fout), x_full, w[r], e4, e4, bias=bias(r))
        dy_cat = flat(torch.cat(dy, dim=-1), tp * fout)[r * len(flat(x[r], fin)) : (r + 1) * len(flat(x[r], fin))]
        assert_fp8_matmul_close(flat(got["dx"], fin), dy_cat, torch.cat(w).t(), e5, e4)
        assert_fp8_matmul_close(got["dW"], flat(dy[r], fout).t(), x_full.t(), e5, e4)
        return
    dy_full = flat(torch.cat(dy) if case.kind == "row" else dy[r], fout)
    x_cat = flat(torch.cat(x, dim=-1), tp * fin)
    b_sum = sum(case.b) if case.bias else None
    rows = slice(r * len(x_cat) // tp, (r + 1) * len(x_cat) // tp) if case.kind == "row" else slice(None)
    assert_fp8_matmul_close(flat(got["y"], fout), x_cat[rows], torch.cat(w, dim=-1), e4, e4, bias=b_sum)
    assert_fp8_matmul_close(flat(got["dx"], fin), dy_full, w[r].t(), e5, e4)
    assert_fp8_matmul_close(got["dW"], dy_full.t(), flat(x[r], fin).t(), e5, e4)


def _quantizer_state(lin) -> dict[str, torch.Tensor]:
    out = {}
    for role, q in lin._quantizers.quantizers.items():
        out[f"{role}.scale"] = q.scale.clone()
        if hasattr(q, "amax_history"):
            out[f"{role}.amax_history"] = q.amax_history.clone()
        else:
            out[f"{role}.last_amax"] = q.last_amax.clone()
    return out


def _fp8_case(case: Case, r: int, group, cfg, recipe, label: str, amax_group=None, expect=("fused", "fused")) -> None:
    """Two FP8 steps, fused vs unfused (same math: equal to 1e-5, same quantizer state) and
    within the FP8 rounding bound of the float64 reference."""
    import tp_fuse
    from tp_fuse.overlap.config import TPOverlap
    from tp_fuse.recipe import DelayedScaling

    name = _NAME[case.kind]
    models = [case.build(r, group, ov, name) for ov in (TPOverlap(cfg), _unfused())]
    ref = case.reference(r)
    for step in range(2):
        results = []
        for seq, lin, b in models:
            with tp_fuse.autocast(recipe=recipe, amax_reduction_group=amax_group):
                x = case.x[r].float().requires_grad_()
                y = seq(x)
            y.backward(case.dy[r].float())
            res = {"y": y.detach(), "dx": x.grad, "dW": lin.weight.grad.clone()}
            if b is not None:
                res["db"] = b.bias.grad.clone()
            for p in seq.parameters():
                p.grad = None
            results.append(res)
        got, base = results
        for k in got:
            _close(got[k], base[k], f"{label} step {step} {k}: FP8 fused vs unfused FP8")
        if "db" in ref:
            _close(got["db"], ref["db"], f"{label} step {step} db (high precision) vs float64")
        # Delayed scaling starts at scale 1 (values below E4M3's normal range lose bits);
        # from step 2 the scales come from step 1's amaxes.
        if step == 1 or not isinstance(recipe, DelayedScaling):
            _fp8_bounds(case, r, got)
        sf, su = _quantizer_state(models[0][1]), _quantizer_state(models[1][1])
        assert sf.keys() == su.keys() and sf, (sf.keys(), su.keys())
        for k in sf:
            _close(sf[k], su[k], f"{label} step {step} quantizer {k}: fused vs unfused", rtol=0)
    fwd = _FWD[case.kind] if expect[0] == "fused" else None
    bwd = _BWD[case.kind] if expect[1] == "fused" else None
    with tp_fuse.autocast(recipe=recipe, amax_reduction_group=amax_group):
        _expect_fused(models[0][0], fwd, bwd, label)


def _fp8_recipes() -> list:
    from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling, Format

    return [DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), Float8CurrentScaling(fp8_format=Format.HYBRID)]


def _fp8_cases(run: Runner, r: int, tp: int, group, tag: str, full: bool = True, amax_group=None) -> None:
    # Features and tokens (wgrad's K) multiples of 16, as CUDA's _scaled_mm needs
    # (TP_FUSE_STRICT_CUDA=1 checks it); per-rank and per-chunk row counts are free.
    col = Case("col", tp, 8, (), 16, 16, True, seed=5000)
    col_nb = Case("col", tp, 4, (2,), 32, 16, False, seed=5100)
    row = Case("row", tp, 8, (), 16, 32, True, seed=5200)
    row_nb = Case("row", tp, 4, (2,), 16, 32, False, seed=5300)
    ar = Case("ar", tp, 16, (), 16, 16, True, seed=5400)
    variants = [
        (col, {"dgrad": {"method": "bulk"}}), (col_nb, {"dgrad": {"method": "pipeline", "num_splits": 2}}),
        (col, {"dgrad": {"method": "ring_exchange"}}), (row, {"fprop": {"method": "pipeline", "num_splits": 2}}),
        (row_nb, {"fprop": {"method": "ring_exchange"}}), (ar, {"fprop": {"method": "pipeline", "num_splits": 3}}),
    ]
    if not full:
        variants = variants[:1] + variants[3:4]
    for recipe in _fp8_recipes():
        for case, entries in variants:
            cfg = _config(case.kind, **entries)
            label = f"{tag} FP8 {type(recipe).__name__} {case.kind} {entries} bias={case.bias}"
            expect = ("fused", "fused" if case.kind != "ar" else "unfused")
            run.run("fp8", label, lambda: _fp8_case(case, r, group, cfg, recipe, label, amax_group, expect))


def _wire_cases(run: Runner, r: int, tp: int, group) -> None:
    """Bytes this rank sends: the fused column forward moves 1 byte per element under FP8
    (1/4 of fp32, 1/2 of bf16); so does the row backward's all-gather of dy, and the
    standalone AllGather of a Float8Tensor."""
    import tp_fuse
    from tp_fuse.ops import AllGather, Quantize, Sequential
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap

    col = Case("col", tp, 4, (2,), 16, 16, False, seed=6000)
    sent = {}
    for dtype in (torch.float32, torch.bfloat16):
        for fp8 in (False, True):
            seq, _, _ = col.build(r, group, TPOverlap(OverlapConfig()), "fc1", dtype=dtype)
            x = col.x[r].to(dtype)
            with torch.no_grad(), WireCounter() as wc:
                if fp8:
                    with tp_fuse.autocast():
                        seq(x)
                else:
                    seq(x)
            _expect_fused(seq, "UserbuffersForwardLinear", "UserbuffersBackwardLinear", "wire col")
            sent[f"col fprop {dtype} fp8={fp8}"] = wc.sent
    row = Case("row", tp, 4, (2,), 16, 16, False, seed=6100)
    for fp8 in (False, True):
        seq, _, _ = row.build(r, group, TPOverlap(OverlapConfig()), "fc2")
        x = row.x[r].float().requires_grad_()
        with tp_fuse.autocast(enabled=fp8):
            y = seq(x)
        with WireCounter() as wc:
            y.backward(row.dy[r].float())
        sent[f"row dgrad fp8={fp8}"] = wc.sent
    # Standalone AllGather of a Float8Tensor (from a Quantize op): bytes, same values.
    xq = col.x[r].float()
    with WireCounter() as wc, tp_fuse.autocast():
        y = Sequential(Quantize(), AllGather(group))(xq)
    sent["standalone AllGather fp8"] = wc.sent
    from tp_fuse.quantization import Float8Tensor

    assert isinstance(y, Float8Tensor), type(y)
    # First step: delayed scaling quantizes with scale 1 on every rank.
    expect = torch.cat([t.float().to(torch.float8_e4m3fn).float() for t in col.x])
    assert torch.equal(y.dequantize(), expect), "standalone FP8 AllGather changed values"
    run.data["wire_bytes"] = sent
    run.data["wire_numel"] = {"col": (tp - 1) * col.x[r].numel(), "row": (tp - 1) * row.dy[r].numel()}


# ---------------------------------------------------------------- errors, explain, TP=1


def _explain_cases(run: Runner, r: int, tp: int, group) -> None:
    """The Megatron YAML drives method selection; rejections name their reason."""
    import tp_fuse
    from tp_fuse.ops import GELU, AllGather, AllReduce, BasicLinear, Bias, ReduceScatter, Sequential
    from tp_fuse.overlap.config import OverlapConfig, TPOverlap
    from tp_fuse.recipe import DelayedScaling

    def block(ov) -> Sequential:
        torch.manual_seed(0)

        def lin(i, o, name):
            return BasicLinear(i, o, userbuffers_options={"comm_name": name, "overlap": ov})

        return Sequential(
            AllGather(group), lin(8, 6, "qkv"), Bias(6), lin(6, 8, "proj"), ReduceScatter(group),
            AllGather(group), lin(8, 10, "fc1"), Bias(10), GELU(), lin(10, 8, "fc2"), ReduceScatter(group),
        )

    texts = {}

    def yaml_block():
        cfg = OverlapConfig.from_yaml(FIXTURE, warn_ignored=False)
        fused, unfused = block(TPOverlap(cfg)), block(TPOverlap(OverlapConfig.from_yaml(FIXTURE, enabled=False, warn_ignored=False)))
        outs = []
        for seq in (fused, unfused):
            x = _gen(8000 + r, 4, 8).float().requires_grad_()
            y = seq(x)
            y.backward(_gen(8100 + r, 4, 8).float())
            outs.append([y.detach(), x.grad] + [p.grad for p in seq.parameters()])
        for k, (a, b) in enumerate(zip(*outs)):
            _close(a, b, f"yaml block tensor {k}: fused vs unfused")
        fwd, bwd = _op_types(fused)
        assert fwd.count("UserbuffersForwardLinear") == 4 and bwd.count("UserbuffersBackwardLinear") == 4, (fwd, bwd)
        texts["yaml"] = str(fused.explain())
        texts["yaml_disabled"] = str(unfused.explain())

    def rejections():
        cfg = (
            OverlapConfig()
            .with_entry("qkv_fprop", method="pipeline")
            .with_entry("proj_fprop", method="bulk")
            .with_entry("proj_dgrad", method="pipeline")
            .with_entry("fc2_dgrad", method="bulk")
            .with_entry("fc1_wgrad", method="ring_exchange")
            .disable("fc2_fprop", "fc1_fprop")
        )
        texts["rejections"] = str(block(TPOverlap(cfg)).explain())
        ar = Sequential(BasicLinear(4, 4, userbuffers_options={"comm_name": "qkv"}), AllReduce(group),
                        AllGather(group), GELU(), BasicLinear(4, 4), AllReduce(group))
        texts["all_reduce"] = str(ar.explain())
        with tp_fuse.autocast(recipe=DelayedScaling(reduce_amax=False)):
            texts["fp8_no_reduce"] = str(block(TPOverlap()).explain())
        with tp_fuse.autocast(recipe=DelayedScaling()):
            texts["fp8"] = str(block(TPOverlap()).explain())

    run.run("explain", "megatron yaml block", yaml_block)
    run.run("explain", "rejections", rejections)
    run.data["explain"] = texts


def _tp1_cases(run: Runner, r: int, world: int) -> None:
    """A TP group of one rank inside a multi-rank world: identity comm, no fusion."""
    groups = [dist.new_group([q]) for q in range(world)]  # every rank creates every group
    group = groups[r]
    case = Case("col", 1, 3, (), 5, 4, True, seed=9000)
    row = Case("row", 1, 3, (), 5, 4, True, seed=9100)
    cfg = _config("col")
    for c in (case, row):
        run.run("tp1", f"tp1 {c.kind}", lambda: _hp_case(c, 0, group, cfg, f"tp1 {c.kind}", expect=("unfused", "unfused")))

    def reason():
        seq, _, _ = case.build(0, group, None, "fc1")
        text = str(seq.explain())
        assert "TP size 1: nothing to overlap" in text, text

    run.run("tp1", "tp1 reason", reason)


# ---------------------------------------------------------------- rank entry points


def _rank_main_2(rank: int, world: int) -> dict:
    run = Runner()
    group = dist.group.WORLD
    _hp_cases(run, rank, world, group, "tp2")
    _mixed_cases(run, rank, world, group)
    _fp8_cases(run, rank, world, group, "tp2")
    _wire_cases(run, rank, world, group)
    _explain_cases(run, rank, world, group)
    _tp1_cases(run, rank, world)
    return run.result()


def _rank_main_4(rank: int, world: int) -> dict:
    import tp_fuse
    from tp_fuse.recipe import DelayedScaling

    run = Runner()
    # TP over all 4 ranks.
    _hp_cases(run, rank, world, dist.group.WORLD, "tp4", full=False)
    _fp8_cases(run, rank, world, dist.group.WORLD, "tp4", full=False)
    # 2 TP groups x 2 data-parallel groups; every rank creates every group, in order.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    r = dist.get_rank(tp_group)
    _hp_cases(run, r, 2, tp_group, "tp2x2", full=False)
    # The amax of the world covers each TP group: FP8 bytes are gathered.
    _fp8_cases(run, r, 2, tp_group, "tp2x2", full=False, amax_group=dist.group.WORLD)

    def dp_amax_group():
        # An amax group across data-parallel ranks only: TP ranks' scales may differ, so
        # the FP8 all-gathers do not fuse (with the reason) and the unfused path runs.
        col = Case("col", 2, 8, (), 16, 16, True, seed=5000)
        cfg = _config("col")
        recipe = DelayedScaling()
        _fp8_case(col, r, tp_group, cfg, recipe, "dp amax group", amax_group=dp_group, expect=("unfused", "fused"))
        seq, _, _ = col.build(r, tp_group, None, "fc1")
        with tp_fuse.autocast(recipe=recipe, amax_reduction_group=dp_group):
            text = str(seq.explain())
        assert "does not cover the TP group" in text, text

    run.run("fp8", "dp amax group", dp_amax_group)
    return run.result()


@pytest.fixture(scope="module")
def results_2() -> list[dict]:
    return run_distributed(2, _rank_main_2, timeout=240)


@pytest.fixture(scope="module")
def results_4() -> list[dict]:
    return run_distributed(4, _rank_main_4, timeout=240)


def _check(results: list[dict], topic: str, min_cases: int) -> None:
    for rank, res in enumerate(results):
        fails = res["failures"].get(topic, [])
        assert not fails, f"rank {rank}: {len(fails)} failing '{topic}' case(s):\n" + "\n".join(fails[:3])
        assert res["counts"].get(topic, 0) >= min_cases, (topic, res["counts"])


# ---------------------------------------------------------------- tests (2 ranks)


def test_column_parallel_fp32_matches_unfused_and_float64(results_2):
    _check(results_2, "column", 37)


def test_row_parallel_fp32_matches_unfused_and_float64(results_2):
    _check(results_2, "row", 31)


def test_all_reduce_fp32_matches_unfused_and_float64(results_2):
    _check(results_2, "all_reduce", 16)


def test_forward_and_backward_fusions_are_independent(results_2):
    _check(results_2, "mixed", 9)


def test_fp8_matches_unfused_fp8_and_rounding_bound(results_2):
    _check(results_2, "fp8", 12)


def test_fp8_all_gather_moves_one_byte_per_element(results_2):
    sent = results_2[0]["data"]["wire_bytes"]
    numel = results_2[0]["data"]["wire_numel"]
    assert sent["col fprop torch.float32 fp8=False"] == 4 * numel["col"], sent
    assert sent["col fprop torch.bfloat16 fp8=False"] == 2 * numel["col"], sent
    assert sent["col fprop torch.float32 fp8=True"] == numel["col"], sent
    assert sent["col fprop torch.bfloat16 fp8=True"] == numel["col"], sent
    assert sent["row dgrad fp8=False"] == 4 * numel["row"], sent
    assert sent["row dgrad fp8=True"] == numel["row"], sent
    assert sent["standalone AllGather fp8"] == numel["col"], sent
    assert results_2[1]["data"]["wire_bytes"] == sent


def test_tp1_group_is_identity_without_fusion(results_2):
    _check(results_2, "tp1", 3)


def test_megatron_yaml_drives_method_selection(results_2):
    _check(results_2, "explain", 2)
    text = results_2[0]["data"]["explain"]["yaml"]
    for line in (
        "AllGather+GEMM 'qkv', qkv_fprop: ring_exchange, TP=2",
        "GEMM+ReduceScatter 'proj', proj_fprop: pipeline (num_splits=2) [ignored: num_sm=24, cga_size=2, "
        "set_sm_margin=1, fp8_buf=0], TP=2",
        "AllGather+GEMM 'fc1', fc1_fprop: ring_exchange, TP=2",
        "GEMM+ReduceScatter 'fc2', fc2_fprop: ring_exchange [ignored: num_sm=1, set_sm_margin=1, atomic_gemm=0], TP=2",
        "dgrad/wgrad 'qkv', qkv_dgrad: bulk [ignored: num_sm=4, cga_size=2, set_sm_margin=0] (input shard re-gathered || "
        "dgrad GEMM; qkv_wgrad: bulk [ignored: num_sm=8, cga_size=2, set_sm_margin=0]: dx reduce-scatter || wgrad GEMM)",
        "dgrad/wgrad 'fc1', fc1_dgrad: pipeline (num_splits=2) [ignored: num_sm=2, cga_size=2, set_sm_margin=0] "
        "(dgrad GEMM+dx reduce-scatter; input shard re-gathered alongside)",
        "AllGather(dy)+dgrad GEMM 'proj', proj_dgrad: ring_exchange",
        "AllGather(dy)+dgrad GEMM 'fc2', fc2_dgrad: ring_exchange",
    ):
        assert line in text, f"{line!r} not in:\n{text}"
    off = results_2[0]["data"]["explain"]["yaml_disabled"]
    # 4 windows x (forward, backward) in the fusion log, and each window once more in the
    # compile section ("the eager fuser does not fuse it either: ...").
    assert off.count("overlap disabled by config (OverlapConfig.enabled=False)") == 12, off
    assert off.count("does not fuse it either: overlap disabled by config") == 4, off


def test_explain_gives_reasons_for_rejected_windows(results_2):
    texts = results_2[0]["data"]["explain"]
    rej = texts["rejections"]
    for reason in (
        "qkv_fprop method pipeline: pipeline overlaps a reduce-scatter",
        "proj_fprop method bulk: bulk hides a collective behind an independent computation, but the reduce-scatter",
        "proj_dgrad method pipeline: pipeline overlaps a reduce-scatter; this backward all-gathers dy",
        "fc2_dgrad method bulk: bulk hides a collective",
        "overlap disabled for fc1_fprop by config",
        "overlap disabled for fc2_fprop by config",
        "dx reduce-scatter not overlapped (fc1_wgrad method ring_exchange: only bulk overlaps",
    ):
        assert reason in rej, f"{reason!r} not in:\n{rej}"
    ar = texts["all_reduce"]
    assert "qkv_fprop method ring_exchange: a GEMM+all-reduce overlaps by chunks" in ar, ar
    assert "AllGather followed by GELU, not BasicLinear" in ar, ar
    assert "GEMM+AllReduce unnamed GEMM, row_fprop: pipeline (num_splits=4) chunks, TP=2" in ar, ar
    assert "DelayedScaling(reduce_amax=False) keeps per-rank scales" in texts["fp8_no_reduce"]
    assert "FP8: input quantized before the gather (1 byte/element on the wire)" in texts["fp8"]
    assert "dy quantized before the gather (1 byte/element)" in texts["fp8"]


# ---------------------------------------------------------------- tests (4 ranks)


def test_four_ranks_tp4_and_tp2x2(results_4):
    for topic, n in (("column", 12), ("row", 6), ("all_reduce", 8)):
        _check(results_4, topic, n)


def test_four_ranks_fp8_and_amax_group_not_covering_tp(results_4):
    _check(results_4, "fp8", 9)
