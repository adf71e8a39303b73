"""NVFP4 (``NVFP4BlockScaling``) on one process: the recipe's TE fields, quantize / dequantize
bit-exact against a float64 reference of the spec (E2M1 rounding with ties, saturation,
zero blocks, E4M3 block scales, the per-tensor scale), stochastic rounding unbiased in
expectation, the random Hadamard transform (orthogonal, wgrad unchanged), GEMMs against
float64, BasicLinear under autocast, FP8 parameters, the wire packing, statistics and
DisableFP8GEMM."""

from __future__ import annotations

import math

import pytest
import torch

import tp_fuse
from tolerances import NVFP4_REL_NORM, assert_close
from tp_fuse import ops
from tp_fuse.quantization import BlockScaledTensor, NVFP4Quantizer, fp8_gemm
from tp_fuse.quantization.block import wire as block_wire
from tp_fuse.quantization.block.gemm import emulated_block_gemm
from tp_fuse.quantization.nvfp4.scaling import (
    FP4_VALUES,
    apply_rht,
    decode_e2m1,
    encode_e2m1,
    pack_fp4,
    rht_matrix,
    unpack_fp4,
)
from tp_fuse.quantization.op_quantizers import make_quantizer
from tp_fuse.recipe import DelayedScaling, Format, NVFP4BlockScaling, QParams

F32_MAX = torch.finfo(torch.float32).max


def _gen(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.double()).norm() / ref.double().norm())


# ---------------------------------------------------------------- float64 reference of the spec

_ALL_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
_E4M3_GRID = torch.unique(_ALL_E4M3[torch.isfinite(_ALL_E4M3)].abs())  # 0 .. 448, sorted


def _nearest_even(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index into the sorted non-negative ``grid`` nearest to ``v >= 0`` (ties: even index).

    Brute force over the whole grid in float64 -- independent of the code under test."""
    d = (v[..., None] - grid).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = d == best
    idx = torch.arange(grid.numel()).expand_as(cand)
    # Two candidates = a tie: keep the even one (E2M1 codes / E4M3 mantissas: the even index).
    even = cand & (idx % 2 == 0)
    return torch.where(even.any(-1), (even * idx).sum(-1), (cand * idx).sum(-1))


def _ref_quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(values [R, C] float64 of the E2M1 codes, block scales float64, amax) per the spec.

    The per-tensor and per-block scale factors follow the spec's fp32 steps; every rounding
    to E4M3 and E2M1 is an explicit float64 nearest-even search."""
    x = x.double()
    r, c = x.shape
    br, bc = block
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    amax = f32(x.abs().max().item())
    s_enc = f32(448.0 * 6.0) / amax
    s_enc = torch.clamp(s_enc, max=F32_MAX)
    s_enc = f32(1.0) if s_enc.item() == 0 else s_enc
    s_dec = f32(1.0) / s_enc
    mult = s_enc * (f32(1.0) / f32(6.0))
    blk = x.reshape(r // br, br, c // bc, bc).abs().amax(dim=(1, 3)).float()
    pre = torch.clamp(blk * mult, max=448.0).double()
    scales = _E4M3_GRID[_nearest_even(pre, _E4M3_GRID)]
    enc = torch.clamp(1.0 / (scales.float() * s_dec), max=F32_MAX)
    enc_el = enc.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    scaled = (x.float() * enc_el).double().clamp(-6.0, 6.0)
    grid = torch.tensor(FP4_VALUES, dtype=torch.float64)
    mag = grid[_nearest_even(scaled.abs(), grid)]
    return torch.where(scaled < 0, -mag, mag), scales, float(amax)


def _codes_values(payload) -> torch.Tensor:
    return decode_e2m1(unpack_fp4(payload.data), torch.float64)


# ---------------------------------------------------------------- recipe and names


def test_recipe_fields_follow_transformer_engine(monkeypatch):
    r = NVFP4BlockScaling()
    assert (r.fp4_format, r.fp8_format, r.fp8_dpa, r.fp8_mha) == (Format.E2M1, Format.E4M3, False, False)
    assert not (r.disable_rht or r.disable_stochastic_rounding or r.disable_2d_quantization)
    assert r.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert r.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    assert r.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True, stochastic_rounding=True)
    off = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    assert off.fp4_quant_fwd_inp == off.fp4_quant_fwd_weight == off.fp4_quant_bwd_grad == QParams()
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    assert NVFP4BlockScaling().disable_rht is True  # TE's environment default
    assert Format.E2M1.value == (6, 6) and Format.E2M1.fwd_dtype == torch.float4_e2m1fn_x2
    assert tp_fuse.DType.kFloat4E2M1.value == torch.float4_e2m1fn_x2


@pytest.mark.parametrize("make, needle", [
    (lambda: NVFP4BlockScaling(fp4_format=Format.E4M3), "fp4_format"),
    (lambda: NVFP4BlockScaling(fp8_format=Format.HYBRID), "fp8_format"),
    (lambda: NVFP4BlockScaling(nvfp4_4over6="yes"), "nvfp4_4over6.*expected .none., .weights., .activations. or .all."),
    # Accepted at construction (TE's code builds it), refused where it would be used.
    (lambda: tp_fuse.autocast(recipe=NVFP4BlockScaling(row_scaled_activation=True)).__enter__(),
     "row_scaled_activation"),
    (lambda: NVFP4BlockScaling(disable_rht=1), "disable_rht"),
    (lambda: DelayedScaling(fp8_format=Format.E2M1), "E2M1"),
    (lambda: NVFP4Quantizer(fp4_dtype=tp_fuse.DType.kFloat8E4M3), "fp4_dtype"),
    (lambda: NVFP4Quantizer(row_scaled_nvfp4=True), "row_scaled_nvfp4"),
])
def test_validation_names_the_field(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


# ---------------------------------------------------------------- quantize / dequantize exactness


def test_e2m1_rounding_ties_to_even_and_saturation_by_hand():
    v = torch.tensor([0.0, -0.0, 0.25, 0.2501, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, -0.25, -0.1, -5.0, -2.6])
    got = decode_e2m1(encode_e2m1(v))
    want = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -0.0, -4.0, -3.0])
    assert torch.equal(got, want)
    # -0.0 is code 0; small negatives keep the sign bit (code 8 = -0).
    assert encode_e2m1(torch.tensor([-0.0, -0.1])).tolist() == [0, 8]


def test_packing_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.view(torch.uint8).tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_fp4(packed), codes)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
@pytest.mark.parametrize("seed, scale", [(1, 1.0), (2, 1e-3), (3, 300.0)])
def test_quantize_matches_float64_reference_bitwise(block, seed, scale):
    x = _gen(seed, 48, 64, scale=scale).float()
    x[5, :16] = 0.0  # an all-zero 1x16 block
    x[16:32, 16:32] = 0.0  # an all-zero 16x16 tile
    q = NVFP4Quantizer(with_2d_quantization=block == (16, 16))(x)
    vals, scales, amax = _ref_quantize(x, block)
    p = q._rowwise
    assert float(p.amax) == amax
    assert torch.equal(p.scale_inv.double(), scales)
    assert torch.equal(_codes_values(p), vals)
    # Zero blocks: scale 0, values 0, dequantized 0, nothing non-finite.
    assert float(p.scale_inv.float()[5, 0] if block == (1, 16) else p.scale_inv.float()[1, 1]) == 0.0
    deq = q.dequantize()
    assert torch.isfinite(deq).all() and (deq[16:32, 16:32] == 0).all()
    # Dequantize = TE's kernel: e2m1 * (fp32(scale) * amax * fp32(1/2688)).
    factor = torch.tensor(1 / 2688.0, dtype=torch.float32)
    per = (p.scale_inv.float() * torch.tensor(amax, dtype=torch.float32) * factor)
    per = per.repeat_interleave(block[0], 0).repeat_interleave(16, 1)
    assert torch.equal(deq, vals.float() * per)


def test_ties_and_saturation_in_a_quantized_tensor():
    # amax 2688 gives S_enc = 1; a block with amax 6 gets block scale 1 (6 * fp32(1/6) rounds to 1
    # in E4M3), so its values reach the E2M1 rounding unscaled: the ties are exact.
    x = torch.zeros(1, 32)
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0, 0, 0, 0])
    x[0, 16] = 2688.0
    x[0, 17] = 1.0  # second block: scale 448, 1/448 * 1 -> 0.0022 -> flushes to 0
    p = NVFP4Quantizer(columnwise=False)(x)._rowwise
    assert p.scale_inv.float().tolist() == [[1.0, 448.0]]
    assert _codes_values(p)[0, :12].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -2.0, -4.0]
    # Saturation: a block whose E4M3 scale rounds down scales its max above 6 -> clamped to 6.
    y = torch.zeros(1, 16)
    y[0, 0], y[0, 1] = 2688.0 * (1 + 2.0**-5), 1.0  # block scale 448*(1+2^-5) -> E4M3 448 (rounded down)
    py = NVFP4Quantizer(columnwise=False)(y)._rowwise
    assert float(py.scale_inv.float()[0, 0]) == 448.0 and _codes_values(py)[0, 0].item() == 6.0


def test_all_zero_tensor_quantizes_to_zero():
    q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)(torch.zeros(32, 32))
    assert (q.dequantize() == 0).all() and (q._columnwise.dequantize() == 0).all()


def test_columnwise_copy_is_quantized_from_high_precision():
    x = _gen(4, 32, 64).float()
    q = NVFP4Quantizer()(x)  # no RHT: the column-wise copy is x.T quantized directly
    vals, scales, _ = _ref_quantize(x.t().contiguous(), (1, 16))
    assert torch.equal(_codes_values(q._columnwise), vals)
    assert torch.equal(q._columnwise.scale_inv.double(), scales)


# ---------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_unbiased_and_stays_between_neighbours():
    torch.manual_seed(1234)
    # Every 1x16 block: one 6.0 (block scale 1 under a 2688 tensor amax) and 15 copies of v.
    vs = [0.3, 1.1, 2.2, 3.3, 4.7, -5.5, -0.05]
    n = 4096
    x = torch.empty(n, 16 * len(vs))
    for i, v in enumerate(vs):
        x[:, 16 * i] = 6.0
        x[:, 16 * i + 1:16 * (i + 1)] = v
    x[0, 0] = 2688.0
    q = NVFP4Quantizer(stochastic_rounding=True)._quantize_impl(x)
    vals = _codes_values(q._rowwise)[1:]  # row 0 has the 2688 block
    grid = torch.tensor(sorted(set(FP4_VALUES) | {-g for g in FP4_VALUES}), dtype=torch.float64)
    for i, v in enumerate(vs):
        got = vals[:, 16 * i + 1:16 * (i + 1)].reshape(-1)
        lo, hi = grid[grid <= v].max().item(), grid[grid >= v].min().item()
        assert set(got.abs().unique().tolist()) <= {abs(lo), abs(hi)}, v
        # Unbiased: the mean is v within 6 standard errors (p(1-p) (hi-lo)^2 / N).
        p = (v - lo) / (hi - lo)
        se = math.sqrt(p * (1 - p) / got.numel()) * (hi - lo)
        assert abs(got.mean().item() - v) <= 6 * se + 1e-12, (v, got.mean().item(), se)
    # Round to nearest would be biased for 0.3 (-> 0.5 always): SR actually happened.
    assert vals[:, 1:16].unique().numel() == 2


def test_stochastic_rounding_is_reproducible_with_the_torch_seed():
    q = NVFP4Quantizer(stochastic_rounding=True, with_rht=True, with_post_rht_amax=True)
    x = _gen(5, 64, 32).float()
    torch.manual_seed(7)
    a = q._quantize_impl(x, transpose=True)
    torch.manual_seed(7)
    b = q._quantize_impl(x, transpose=True)
    c = q._quantize_impl(x, transpose=True)
    for which in ("_rowwise", "_columnwise"):
        assert torch.equal(getattr(a, which).data.view(torch.uint8), getattr(b, which).data.view(torch.uint8))
    assert not torch.equal(a._rowwise.data.view(torch.uint8), c._rowwise.data.view(torch.uint8))


# ---------------------------------------------------------------- random Hadamard transform


def test_rht_matrix_is_orthogonal_with_te_signs():
    m = rht_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))  # exact: entries are +-1/4
    assert set(m.abs().unique().tolist()) == {0.25}
    assert torch.equal(torch.sign(m[:, 0]), torch.tensor([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1.0]))


def test_rht_leaves_the_wgrad_product_unchanged_in_exact_arithmetic():
    x, dy = _gen(6, 64, 48), _gen(7, 64, 32)
    m = rht_matrix()
    blocks = torch.block_diag(*([m] * 4))  # 64 tokens = 4 runs of 16
    xt, dyt = x.t() @ blocks, dy.t() @ blocks
    assert_close(dyt @ xt.t(), dy.t() @ x, torch.float64)
    # apply_rht is that transform, rounded once to fp32.
    assert torch.equal(apply_rht(x.t().float()), (x.t().float().double() @ blocks).float())


def test_wgrad_with_rht_stays_close_to_float64():
    x, dy = _gen(8, 128, 64).float(), _gen(9, 128, 32).float()
    x[:, 3] *= 50.0  # an outlier channel: the RHT spreads it over its 16-token runs
    torch.manual_seed(0)
    for rht in (True, False):
        r = NVFP4BlockScaling(disable_rht=not rht, disable_stochastic_rounding=True)
        qx = make_quantizer(r, "input").quantize(x, transpose=True)
        qdy = make_quantizer(r, "grad_output").quantize(dy, transpose=True)
        assert (qx._columnwise is not None) and (qx._rowwise.amax == x.abs().max())
        dw = fp8_gemm(qdy.transpose_fp8(), qx.transpose_fp8(), torch.float32)
        assert _rel(dw, dy.double().t() @ x.double()) < NVFP4_REL_NORM, rht


# ---------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("two_d", [False, True])
def test_gemm_equals_float64_of_the_scaled_operands(two_d):
    x, w, b = _gen(10, 48, 128).float(), _gen(11, 80, 128, scale=0.05).float(), _gen(12, 80).float()
    a = NVFP4Quantizer()(x)
    bq = NVFP4Quantizer(with_2d_quantization=two_d)(w)
    y = fp8_gemm(a, bq, torch.float32, bias=b)
    # Exact per-element products (e2m1 * e4m3) in float64, the global alpha, the bias.
    pa, pb = a._rowwise, bq._rowwise
    va = _codes_values(pa) * pa.scale_inv.double().repeat_interleave(16, 1)
    vb = _codes_values(pb) * pb.scale_inv.double().repeat_interleave(pb.spec.rows, 0)[:80].repeat_interleave(16, 1)
    alpha = float(pa.amax) * float(pb.amax) / (6 * 6 * 448 * 448)
    assert_close(y, alpha * (va @ vb.t()) + b.double(), torch.float32)
    assert _rel(y, x.double() @ w.double().t() + b.double()) < NVFP4_REL_NORM
    assert torch.equal(emulated_block_gemm(pa, pb, torch.float32, b), y)


@pytest.mark.gpu
def test_cuda_nvfp4_gemm_needs_sm100():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the NVFP4 scaled_mm path (sm100+) and its error elsewhere are CUDA-only")
    a = NVFP4Quantizer()(torch.randn(32, 64, device="cuda"))
    if torch.cuda.get_device_capability()[0] < 10:
        with pytest.raises(ValueError, match="sm100"):
            fp8_gemm(a, a, torch.float32)
    else:
        assert _rel(fp8_gemm(a, a, torch.float32).cpu(), emulated_block_gemm(
            a._rowwise, a._rowwise, torch.float64).cpu()) < 1e-5


# ---------------------------------------------------------------- ops, parameters, wire, stats


def test_basic_linear_under_nvfp4_autocast_matches_float64():
    torch.manual_seed(0)
    lin = ops.BasicLinear(128, 64)
    x = _gen(13, 2, 32, 128).float().requires_grad_()
    dy = _gen(14, 2, 32, 64).float()
    with tp_fuse.autocast(recipe=NVFP4BlockScaling()):
        y = lin(x)
    y.backward(dy)
    w64, x64, dy64 = lin.weight.detach().double(), x.detach().double().reshape(-1, 128), dy.double().reshape(-1, 64)
    assert _rel(y.reshape(-1, 64), x64 @ w64.t()) < NVFP4_REL_NORM
    assert _rel(x.grad.reshape(-1, 128), dy64 @ w64) < NVFP4_REL_NORM
    assert _rel(lin.weight.grad, dy64.t() @ x64) < NVFP4_REL_NORM
    # The FP4 GEMMs ran: results differ from the high-precision ones.
    assert not torch.allclose(y.reshape(-1, 64).double(), x64 @ w64.t(), rtol=1e-3, atol=1e-3)


def test_quantized_model_init_master_optimizer_state_dict():
    r = NVFP4BlockScaling()
    with tp_fuse.quantized_model_init(recipe=r):
        lin = ops.BasicLinear(64, 32)
    w = lin.weight
    assert isinstance(w, BlockScaledTensor) and isinstance(w, torch.nn.Parameter) and w.recipe_name == "nvfp4"
    assert w.fp8_dtype == torch.float4_e2m1fn_x2 and w._rowwise.spec.rows == 16 and w._columnwise is not None
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    with tp_fuse.autocast(recipe=r):
        lin(torch.randn(16, 64)).square().sum().backward()
    before = w.master.clone()
    opt.step()
    assert not torch.equal(w.master, before)
    fresh = w.quantizer.quantize(w.master, transpose=True)
    for which in ("_rowwise", "_columnwise"):
        mine, new = getattr(w, which), getattr(fresh, which)
        assert torch.equal(mine.data.view(torch.uint8), new.data.view(torch.uint8))
        assert torch.equal(mine.scale_inv.float(), new.scale_inv.float()) and torch.equal(mine.amax, new.amax)
    with tp_fuse.quantized_model_init(recipe=r):
        other = ops.BasicLinear(64, 32)
    other.load_state_dict(lin.state_dict())
    assert torch.equal(other.weight.master, w.master)
    v = w.detach().reshape(2, 16, 64)
    assert isinstance(v, BlockScaledTensor) and torch.equal(v.dequantize(), w.dequantize().reshape(2, 16, 64))


def test_wire_round_trip_bytes_and_amax_check():
    x = _gen(15, 64, 128).float()
    t = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)(x)
    w = block_wire.rowwise_wire(t)
    assert w.dtype == torch.uint8 and w.shape == (64, 128 // 2 + 128 // 16 + 4)  # FP4 + E4M3 scales + amax
    assert block_wire.wire_bytes_per_element(t) == (64 + 8 + 4) / 128
    part = block_wire.rowwise_from_wire(w[16:40], t)
    assert torch.equal(part.dequantize(), t.dequantize()[16:40])
    col = block_wire.columnwise_from_wire(block_wire.columnwise_wire(t), t)
    for a, b in ((col._columnwise.data.view(torch.uint8), t._columnwise.data.view(torch.uint8)),
                 (col._columnwise.scale_inv.float(), t._columnwise.scale_inv.float()),
                 (col._columnwise.amax, t._columnwise.amax)):
        assert torch.equal(a, b)
    bad = w.clone()
    bad[3, -4:] = torch.tensor([1.0]).view(torch.uint8)  # another rank's amax
    with pytest.raises(ValueError, match="different per-tensor amaxes"):
        block_wire.rowwise_from_wire(bad, t)


def test_block_stats_and_nonfinite_count():
    from tp_fuse.debug.stats import block_fp8_components

    x = _gen(16, 16, 64).float()
    q = make_quantizer(NVFP4BlockScaling(), "input")
    t = q.quantize(x, transpose=True)
    c = block_fp8_components(x, t)
    eff = t._rowwise.scale_inv.double() * float(t._rowwise.amax) / 2688.0
    assert c["scale_inv_max"].item() == pytest.approx(eff.max().item(), rel=1e-6)
    assert c["sqerr"].item() == pytest.approx((t.dequantize().double() - x.double()).square().sum().item(), rel=1e-9)
    assert q.stats()["amax"] == pytest.approx(x.abs().max().item())
    x[0, 0] = float("inf")
    q.quantize(x, transpose=True)
    assert int(q.nonfinite_amax_count) == 1


@pytest.mark.parametrize("gemms", [["fprop"], ["dgrad", "wgrad"]])
def test_disable_fp8_gemm_with_nvfp4(gemms):
    from tp_fuse.debug import DebugSession

    def linear():
        torch.manual_seed(0)
        return ops.Sequential(ops.BasicLinear(64, 32, userbuffers_options={"comm_name": "fc1"}))

    x, g = _gen(20, 32, 64).float(), _gen(21, 32, 32).float()

    def run(model, fp8):
        torch.manual_seed(1)  # the same stochastic-rounding seeds in every run
        xx = x.clone().requires_grad_()
        with tp_fuse.autocast(recipe=NVFP4BlockScaling(), enabled=fp8):
            y = model(xx)
        (y * g).sum().backward()
        return y.detach(), xx.grad, next(model.parameters()).grad

    hp, q = run(linear(), False), run(linear(), True)
    model = linear()
    DebugSession({"sec": {"layers": {"layer_name_regex_pattern": ".*fc1"},
                          "transformer_engine": {"DisableFP8GEMM": {"gemms": gemms}}}}).attach(model)
    dbg = run(model, True)
    for i, gemm in enumerate(("fprop", "dgrad", "wgrad")):
        assert torch.equal(dbg[i], hp[i] if gemm in gemms else q[i]), gemm
    assert not torch.equal(hp[0], q[0]) and not torch.equal(hp[2], q[2])  # NVFP4 GEMMs did run
