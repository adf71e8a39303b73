"""PyTorch's symmetric-memory fused ops as ``method: auto`` candidates (tp_fuse.overlap.symm_mem).

CPU only here: the ops have CUDA kernels only, so on CPU the ``symm_mem`` candidate is not
offered (tested), and what can be checked is the arguments tp_fuse builds for them: the
schema table against the registered schemas, conforming argument sets from real FP8
tensors (tensor-wise and row-wise) with no violation, each rule on its own, strict mode,
and, on two gloo ranks, the built calls run through PyTorch's own reference
implementations of the ops (their Meta/test-mode fallbacks, which use functional
collectives) giving the unfused window's result. ``make gpu-check`` measures the ops on
GPUs (tools/gpu_check_symm_mem.py).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import tp_fuse  # noqa: F401 - registers the package layout (tp_fuse.comm)
from dist_utils import run_distributed
from tp_fuse.overlap import symm_mem as sm
from tp_fuse.overlap import symm_mem_rules as rules
from tp_fuse.overlap.auto import OverlapAutoTuner, candidate_labels, load_choice_file, save_choice_file, AutoDecision
from tp_fuse.quantization import BlockScalingQuantizer, CurrentScalingQuantizer
from tp_fuse.recipe import Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling
from tp_fuse.strict import STRICT_ENV, CudaConformanceError

M, K, N, WORLD = 32, 64, 48, 2


def _fp8(kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    if kind == "tensorwise":
        qx = CurrentScalingQuantizer(Float8CurrentScaling(), "input")
        qw = CurrentScalingQuantizer(Float8CurrentScaling(), "weight")
    elif kind == "rowwise":
        qx = BlockScalingQuantizer(Float8RowwiseScaling(), "input")
        qw = BlockScalingQuantizer(Float8RowwiseScaling(), "weight")
    else:
        qx = BlockScalingQuantizer(Float8BlockScaling(), "input")
        qw = BlockScalingQuantizer(Float8BlockScaling(), "weight")
    return qx.quantize(x), qw.quantize(w)


def _hp(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(M, K, generator=gen, dtype=dtype), torch.randn(N, K, generator=gen, dtype=dtype)


def test_schema_table_matches_the_registered_ops() -> None:
    # Importing it registers torch.ops.symm_mem (this test used to rely on `import tp_fuse`
    # importing tp_fuse.layers, and through it torch.distributed's FSDP, which imports it).
    import torch.distributed._symmetric_memory  # noqa: F401

    for op, args in rules.SCHEMA_ARGS.items():
        schema = getattr(torch.ops.symm_mem, op).default._schema
        assert [(a.name, a.has_default_value()) for a in schema.arguments] == list(args), op


def test_not_offered_on_cpu() -> None:
    for op in rules.OPS:
        why = sm.symm_mem_unavailable(op, None, torch.device("cpu"))
        assert why is not None and "CUDA" in why
    with pytest.raises(ValueError, match="unknown op"):
        sm.symm_mem_unavailable("fused_nothing", None, torch.device("cpu"))


def test_labels_and_choice_file(tmp_path) -> None:
    assert candidate_labels(("ring_exchange",), (2,), 8, ("symm_mem",)) == ["ring_exchange", "symm_mem", "unfused"]
    assert candidate_labels(("ring_exchange",), (2,), 8) == ["ring_exchange", "unfused"]  # CPU: unchanged
    for bad in ("symm_mem/2", "unfused", "ring_exchange", "magic"):
        with pytest.raises(ValueError, match="extra label"):
            candidate_labels(("ring_exchange",), (2,), 8, (bad,))
    path = str(tmp_path / "choices.json")
    save_choice_file(path, [AutoDecision("fc1_fprop", "sig", "symm_mem", ("ring_exchange", "symm_mem", "unfused"),
                                         {"symm_mem": 1e-3})])
    (d,) = load_choice_file(path)
    assert d.choice == "symm_mem"
    # A GPU run's choice file read where symm_mem is not a candidate: a ValueError, not a silent switch.
    tuner = OverlapAutoTuner(choice_file=path)
    with pytest.raises(ValueError, match="not a candidate"):
        tuner.decide("fc1_fprop", "sig", {"ring_exchange": lambda: None, "unfused": lambda: None}, None,
                     torch.device("cpu"))
    with open(path) as f:
        text = f.read().replace('"symm_mem"', '"symm_mem\\n"')
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match="not a method label"):
        load_choice_file(path)


# ------------------------------------------------------------------ conforming calls


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("out_dtype, with_bias", [(torch.bfloat16, True), (torch.float32, True), (torch.float32, False)])
def test_fp8_window_calls_conform(kind, mode, out_dtype, with_bias) -> None:
    a, w = _fp8(kind)
    bias = torch.randn(N).to(out_dtype) if with_bias else None
    call = sm.window_call(mode, a, w, group_name="0", world_size=WORLD, out_dtype=out_dtype, bias=bias)
    assert call.call.op == sm.symm_op_for(mode, True)
    assert call.call.violations() == []
    # Where cuBLASLt cannot fuse the bias (fp32 output, row-wise), it is added after, in fp32.
    fused = call.call.args.get("bias", (call.call.args.get("biases") or [None])[0])
    assert (fused is not None) == (with_bias and kind == "tensorwise" and out_dtype == torch.bfloat16)
    assert (call.bias_after is not None) == (with_bias and fused is None)


@pytest.mark.parametrize("mode", ["all_gather", "reduce_scatter"])
def test_hp_window_calls_conform(mode) -> None:
    a, w = _hp(torch.bfloat16)
    bias = torch.randn(N).bfloat16()
    call = sm.window_call(mode, a, w, group_name="0", world_size=WORLD, out_dtype=torch.bfloat16,
                          bias=bias, return_a=True)
    assert call.call.op == sm.symm_op_for(mode, False) and call.call.violations() == []
    # The reduce-scatter sums every rank's bias: WORLD of them, added once after the op.
    assert torch.equal(call.bias_after, bias * (WORLD if mode == "reduce_scatter" else 1))


def test_block_scales_have_no_form_in_the_ops() -> None:
    a, w = _fp8("blockwise")
    why = sm.fp8_layout_problem(a, w)
    assert why is not None and "tensor-wise or row-wise" in why
    with pytest.raises(ValueError, match="block scales"):
        sm.window_call("all_gather", a, w, group_name="0", world_size=WORLD, out_dtype=torch.float32)


# ------------------------------------------------------------------ each rule


def _ag_args(kind="tensorwise"):
    a, w = _fp8(kind)
    return dict(sm.window_call("all_gather", a, w, group_name="0", world_size=WORLD,
                               out_dtype=torch.bfloat16).call.args)


def _rs_args(kind="tensorwise"):
    a, w = _fp8(kind)
    return dict(sm.window_call("reduce_scatter", a, w, group_name="0", world_size=WORLD,
                               out_dtype=torch.bfloat16).call.args)


def _hp_rs_args():
    a, w = _hp()
    return dict(sm.matmul_rs_call(a, w.t(), "0", WORLD).args)


E5 = torch.float8_e5m2
RULES = [
    (rules.AG_SCALED, lambda d: {**d, "extra": 1}, "unknown argument"),
    (rules.AG_SCALED, lambda d: {k: v for k, v in d.items() if k != "A_scale"}, "missing required argument 'A_scale'"),
    (rules.AG_SCALED, lambda d: {**d, "group_name": ""}, "group_name"),
    (rules.AG_SCALED, lambda d: {**d, "gather_dim": -1}, "gather_dim must be in"),
    (rules.AG_SCALED, lambda d: {**d, "biases": []}, "biases must be a list"),
    (rules.AG_SCALED, lambda d: {**d, "A": d["A"][:, :48]}, "K mismatch"),
    (rules.AG_SCALED, lambda d: {**d, "A": d["A"].t().contiguous().t()}, "must be contiguous"),
    (rules.AG_SCALED, lambda d: {**d, "A_scale": torch.ones(3)}, "neither tensor-wise"),
    (rules.AG_SCALED, lambda d: {**d, "out_dtypes": [None]}, "float8 output"),
    (rules.AG_SCALED, lambda d: {**d, "out_dtypes": [torch.float64]}, "out_dtype"),
    (rules.AG_SCALED, lambda d: {**d, "Bs": [d["Bs"][0].contiguous()]}, "column-major"),
    (rules.AG_SCALED, lambda d: {**d, "A": d["A"].view(torch.uint8).view(E5), "Bs": [d["Bs"][0].view(torch.uint8)
                                                                            .view(E5)]}, "e5m2 x e5m2"),
    (rules.AG_SCALED, lambda d: {**d, "biases": [torch.zeros(N, dtype=torch.float32)]}, "bias: must be"),
    (rules.AG_SCALED, lambda d: {**d, "result_scales": [torch.ones(())]}, "float8 outputs only"),
    (rules.RS_SCALED, lambda d: {**d, "reduce_op": "max"}, "reduce_op"),
    (rules.RS_SCALED, lambda d: {**d, "A": d["A"][:31]}, "divisible by the group size"),
    (rules.RS_SCALED, lambda d: {**d, "output_shape": None}, "output_shape must be a list"),
    (rules.RS_SCALED, lambda d: {**d, "output_shape": [M, N + 16]}, "does not hold"),
    (rules.RS_SCALED, lambda d: {**d, "orig_scatter_dim": 2}, "orig_scatter_dim"),
    (rules.RS_SCALED, lambda d: {**d, "A_scale": torch.ones(M + 1, 1)}, "leading dims must match"),
    (rules.RS_SCALED, lambda d: {**d, "B_scale": torch.ones(1, N)}, "scales:"),
    (rules.RS_SCALED, lambda d: {**d, "A": d["A"][:, :40].contiguous(), "B": d["B"][:40]}, "multiples of 16"),
    (rules.RS, lambda d: {**d, "B": d["B"].double()}, "one high-precision floating dtype"),
    (rules.RS, lambda d: {**d, "scatter_dim": 2}, "scatter_dim must be in"),
    (rules.RS, lambda d: {**d, "B": d["B"].to("meta")}, "devices"),
]


@pytest.mark.parametrize("op, mutate, needle", RULES)
def test_each_symm_mem_rule(op, mutate, needle) -> None:
    base = {rules.AG_SCALED: _ag_args, rules.RS_SCALED: _rs_args, rules.RS: _hp_rs_args}[op]()
    assert rules.symm_mem_violations(op, base, world_size=WORLD) == []
    issues = rules.symm_mem_violations(op, mutate(base), world_size=WORLD)
    assert any(needle in i for i in issues), issues


def test_rowwise_all_gather_needs_aligned_scale_slices() -> None:
    a, w = _fp8("rowwise")
    args = dict(sm.window_call("all_gather", a, w, group_name="0", world_size=WORLD, out_dtype=torch.float32).call.args)
    args["A"], args["A_scale"] = args["A"][:30], args["A_scale"][:30]
    assert any("16-byte aligned" in i for i in rules.symm_mem_violations(rules.AG_SCALED, args, world_size=WORLD))


def test_strict_mode_and_run_check(tp_settings) -> None:
    args = _rs_args()
    args["reduce_op"] = "max"
    call = sm.SymmMemCall(rules.RS_SCALED, args, WORLD)
    tp_settings(**{STRICT_ENV: None})
    sm.check_strict(call)  # off: no check
    tp_settings(**{STRICT_ENV: "1"})
    with pytest.raises(CudaConformanceError, match="reduce_op"):
        sm.check_strict(call)
    # run() always checks first: the op itself is never reached with a broken call.
    tp_settings(**{STRICT_ENV: "0"})
    with pytest.raises(CudaConformanceError, match="would reject"):
        call.run()


# ------------------------------------------------------------------ two ranks: torch's reference semantics


def _reference_op(op: str):
    """PyTorch's own reference implementation of ``op`` (the fallback its CUDA kernel runs
    in test mode), callable with the schema's argument names."""
    import torch.distributed._symmetric_memory as symm

    fn = {rules.AG: symm._fused_all_gather_matmul_fallback, rules.AG_SCALED: symm._fused_all_gather_scaled_matmul_fallback,
          rules.RS: symm._fused_matmul_reduce_scatter_fallback,
          rules.RS_SCALED: symm._fused_scaled_matmul_reduce_scatter_fallback}[op]
    params = list(inspect.signature(fn).parameters.values())
    names = [n for n, _ in rules.SCHEMA_ARGS[op]]

    def call(**kw):
        pos = [kw[n] for n, p in zip(names, params) if p.kind != p.KEYWORD_ONLY and n in kw]
        kwonly = {p.name: kw[n] for n, p in zip(names, params) if p.kind == p.KEYWORD_ONLY and n in kw}
        return fn(*pos, **kwonly)

    return call


def _gloo_moves_fp8_as_bytes() -> None:
    """gloo has no float8 type (NCCL moves float8 as uint8): the reference ops' functional
    all-gather gets the bytes, as NCCL would see them. Spawned ranks only."""
    ns = torch.ops._c10d_functional
    orig, wait = ns.all_gather_into_tensor, ns.wait_tensor

    def all_gather_into_tensor(t, group_size, group_name):
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return orig(t, group_size, group_name)
        return wait(orig(t.view(torch.uint8), group_size, group_name)).view(t.dtype)

    ns.all_gather_into_tensor = all_gather_into_tensor


def _rank_reference(rank: int, world: int) -> dict:
    sm._op = _reference_op  # the ops' CPU-runnable reference, in this spawned rank only
    _gloo_moves_fp8_as_bytes()
    group_name = sm.group_name_of(None)
    out = {}
    gen = torch.Generator().manual_seed(7)
    x_all = torch.randn(world * M, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    for kind in ("hp", "tensorwise", "rowwise"):
        for mode in ("all_gather", "reduce_scatter"):
            if mode == "all_gather":
                x_loc = x_all[rank * M:(rank + 1) * M]
                w_loc = w
            else:  # row-parallel: this rank's input features
                kk = K // world
                x_loc = x_all[:, rank * kk:(rank + 1) * kk].contiguous()
                w_loc = w[:, rank * kk:(rank + 1) * kk].contiguous()
            if kind == "hp":
                a, wq = x_loc, w_loc
                deq_a, deq_w = a, wq
            elif kind == "tensorwise":
                # One scale on every rank (what the window guarantees for an FP8 all-gather).
                qa = CurrentScalingQuantizer(Float8CurrentScaling(), "input", amax_reduction_group=dist.group.WORLD)
                a = qa.quantize(x_loc)
                wq = CurrentScalingQuantizer(Float8CurrentScaling(), "weight").quantize(w_loc)
                deq_a, deq_w = a.dequantize(), wq.dequantize()
            else:
                a = BlockScalingQuantizer(Float8RowwiseScaling(), "input").quantize(x_loc)
                wq = BlockScalingQuantizer(Float8RowwiseScaling(), "weight").quantize(w_loc)
                deq_a, deq_w = a.dequantize(), wq.dequantize()
            call = sm.window_call(mode, a, wq, group_name=group_name, world_size=world, out_dtype=torch.float32,
                                  bias=bias, return_a=True)
            assert call.call.violations() == [], (kind, mode, call.call.violations())
            gathered, y = call.run()
            # The unfused window from the same (dequantized) operands.
            if mode == "all_gather":
                parts = [torch.empty_like(deq_a) for _ in range(world)]
                dist.all_gather(parts, deq_a.contiguous())
                ref = torch.cat(parts) @ deq_w.t() + bias
            else:
                full = deq_a @ deq_w.t() + bias
                ref = torch.empty(full.shape[0] // world, N)
                dist.reduce_scatter_tensor(ref, full)
            out[(kind, mode)] = (float((y - ref).abs().max()), float(ref.abs().max()), tuple(y.shape),
                                 None if gathered is None else tuple(gathered.shape))
    return out


@pytest.mark.multirank
def test_built_calls_compute_the_window_through_torchs_reference() -> None:
    results = run_distributed(WORLD, _rank_reference)
    for res in results:
        for (kind, mode), (err, scale, shape, gathered) in res.items():
            assert shape == ((WORLD * M, N) if mode == "all_gather" else (M, N)), (kind, mode)
            if mode == "all_gather":
                assert gathered == (WORLD * M, K), (kind, mode)
            assert err <= 1e-4 * scale, (kind, mode, err, scale)
