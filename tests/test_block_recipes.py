"""Block-scaled and row-wise recipes on one process: recipes, scale rules against hand-computed
blocks and a float64 per-block reference, both copies from high precision, GEMM emulation,
BasicLinear under autocast, FP8 parameters (quantized_model_init), wire packing."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import tp_fuse
from tolerances import FP8_UNIT_ROUNDOFF, assert_close, assert_fp8_matmul_close
from tp_fuse import ops
from tp_fuse.quantization import BlockScaledTensor, BlockScalingQuantizer, fp8_gemm
from tp_fuse.quantization.block import wire as block_wire
from tp_fuse.quantization.block.gemm import BlockPayload, blockwise_scaled_mm, emulated_block_gemm, swizzle_mx_scales
from tp_fuse.quantization.block.scaling import BlockSpec, ScaleRule, quantize_blocks
from tp_fuse.quantization.op_quantizers import make_quantizer
from tp_fuse.recipe import (
    Float8BlockScaling,
    Float8RowwiseScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    QParams,
)

RECIPES = [Float8BlockScaling(), MXFP8BlockScaling(), Float8RowwiseScaling()]
IDS = ["blockwise", "mxfp8", "rowwise"]
E4M3 = torch.float8_e4m3fn


def _gen(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


# ---------------------------------------------------------------- recipes


def test_recipe_fields_and_defaults_follow_transformer_engine():
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert r.fp8_quant_fwd_weight == r.fp8_quant_bwd_grad == r.fp8_quant_fwd_inp
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    assert r.fp8_gemm_fprop == r.fp8_gemm_dgrad == r.fp8_gemm_wgrad == MMParams(use_split_accumulator=True)
    assert not r.fp8_dpa and not r.fp8_mha
    m = MXFP8BlockScaling()
    assert (m.margin, m.fp8_format, m.fp8_dpa, m.fp8_mha) == (0, Format.E4M3, False, False)
    assert Float8RowwiseScaling().power_2_scale is True
    # Equal recipes are interchangeable (quantizer state is reused).
    assert Float8BlockScaling() == Float8BlockScaling()


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: Float8BlockScaling(fp8_format=Format.E5M2), "E5M2"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=3), "expected 1 or 2"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=2), "2-D by 2-D"),
        (lambda: Float8BlockScaling(fp8_gemm_wgrad=MMParams(False)), "use_split_accumulator"),
        (lambda: Float8BlockScaling(fp8_quant_fwd_inp=True), "recipe.QParams"),
        (lambda: QParams(amax_epsilon=-1.0), "amax_epsilon"),
        (lambda: MXFP8BlockScaling(margin=1), "margin"),
        (lambda: MXFP8BlockScaling(fp8_mha=True), "fp8_dpa/fp8_mha"),
        (lambda: Float8RowwiseScaling(power_2_scale=1), "power_2_scale"),
    ],
)
def test_recipe_validation_names_the_field(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


# ---------------------------------------------------------------- scale rules


def _e4m3_round(x64: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even to E4M3, as float64 (torch's cast is RNE)."""
    return x64.clamp(-448, 448).to(E4M3).double()


def _reference_blocks(x: torch.Tensor, br: int, bc: int, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block float64 loop: (dequantized x, scale_inv per block)."""
    r, c = x.shape
    out = torch.empty_like(x)
    scales = torch.empty(math.ceil(r / br), math.ceil(c / bc), dtype=torch.float64)
    for i in range(0, r, br):
        for j in range(0, c, bc):
            blk = x[i : i + br, j : j + bc]
            amax = blk.abs().max().item()
            if rule == "pow2":
                s = 1.0 if amax == 0 else 2.0 ** math.floor(math.log2(448.0 / amax))
                inv = 1.0 / s
            else:  # OCP MX E8M0, emax(E4M3) = 8
                inv = 2.0**-127 if amax == 0 else 2.0 ** max(-127, min(127, math.floor(math.log2(amax)) - 8))
            scales[i // br, j // bc] = inv
            out[i : i + br, j : j + bc] = _e4m3_round(blk / inv) * inv
    return out, scales


@pytest.mark.parametrize(
    "spec, rule, kind",
    [
        (BlockSpec(1, 128), ScaleRule("fp32", power_2=True), "pow2"),
        (BlockSpec(128, 128), ScaleRule("fp32", power_2=True), "pow2"),
        (BlockSpec(1, 32), ScaleRule("e8m0"), "e8m0"),
        (BlockSpec(1, None), ScaleRule("fp32", power_2=True), "pow2"),
    ],
)
def test_quantize_blocks_matches_float64_per_block_reference(spec, rule, kind):
    # Ragged shapes (partial last blocks), a zero block, and blocks of very different magnitude.
    x = _gen(1, 130, 200) * torch.logspace(-3, 3, 200, dtype=torch.float64)
    x[:, :32] = 0.0
    data, scale_inv = quantize_blocks(x.float(), spec, E4M3, rule)
    bc = spec.cols_for(200)
    ref, ref_scales = _reference_blocks(x.float().double(), spec.rows, bc, kind)
    got = data.double() * scale_inv.double().repeat_interleave(spec.rows, 0)[:130].repeat_interleave(bc, 1)[:, :200]
    assert torch.equal(scale_inv.double(), ref_scales)
    assert torch.equal(got, ref)


def test_hand_computed_blockwise_block():
    # One 1x128 block with amax 3: scale = 2**floor(log2(448/3)) = 128, scale_inv = 1/128.
    x = torch.linspace(-3.0, 3.0, 128).reshape(1, 128)
    data, s = quantize_blocks(x, BlockSpec(1, 128), E4M3, ScaleRule("fp32", power_2=True))
    assert s.item() == 1 / 128
    assert torch.equal(data.float(), (x * 128).to(E4M3).float())
    # Without power-of-two rounding: exactly fp8_max / amax.
    _, s = quantize_blocks(x, BlockSpec(1, 128), E4M3, ScaleRule("fp32", power_2=False))
    assert s.item() == pytest.approx(3 / 448, rel=1e-7)
    # amax_epsilon raises tiny amaxes: amax 1e-6 -> treated as 1e-3.
    _, s = quantize_blocks(torch.full((1, 128), 1e-6), BlockSpec(1, 128), E4M3,
                           ScaleRule("fp32", power_2=False, amax_epsilon=1e-3))
    assert s.item() == pytest.approx(1e-3 / 448, rel=1e-6)


def test_e8m0_scales_follow_the_ocp_mx_rule():
    spec, rule = BlockSpec(1, 32), ScaleRule("e8m0")
    # amax 1 -> X = 2**(0 - 8); amax 500 -> X = 2**(8 - 8) = 1 and 500 saturates to 448;
    # amax 0 -> smallest E8M0 (2**-127); NaN amax -> E8M0 NaN.
    rows = torch.zeros(4, 32)
    rows[0, 0], rows[1, 0], rows[3, 0] = 1.0, 500.0, float("nan")
    data, s = quantize_blocks(rows, spec, E4M3, rule)
    assert s.dtype == torch.float8_e8m0fnu
    sf = s.float().flatten()
    assert sf[0].item() == 2.0**-8 and sf[1].item() == 1.0 and sf[2].item() == 2.0**-127
    assert math.isnan(sf[3].item())
    assert data[0, 0].float().item() == 256.0  # 1 / 2**-8
    assert data[1, 0].float().item() == 448.0  # saturated, as OCP's conversion prescribes
    # E5M2: emax_elem = 15.
    _, s = quantize_blocks(rows[:1], spec, torch.float8_e5m2, rule)
    assert s.float().item() == 2.0**-15


def test_e8m0_exponent_is_exact_next_to_powers_of_two():
    # Regression: exp2(floor(log2(v))) in fp32 gave 2**k for the float just below 2**k
    # (log2 rounds up to k), i.e. a scale above the power-of-two floor (fp32 rule) and an
    # E8M0 exponent one too large (MX rule). Exact: clear the mantissa / frexp.
    k = list(range(-12, 12))
    below = [float(torch.nextafter(torch.tensor(2.0**i), torch.tensor(0.0))) for i in k]
    rows = torch.zeros(len(k), 32)
    rows[:, 0] = torch.tensor(below)
    _, s = quantize_blocks(rows, BlockSpec(1, 32), E4M3, ScaleRule("e8m0"))
    assert s.float().flatten().tolist() == [2.0 ** (math.floor(math.log2(b)) - 8) for b in below]


def test_power_of_two_scale_is_the_floor_next_to_powers_of_two():
    # fp32 power-of-two rule: amax just above 448 / 2**k, so 448 / amax is just below 2**k.
    k = list(range(-12, 12))
    amax = [float(torch.nextafter(torch.tensor(448.0 / 2.0**i), torch.tensor(math.inf))) for i in k]
    rows = torch.zeros(len(k), 128)
    rows[:, 0] = torch.tensor(amax)
    _, s = quantize_blocks(rows, BlockSpec(1, 128), E4M3, ScaleRule("fp32", power_2=True))
    assert s.flatten().tolist() == [2.0 ** -math.floor(math.log2(448.0 / a)) for a in amax]


def test_fp32_scale_is_one_correctly_rounded_division():
    # Regression: ``fp8_max / amax`` with a Python float is reciprocal(amax) * fp8_max in
    # torch (two roundings); TE's scale is the IEEE quotient. numpy's float32 division is.
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(5), dtype=torch.float32) * 100 + 1e-3
    x = torch.zeros(4096, 128)
    x[:, 0] = amax
    _, s = quantize_blocks(x, BlockSpec(1, 128), E4M3, ScaleRule("fp32", power_2=False))
    scale = np.float32(448.0) / amax.numpy()
    assert np.array_equal(s.flatten().numpy(), np.float32(1.0) / scale)


def test_rowwise_has_one_power_of_two_scale_per_row():
    x = _gen(2, 8, 300).float()
    q = make_quantizer(Float8RowwiseScaling(), "input").quantize(x, transpose=True)
    s = q._rowwise.scale_inv
    assert s.shape == (8, 1) and q._columnwise.scale_inv.shape == (300, 1)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    amax = x.abs().amax(1, keepdim=True)
    assert torch.equal(s, 1 / torch.exp2(torch.floor(torch.log2(448 / amax))))


# ---------------------------------------------------------------- both copies from high precision


def test_columnwise_copy_is_quantized_from_high_precision_not_from_the_rowwise_bytes():
    q = make_quantizer(Float8BlockScaling(), "input")
    # Magnitudes vary along rows and columns, so 1x128 blocks of x and of x.T differ.
    x = (_gen(3, 256, 256) * torch.logspace(-2, 2, 256, dtype=torch.float64)).float()
    t = q.quantize(x, transpose=True)
    direct = quantize_blocks(x.t(), BlockSpec(1, 128), E4M3, q.rule)
    assert torch.equal(t._columnwise.data.view(torch.uint8), direct[0].view(torch.uint8))
    assert torch.equal(t._columnwise.scale_inv, direct[1])
    double = quantize_blocks(t.dequantize().t(), BlockSpec(1, 128), E4M3, q.rule)
    assert not torch.equal(t._columnwise.data.view(torch.uint8), double[0].view(torch.uint8))
    # transpose_fp8 swaps the copies without arithmetic.
    tt = t.transpose_fp8()
    assert tt.shape == (256, 256) and tt._rowwise is t._columnwise and tt._columnwise is t._rowwise


def test_128x128_weight_blocks_are_transposition_invariant():
    w = _gen(4, 256, 384).float()
    t = make_quantizer(Float8BlockScaling(), "weight").quantize(w, transpose=True)
    assert t._rowwise.spec == BlockSpec(128, 128)
    assert torch.equal(t._columnwise.data.view(torch.uint8), t._rowwise.data.t().contiguous().view(torch.uint8))
    assert torch.equal(t._columnwise.scale_inv, t._rowwise.scale_inv.t())


def test_missing_columnwise_copy_is_an_error_not_a_requantization():
    t = make_quantizer(MXFP8BlockScaling(), "input").quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="rowwise copy was not quantized.*transpose=True"):
        fp8_gemm(t, t, torch.float32, transpose_a=True, transpose_b=True)


# ---------------------------------------------------------------- tensor type


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_tensor_views_detach_clone_and_fallback(recipe):
    x = _gen(5, 2, 6, 128).float()
    t = make_quantizer(recipe, "input").quantize(x, transpose=True)
    assert isinstance(t, BlockScaledTensor) and t.shape == x.shape and t.dtype == torch.float32
    v = t.reshape(-1, 128)
    assert isinstance(v, BlockScaledTensor) and v._rowwise is t._rowwise and v._columnwise is t._columnwise
    d = t.detach()
    assert isinstance(d, BlockScaledTensor) and d._rowwise is t._rowwise
    c = t.clone()
    assert c._rowwise.data.data_ptr() != t._rowwise.data.data_ptr() and torch.equal(c.dequantize(), t.dequantize())
    # A view across blocks and any other op compute in high precision.
    assert not isinstance(t.reshape(2, -1), BlockScaledTensor)
    assert_close((t * 2).double(), 2 * t.dequantize().double(), torch.float32)
    assert_close(t.dequantize().double(), x.double(), "fp8_e4m3")


# ---------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_gemm_equals_float64_of_the_dequantized_operands(recipe):
    x, w, b = _gen(6, 48, 256).float(), _gen(7, 80, 256, scale=0.06).float(), _gen(8, 80).float()
    a, bq = make_quantizer(recipe, "input").quantize(x), make_quantizer(recipe, "weight").quantize(w)
    y = tp_fuse.quantization.fp8_gemm(a, bq, torch.float32, bias=b)
    ref = a.dequantize().double() @ bq.dequantize().double().t() + b.double()
    assert_close(y, ref, torch.float32)
    # And within FP8 rounding of the exact product, elementwise: E4M3 unit roundoff 2**-4,
    # except MXFP8, whose OCP scale rule saturates block maxima in [448, 512) * X (<= 12.5%).
    u = 2.0**-3 if isinstance(recipe, MXFP8BlockScaling) else FP8_UNIT_ROUNDOFF["e4m3"]
    assert_fp8_matmul_close(y, x, w, u, u, bias=b)


def test_rowwise_scaled_mm_equals_the_emulation():
    r = Float8RowwiseScaling()
    a = make_quantizer(r, "input").quantize(_gen(9, 32, 64).float())
    b = make_quantizer(r, "weight").quantize(_gen(10, 16, 64).float())
    assert_close(fp8_gemm(a, b, torch.float32), emulated_block_gemm(a._rowwise, b._rowwise, torch.float64),
                 torch.float32)


def test_block_gemm_errors():
    a = make_quantizer(Float8BlockScaling(), "input").quantize(torch.randn(4, 128))
    b = make_quantizer(MXFP8BlockScaling(), "weight").quantize(torch.randn(8, 128))
    with pytest.raises(ValueError, match="different recipes"):
        fp8_gemm(a, b, torch.float32)
    with pytest.raises(ValueError, match="BlockScaledTensor operands"):
        fp8_gemm(a, torch.randn(8, 128), torch.float32)


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("k", [128, 256, 640])
def test_blockwise_scaled_mm_call_passes_torch_checks(gemm, k):
    """The CUDA call's scale layouts, checked by torch's own ``scaled_mm`` shape/stride rules
    on meta tensors (the CUDA kernel's checks). Regression: the first H200 run of a 128x128
    weight failed with "scale_b must have shape 4 x 8 Float elements, got [8, 2]" (128x128
    scales are read K-major, K padded to a multiple of 4)."""
    recipe, tokens, out = Float8BlockScaling(), 256, 1024
    x = make_quantizer(recipe, "input")._quantize_impl(torch.randn(tokens, k), transpose=True)
    w = make_quantizer(recipe, "weight")._quantize_impl(torch.randn(out, k), transpose=True)
    dy = make_quantizer(recipe, "grad_output")._quantize_impl(torch.randn(tokens, out), transpose=True)
    a, b = {"fprop": (x._rowwise, w._rowwise), "dgrad": (dy._rowwise, w._columnwise),
            "wgrad": (dy._columnwise, x._columnwise)}[gemm]
    meta = lambda p: BlockPayload(p.data.to("meta"), p.scale_inv.to("meta"), p.spec)  # noqa: E731
    y = blockwise_scaled_mm(meta(a), meta(b), torch.bfloat16)
    assert y.shape == (a.shape[0], b.shape[0]) and y.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="torch's blockwise scaled_mm needs an sm90 GPU (CI has none)")
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_blockwise_gemm_on_cuda_equals_the_emulation(gemm):
    recipe, (tokens, k, out) = Float8BlockScaling(), (256, 384, 1024)
    quant = {role: make_quantizer(recipe, role) for role in ("input", "weight", "grad_output")}
    x = quant["input"]._quantize_impl(torch.randn(tokens, k, device="cuda"), transpose=True)
    w = quant["weight"]._quantize_impl(torch.randn(out, k, device="cuda"), transpose=True)
    dy = quant["grad_output"]._quantize_impl(torch.randn(tokens, out, device="cuda"), transpose=True)
    a, b = {"fprop": (x._rowwise, w._rowwise), "dgrad": (dy._rowwise, w._columnwise),
            "wgrad": (dy._columnwise, x._columnwise)}[gemm]
    got = blockwise_scaled_mm(a, b, torch.float32).cpu().double()
    cpu = lambda p: BlockPayload(p.data.cpu(), p.scale_inv.cpu(), p.spec)  # noqa: E731
    ref = emulated_block_gemm(cpu(a), cpu(b), torch.float64)
    # Hopper's FP8 tensor cores accumulate in reduced precision and promote per block, so
    # an output near zero can be far off relatively (H200: 0.012 at a value of 0.08, with
    # outputs of magnitude ~20); bounded relative to the output's scale instead, by 2^-8.
    assert (got - ref).abs().max() <= 2.0**-8 * ref.abs().max(), (got - ref).abs().max()


def test_mx_scale_swizzle_layout():
    s = torch.arange(256 * 8, dtype=torch.float32).reshape(256, 8)
    out = swizzle_mx_scales(s)
    assert out.numel() == 256 * 8
    # Tile (row tile rt, col tile ct): element (r, c) at offset (r % 32) * 16 + (r // 32) * 4 + c.
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 3), (128, 4), (200, 6)]:
        rt, ct = r // 128, c // 4
        base = (rt * 2 + ct) * 512
        assert out[base + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4] == s[r, c]


# ---------------------------------------------------------------- BasicLinear under autocast


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_basic_linear_three_gemms_use_the_right_copies(recipe):
    torch.manual_seed(0)
    lin = ops.BasicLinear(256, 128)
    x = _gen(11, 2, 64, 256).float().requires_grad_()
    dy = _gen(12, 2, 64, 128).float()
    with tp_fuse.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    qx = make_quantizer(recipe, "input").quantize(x.detach().reshape(-1, 256), transpose=True)
    qw = make_quantizer(recipe, "weight").quantize(lin.weight.detach(), transpose=True)
    qdy = make_quantizer(recipe, "grad_output").quantize(dy.reshape(-1, 128), transpose=True)
    dq = lambda t: t.dequantize().double()  # noqa: E731
    assert_close(y.reshape(-1, 128), dq(qx) @ dq(qw).t(), torch.float32)
    assert_close(x.grad.reshape(-1, 256), dq(qdy) @ dq(qw.transpose_fp8()).t(), torch.float32)
    assert_close(lin.weight.grad, dq(qdy.transpose_fp8()) @ dq(qx.transpose_fp8()).t(), torch.float32)
    assert lin.kernels_used("forward") == ()  # outside autocast


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_quantized_model_init_master_optimizer_state_dict(recipe):
    with tp_fuse.quantized_model_init(recipe=recipe):
        lin = ops.BasicLinear(128, 256)
    w = lin.weight
    assert isinstance(w, BlockScaledTensor) and isinstance(w, torch.nn.Parameter)
    assert w.master is not None and isinstance(w.quantizer, BlockScalingQuantizer)
    assert w._columnwise is not None  # dgrad reads it
    assert tp_fuse.quantization.is_fp8_parameter(w)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    x = torch.randn(8, 128)
    with tp_fuse.autocast(recipe=recipe):
        lin(x).square().sum().backward()
    master_before = w.master.clone()
    opt.step()
    assert not torch.equal(w.master, master_before)
    # The bytes follow the master (both copies re-quantized from it).
    fresh = w.quantizer.quantize(w.master, transpose=True)
    assert torch.equal(w._rowwise.data.view(torch.uint8), fresh._rowwise.data.view(torch.uint8))
    assert torch.equal(w._columnwise.scale_inv.float(), fresh._columnwise.scale_inv.float())
    # state_dict round trip is master to master; deepcopy keeps the type.
    with tp_fuse.quantized_model_init(recipe=recipe):
        other = ops.BasicLinear(128, 256)
    other.load_state_dict(lin.state_dict())
    assert torch.equal(other.weight.master, w.master)
    assert isinstance(copy.deepcopy(lin).weight, BlockScaledTensor)


# ---------------------------------------------------------------- wire packing


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_wire_round_trip(recipe):
    x = _gen(13, 128, 256).float()
    t = make_quantizer(recipe, "input").quantize(x, transpose=True)
    w = block_wire.rowwise_wire(t)
    scale_bytes = {"blockwise": 4 * 2, "mxfp8": 8, "rowwise": 4}[t.recipe_name]
    assert w.dtype == torch.uint8 and w.shape == (128, 256 + scale_bytes)
    back = block_wire.rowwise_from_wire(w, t)
    assert torch.equal(back._rowwise.data.view(torch.uint8), t._rowwise.data.view(torch.uint8))
    assert torch.equal(back._rowwise.scale_inv.float(), t._rowwise.scale_inv.float())
    # Any row range is a valid chunk (the ring cuts between rows).
    part = block_wire.rowwise_from_wire(w[40:70], t)
    assert torch.equal(part.dequantize(), t.dequantize()[40:70])
    col = block_wire.columnwise_from_wire(block_wire.columnwise_wire(t), t)
    assert torch.equal(col._columnwise.data.view(torch.uint8), t._columnwise.data.view(torch.uint8))
    assert torch.equal(col._columnwise.scale_inv.float(), t._columnwise.scale_inv.float())


def test_columnwise_wire_refuses_blocks_that_would_straddle_ranks():
    t = make_quantizer(Float8BlockScaling(), "input").quantize(torch.randn(64, 128), transpose=True)
    with pytest.raises(ValueError, match="64 rows, not a multiple of 128"):
        block_wire.columnwise_wire(t)


# ---------------------------------------------------------------- FP8 statistics


def test_block_stats_components_hand_computed():
    from tp_fuse.debug.stats import ALL_STATS, block_fp8_components

    # Two MXFP8 blocks: [500, 1, 0...] (X = 1: 500 saturates to 448) and [1e-3, 1e-12, 0...]
    # (X = 2**-18; 1e-12 / X is far below E4M3's smallest subnormal: underflow).
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 32], x[0, 33] = 500.0, 1.0, 1e-3, 1e-12
    q = make_quantizer(MXFP8BlockScaling(), "input").quantize(x)
    c = block_fp8_components(x, q)
    assert c["numel"].item() == 64 and c["overflows"].item() == 1 and c["underflows"].item() == 1
    assert c["scale_inv_min"].item() == 2.0**-18 and c["scale_inv_max"].item() == 1.0
    assert c["sqerr"].item() == pytest.approx(52.0**2 + 1e-24, rel=1e-6)
    finals = {k: ALL_STATS[k][1]({n: float(v) for n, v in c.items()}) for k in ("scale_inv_std", "overflows%")}
    assert finals["overflows%"] == pytest.approx(100 / 64)
    assert finals["scale_inv_std"] == pytest.approx(torch.tensor([1.0, 2.0**-18]).double().std().item())


# ---------------------------------------------------------------- debug API


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("gemms", [["fprop"], ["dgrad", "wgrad"]])
def test_disable_fp8_gemm_with_block_recipes(recipe, gemms):
    from tp_fuse.debug import DebugSession

    def linear():
        torch.manual_seed(0)
        return ops.Sequential(ops.BasicLinear(128, 64, userbuffers_options={"comm_name": "fc1"}))

    x, g = _gen(20, 32, 128).float(), _gen(21, 32, 64).float()

    def run(model, fp8):
        xx = x.clone().requires_grad_()
        with tp_fuse.autocast(recipe=recipe, enabled=fp8):
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
    assert not torch.equal(hp[0], q[0])


def test_nonfinite_block_amax_is_counted():
    # An inf saturates to 448 in the cast, so the count is the only trace (tp_fuse.launch.health reads it).
    q = make_quantizer(Float8BlockScaling(), "input")
    x = torch.ones(2, 256)
    q.quantize(x, transpose=True)
    assert int(q.nonfinite_amax_count) == 0
    x[1, 3] = float("inf")
    q.quantize(x, transpose=True)
    assert int(q.nonfinite_amax_count) == 2  # row-wise and column-wise copies
