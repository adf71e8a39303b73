"""NVFP4 4over6 (``NVFP4BlockScaling(nvfp4_4over6=...)``, ``NVFP4Quantizer(nvfp4_use_4over6=True)``).

Bit-exact against a float64 reference of the rule (every E4M3 / E2M1 rounding an explicit
nearest-even search; the error sums in TE's fp32 order), the choice varying per block, ties
(zero blocks, candidates that both reconstruct exactly) going to map-to-6, saturation of the
map-to-4 scale, the 256 / 448 global bound through dequantize, the GEMM, the wire and
flatten, the recipe's scopes and validation, and the Triton dispatch refusing 4over6."""

from __future__ import annotations

import pytest
import torch

import tp_fuse
from tolerances import NVFP4_REL_NORM, assert_close
from tp_fuse import ops
from tp_fuse.kernels import record_kernel_paths
from tp_fuse.quantization import BlockScaledTensor, NVFP4Quantizer, fp8_gemm
from tp_fuse.quantization.block import wire as block_wire
from tp_fuse.quantization.block.gemm import emulated_block_gemm
from tp_fuse.quantization.nvfp4.cast import quantize_nvfp4_layout
from tp_fuse.quantization.nvfp4.scaling import FP4_VALUES, NVFP4_BLOCK, decode_e2m1, unpack_fp4
from tp_fuse.recipe import NVFP4BlockScaling

F32_MAX = torch.finfo(torch.float32).max
_ALL_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
_E4M3_GRID = torch.unique(_ALL_E4M3[torch.isfinite(_ALL_E4M3)].abs())
_E2M1_GRID = torch.tensor(FP4_VALUES, dtype=torch.float64)


def _gen(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.double()).norm() / ref.double().norm())


def _nearest_even(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Value of the sorted non-negative ``grid`` nearest to ``v >= 0``, ties to the even index."""
    d = (v[..., None] - grid).abs()
    cand = d == d.min(dim=-1, keepdim=True).values
    idx = torch.arange(grid.numel()).expand_as(cand)
    even = cand & (idx % 2 == 0)
    return grid[torch.where(even.any(-1), (even * idx).sum(-1), (cand * idx).sum(-1))]


def _ref_4over6(x: torch.Tensor, block: tuple[int, int], m: int, mode: str):
    """(values float64 [R, C], scales float64, pick_map4 bool per block) of the 4over6 rule."""
    x32 = x.float()
    r, c = x.shape
    br = block[0]
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    amax = x32.abs().max()
    s_enc = torch.clamp(f32(float(m) * 6.0) / amax, max=F32_MAX)
    s_enc = f32(1.0) if s_enc.item() == 0 else s_enc
    s_dec = f32(1.0) / s_enc
    blk = x32.reshape(r // br, br, c // 16, 16).abs().amax(dim=(1, 3))
    base = (blk / f32(6.0)) * s_enc
    out = []
    for pre in (base * f32(1.5), base):
        s = _nearest_even(torch.clamp(pre, max=448.0).double(), _E4M3_GRID)
        enc = torch.clamp(1.0 / (s.float() * s_dec), max=F32_MAX)
        scaled = (x32 * enc.repeat_interleave(br, 0).repeat_interleave(16, 1)).double().clamp(-6.0, 6.0)
        mag = _nearest_even(scaled.abs(), _E2M1_GRID)
        vals = torch.where(scaled < 0, -mag, mag)
        rec = (vals * s.repeat_interleave(br, 0).repeat_interleave(16, 1)).float()
        d = ((rec * amax) / f32(6.0 * m) - x32).reshape(r, c // 16, 16)
        terms = d * d if mode == "MSE" else d.abs()
        err = terms[..., 0]
        for i in range(1, 16):
            err = err + terms[..., i]
        if br == 16:  # TE's warp tree over the tile's 16 row errors
            e = err.reshape(r // 16, 16, c // 16)
            for h in (8, 4, 2, 1):
                e = e[:, :h] + e[:, h:2 * h]
            err = e[:, 0]
        out.append((vals, s, err))
    (v4, s4, e4), (v6, s6, e6) = out
    pick = e4 < e6
    vals = torch.where(pick.repeat_interleave(br, 0).repeat_interleave(16, 1), v4, v6)
    return vals, torch.where(pick, s4, s6), pick


def _codes_values(p) -> torch.Tensor:
    return decode_e2m1(unpack_fp4(p.data), torch.float64)


@pytest.mark.parametrize("block", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
@pytest.mark.parametrize("m", [256, 448])
@pytest.mark.parametrize("mode", ["MAE", "MSE"])
@pytest.mark.parametrize("seed, scale", [(1, 1.0), (2, 1e-3), (3, 300.0)])
def test_quantize_matches_float64_reference_bitwise(block, m, mode, seed, scale):
    x = _gen(seed, 48, 64, scale=scale)
    x[::3] *= torch.rand(16, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4
    x = x.float()
    x[5, :16] = 0.0  # an all-zero 1x16 block: both candidates exact, the tie keeps map-to-6
    x[16:32, 16:32] = 0.0  # an all-zero 16x16 tile
    # A tile of values at 5/6 of its amax: map-to-6 rounds them to 4, map-to-4 to 4.5 -- so
    # map-to-4 wins there (Gaussian 16x16 tiles mostly keep map-to-6).
    u = float(x.abs().max()) / 12
    x[0:16, 48:64] = 5 * u
    x[0, 48] = 6 * u
    q = NVFP4Quantizer(with_2d_quantization=block == (16, 16), nvfp4_use_4over6=True, nvfp4_e4m3_max=m,
                       nvfp4_4over6_err_mode=mode.lower())(x)
    vals, scales, pick = _ref_4over6(x, block, m, mode)
    p = q._rowwise
    assert p.e4m3_max == m
    assert torch.equal(p.scale_inv.double(), scales)
    assert torch.equal(_codes_values(p), vals)
    # The choice varies per block: both candidates occur.
    assert pick.any() and (~pick).any()
    # Dequantize with the tensor's bound: e2m1 * (fp32(scale) * amax * fp32(1/(6 * m))).
    per = p.scale_inv.float() * p.amax.float() * torch.tensor(1.0 / (6.0 * m), dtype=torch.float32)
    per = per.repeat_interleave(block[0], 0).repeat_interleave(16, 1)
    deq = q.dequantize()
    assert torch.equal(deq, vals.float() * per) and (deq[16:32, 16:32] == 0).all()
    assert _rel(deq, x.double()) < NVFP4_REL_NORM
    # Column-wise copy: 16x16 tiles transposed (same choices); 1x16 blocks of x.T chosen anew.
    if block == (16, 16):
        assert torch.equal(q._columnwise.dequantize(), deq.t())
    else:
        vt, st, _ = _ref_4over6(x.t().contiguous(), block, m, mode)
        assert torch.equal(_codes_values(q._columnwise), vt) and torch.equal(q._columnwise.scale_inv.double(), st)


def test_ties_choice_and_saturation_by_hand():
    # amax 2688 with bound 448: S_enc = 1, so a block with amax 6 has s6 = 1 and s4 = 1.5.
    x = torch.zeros(1, 64)
    x[0, :2] = torch.tensor([6.0, 3.0])  # 6 -> 6 | 4 * 1.5, 3 -> 3 | 2 * 1.5: both exact, tie -> map-to-6
    x[0, 16:18] = torch.tensor([6.0, 5.0])  # map-to-6: 5 -> 4 (err 1); map-to-4: 5/1.5 -> 3, 4.5 (err 0.5)
    x[0, 32] = 2688.0  # s6 = 448; s4 = 672 saturates to 448: equal candidates, tie -> map-to-6
    # block 3 stays zero: both errors 0 -> map-to-6 (scale 0)
    p = NVFP4Quantizer(columnwise=False, nvfp4_use_4over6=True, nvfp4_e4m3_max=448)(x)._rowwise
    assert p.scale_inv.float().tolist() == [[1.0, 1.5, 448.0, 0.0]]
    v = _codes_values(p)[0]
    assert v[:2].tolist() == [6.0, 3.0] and v[16:18].tolist() == [4.0, 3.0] and v[32].item() == 6.0
    assert (v[48:] == 0).all()
    # MSE agrees here; the per-block sum of |d| vs d^2 can differ elsewhere (tested bitwise above).
    q = NVFP4Quantizer(columnwise=False, nvfp4_use_4over6=True, nvfp4_e4m3_max=448, nvfp4_4over6_err_mode="MSE")
    assert q(x)._rowwise.scale_inv.float().tolist() == [[1.0, 1.5, 448.0, 0.0]]


def test_partial_16x16_tile_matches_the_zero_padded_reference():
    x = _gen(6, 40, 32).float()  # 2.5 tiles of rows
    q = NVFP4Quantizer(columnwise=False, with_2d_quantization=True, nvfp4_use_4over6=True, nvfp4_e4m3_max=256)
    p = q(x)._rowwise
    vals, scales, _ = _ref_4over6(torch.cat([x, torch.zeros(8, 32)]), (16, 16), 256, "MAE")
    assert torch.equal(p.scale_inv.double(), scales) and torch.equal(_codes_values(p), vals[:40])


def test_all_zero_tensor():
    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)(torch.zeros(32, 32))
    assert (q.dequantize() == 0).all() and (q._columnwise.dequantize() == 0).all()


@pytest.mark.parametrize("two_d", [False, True])
def test_gemm_equals_float64_of_the_scaled_operands(two_d):
    x, w, b = _gen(10, 48, 128).float(), _gen(11, 80, 128, scale=0.05).float(), _gen(12, 80).float()
    a = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)(x)
    bq = NVFP4Quantizer(with_2d_quantization=two_d, nvfp4_use_4over6=True, nvfp4_e4m3_max=448)(w)
    y = fp8_gemm(a, bq, torch.float32, bias=b)
    pa, pb = a._rowwise, bq._rowwise
    va = _codes_values(pa) * pa.scale_inv.double().repeat_interleave(16, 1)
    vb = _codes_values(pb) * pb.scale_inv.double().repeat_interleave(pb.spec.rows, 0)[:80].repeat_interleave(16, 1)
    alpha = float(pa.amax) * float(pb.amax) / (6 * 256 * 6 * 448)  # each operand's own bound
    assert_close(y, alpha * (va @ vb.t()) + b.double(), torch.float32)
    assert _rel(y, x.double() @ w.double().t() + b.double()) < NVFP4_REL_NORM
    assert torch.equal(emulated_block_gemm(pa, pb, torch.float32, b), y)


def test_wire_and_flatten_keep_the_bound():
    x = _gen(5, 32, 64).float()
    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)(x)
    back = block_wire.rowwise_from_wire(block_wire.rowwise_wire(q), q)
    assert back._rowwise.e4m3_max == 256 and torch.equal(back.dequantize(), q.dequantize())
    names, ctx = q.__tensor_flatten__()
    inner = {n: getattr(q, n) for n in names}
    t = BlockScaledTensor.__tensor_unflatten__(inner, ctx, None, None)
    assert torch.equal(t.dequantize(), q.dequantize()) and t._columnwise.e4m3_max == 256


@pytest.mark.parametrize("scope, input_4o6, weight_4o6", [
    ("none", False, False), ("weights", False, True), ("activations", True, False), ("all", True, True),
])
@pytest.mark.parametrize("use_256", ["none", "weights", "activations", "all"])
def test_recipe_scopes(scope, input_4o6, weight_4o6, use_256):
    r = NVFP4BlockScaling(disable_rht=True, nvfp4_4over6=scope, nvfp4_4over6_e4m3_use_256=use_256,
                          nvfp4_4over6_err_mode="MSE")
    for role, on in (("input", input_4o6), ("weight", weight_4o6), ("output", input_4o6),
                     ("grad_output", False), ("grad_input", False)):
        q = NVFP4Quantizer.for_role(r, role)
        assert q.nvfp4_use_4over6 is on, role
        covered = use_256 == "all" or (use_256 == "weights") == (role == "weight") and use_256 != "none"
        assert q.nvfp4_e4m3_max == (256 if on and covered else 448), role
        assert q.nvfp4_4over6_err_mode == "MSE"
    # Gradients keep the base recipe's stochastic rounding.
    assert NVFP4Quantizer.for_role(r, "grad_output").stochastic_rounding


@pytest.mark.parametrize("make, needle", [
    (lambda: NVFP4BlockScaling(nvfp4_4over6="All"), "nvfp4_4over6: expected 'none', 'weights', 'activations'"),
    (lambda: NVFP4BlockScaling(nvfp4_4over6_err_mode="L1"), "nvfp4_4over6_err_mode"),
    (lambda: NVFP4Quantizer.for_role(NVFP4BlockScaling(nvfp4_4over6="all"), "input"), "disable_rht=True"),
    (lambda: NVFP4Quantizer(nvfp4_use_4over6=True, with_rht=True), "with_rht or stochastic_rounding"),
    (lambda: NVFP4Quantizer(nvfp4_use_4over6=True, stochastic_rounding=True), "with_rht or stochastic_rounding"),
    (lambda: NVFP4Quantizer(nvfp4_e4m3_max=256), "nvfp4_e4m3_max"),
    (lambda: NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=300), "nvfp4_e4m3_max"),
    (lambda: NVFP4Quantizer(nvfp4_use_4over6=True, with_2d_quantization=True)(torch.ones(8, 16)), "column-wise"),
])
def test_validation_names_the_field(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_weights_scope_works_with_rht_on_activations():
    # "weights" leaves the RHT quantizers (input, gradients) alone: allowed with the default RHT.
    r = NVFP4BlockScaling(nvfp4_4over6="weights")
    assert NVFP4Quantizer.for_role(r, "weight").nvfp4_use_4over6
    assert NVFP4Quantizer.for_role(r, "input").with_rht


def test_4over6_runs_the_torch_path_and_is_recorded():
    # (backend="triton" refusing 4over6 with the reason: tests/test_nvfp4_triton.py, interpreter.)
    with record_kernel_paths() as log:
        quantize_nvfp4_layout(torch.ones(16, 16), NVFP4_BLOCK, torch.ones(()), four_over_six=(256, "MAE"))
    assert log.last("nvfp4_quantize").backend == "torch"
    assert log.last("nvfp4_quantize").variant == "reference_4over6"


def test_basic_linear_under_4over6_autocast_matches_float64():
    torch.manual_seed(0)
    lin = ops.BasicLinear(128, 64)
    x = _gen(13, 2, 32, 128).float().requires_grad_()
    dy = _gen(14, 2, 32, 64).float()
    recipe = NVFP4BlockScaling(nvfp4_4over6="all", disable_rht=True)
    with tp_fuse.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    w64, x64, dy64 = lin.weight.detach().double(), x.detach().double().reshape(-1, 128), dy.double().reshape(-1, 64)
    assert _rel(y.reshape(-1, 64), x64 @ w64.t()) < NVFP4_REL_NORM
    assert _rel(x.grad.reshape(-1, 128), dy64 @ w64) < NVFP4_REL_NORM
    assert _rel(lin.weight.grad, dy64.t() @ x64) < NVFP4_REL_NORM
    # The forward GEMM ran on 4over6 operands: it equals the GEMM of the 4over6-quantized x and W.
    xq = NVFP4Quantizer.for_role(recipe, "input")(x.detach().reshape(-1, 128))
    wq = NVFP4Quantizer.for_role(recipe, "weight")(lin.weight.detach())
    assert xq._rowwise.e4m3_max == wq._rowwise.e4m3_max == 256
    assert torch.equal(y.detach().reshape(-1, 64), fp8_gemm(xq, wq, torch.float32))
