"""The Triton NVFP4 quantize kernel (1x16 and 16x16 blocks) against the torch quantizer, bit
for bit, in the Triton interpreter (round to nearest with ties, saturation, zero blocks,
stochastic rounding with shard offsets, bf16 and strided inputs, partial tiles), and
``NVFP4Quantizer`` with ``backend="triton"`` against ``"torch"`` for every recipe role
(both copies: RHT on the column-wise copy, 16x16 weights, stochastic rounding) with the
dispatch records (``nvfp4_quantize``).

Two modes, as ``test_kernels_interpret.py``: a normal run starts ONE pytest subprocess on
this file with ``TRITON_INTERPRET=1`` (which must be set before triton is imported and must
not leak into the rest of the suite) and asserts that it passed."""

from __future__ import annotations

import pytest
import torch

from interpret_utils import HAVE_TRITON, INTERPRETED, run_in_interpreter

if not INTERPRETED:

    @pytest.mark.skipif(not HAVE_TRITON,
                        reason="triton is not installed: the NVFP4 Triton kernel is untested")
    def test_nvfp4_triton_kernel_in_interpreter():
        run_in_interpreter(__file__)

else:
    pytest.importorskip("triton")
    from tp_fuse.kernels import record_kernel_paths
    from tp_fuse.kernels.nvfp4_cast_triton import nvfp4_quantize, nvfp4_quantize_1x16
    from tp_fuse.quantization.nvfp4.cast import quantize_nvfp4_layout
    from tp_fuse.quantization.nvfp4.quantizer import NVFP4Quantizer
    from tp_fuse.quantization.nvfp4.scaling import NVFP4_BLOCK, NVFP4_BLOCK_2D, global_scales, quantize_nvfp4
    from tp_fuse.recipe import NVFP4BlockScaling

    def _factors(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc, dec = global_scales(amax)
        return enc * torch.reciprocal(torch.tensor(6.0)), dec

    def _check(x: torch.Tensor, *, seed=None, row_offset=0, col_offset=0, **tiles) -> None:
        amax = x.detach().abs().amax().float()
        want_d, want_s = quantize_nvfp4(x, NVFP4_BLOCK, amax, sr_seed=None if seed is None else torch.tensor(seed),
                                        row_offset=row_offset, col_offset=col_offset)
        mult, dec = _factors(amax)
        got_d, got_s = nvfp4_quantize_1x16(x, mult, dec, sr_seed=seed, row_offset=row_offset,
                                           col_offset=col_offset, **tiles)
        assert torch.equal(got_s, want_s.view(torch.uint8)), "block scales differ"
        diff = (got_d != want_d.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:3].tolist()}"

    def _gen(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g) * scale

    @pytest.mark.parametrize("shape", [(16, 64), (37, 96), (5, 160)])
    @pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
    def test_round_to_nearest_matches_torch(shape, scale):
        x = _gen(shape[0] * 7 + shape[1], *shape, scale=scale)
        x[0, :16] = 0.0  # a zero block
        _check(x, block_rows=8, block_cols=64)

    def test_ties_and_saturation():
        # Tensor amax 2688 and block amax 6: block scale 1, the values reach E2M1 as exact ties.
        x = torch.zeros(1, 32)
        x[0, :12] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0])
        x[0, 16] = 2688.0
        _check(x)
        # A block scale that rounds down in E4M3: the block maximum saturates at 6.
        y = torch.zeros(1, 16)
        y[0, 0], y[0, 1] = 2688.0 * (1 + 2.0**-5), 1.0
        _check(y)

    @pytest.mark.parametrize("offsets", [(0, 0), (48, 0), (0, 32)])
    def test_stochastic_rounding_matches_torch(offsets):
        x = _gen(3, 24, 64)
        _check(x, seed=12345, row_offset=offsets[0], col_offset=offsets[1], block_rows=16, block_cols=32)

    def test_bf16_and_strided_input():
        base = _gen(4, 64, 48).to(torch.bfloat16)
        _check(base.t())  # [48, 64], column stride 48
        _check(_gen(5, 32, 64)[:, ::1][::2])

    def _check_2d(x: torch.Tensor, *, seed=None, row_offset=0, col_offset=0, **tiles) -> None:
        amax = x.detach().abs().amax().float()
        want_d, want_s = quantize_nvfp4(x, NVFP4_BLOCK_2D, amax, sr_seed=None if seed is None else torch.tensor(seed),
                                        row_offset=row_offset, col_offset=col_offset)
        mult, dec = _factors(amax)
        got_d, got_s = nvfp4_quantize(x, mult, dec, two_d=True, sr_seed=seed, row_offset=row_offset,
                                      col_offset=col_offset, **tiles)
        assert got_s.shape == want_s.shape
        assert torch.equal(got_s, want_s.view(torch.uint8)), "block scales differ"
        diff = (got_d != want_d.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:3].tolist()}"

    @pytest.mark.parametrize("shape,tiles", [((32, 64), dict(block_rows=16, block_cols=32)),
                                             ((37, 96), dict(block_rows=32, block_cols=64)),
                                             ((5, 48), {})])
    def test_2d_blocks_match_torch(shape, tiles):
        # Magnitudes vary down the rows: a 16x16 block's scale differs from its rows' 1x16 ones.
        x = _gen(shape[0] + shape[1], *shape) * torch.logspace(-2, 2, shape[0])[:, None]
        if shape[0] >= 32:
            x[16:32, :16] = 0.0  # a zero block
        _check_2d(x, **tiles)
        _check_2d(x.to(torch.bfloat16).t().contiguous().t(), **tiles)  # bf16, column-major strides

    def test_2d_blocks_stochastic_rounding_with_offsets():
        _check_2d(_gen(6, 40, 64), seed=99, row_offset=32, col_offset=16, block_rows=16, block_cols=32)

    def _roles():
        recipe = NVFP4BlockScaling()
        return {role: NVFP4Quantizer.for_role(recipe, role) for role in ("input", "weight", "grad_output")}

    @pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
    @pytest.mark.parametrize("row_offset", [0, 32])
    def test_quantizer_triton_equals_torch_for_every_role(role, row_offset):
        x = _gen(7, 48, 64) * torch.logspace(-1, 1, 64)
        q = _roles()[role]
        outs = {}
        for backend in ("torch", "triton"):
            q.backend = backend
            torch.manual_seed(3)  # the stochastic-rounding seed
            with record_kernel_paths() as log:
                outs[backend] = q._quantize(x, True, None, row_offset=row_offset)
            assert log.backends("nvfp4_quantize") == [backend, backend]  # row-wise and column-wise copies
        for layout in ("_rowwise", "_columnwise"):
            want, got = getattr(outs["torch"], layout), getattr(outs["triton"], layout)
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), layout
            assert torch.equal(got.scale_inv.view(torch.uint8), want.scale_inv.view(torch.uint8)), layout
            assert torch.equal(got.amax, want.amax)
        assert q.with_rht == (role != "weight") and q.with_2d_quantization == (role == "weight")
        assert q.stochastic_rounding == (role == "grad_output")

    def test_dispatch_rules():
        x = _gen(8, 16, 32)
        amax = x.abs().amax()
        with record_kernel_paths() as log:
            quantize_nvfp4_layout(x, NVFP4_BLOCK, amax)  # auto on CPU: torch, even in the interpreter
            quantize_nvfp4_layout(x.double(), NVFP4_BLOCK, amax)
        assert log.backends("nvfp4_quantize") == ["torch", "torch"]
        with pytest.raises(ValueError, match="float64"):
            quantize_nvfp4_layout(x.double(), NVFP4_BLOCK, amax, backend="triton")
        with pytest.raises(ValueError, match="multiple of 16"):
            quantize_nvfp4_layout(x[:, :24], NVFP4_BLOCK, amax, backend="triton")

    def test_4over6_is_refused_by_the_triton_kernel_with_the_reason():
        # The kernel only maps block amaxes to 6: 4over6 (nvfp4_4over6) runs the torch path.
        x = _gen(9, 16, 32)
        q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)
        q.backend = "triton"
        with pytest.raises(ValueError, match="4over6"):
            q(x)
