"""Triton kernels vs the torch reference on CPU, in the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before triton is imported and must not leak into the
rest of the suite, so this file has two modes:

* normal run: a single test starts ONE pytest subprocess on this file with
  ``TRITON_INTERPRET=1`` and asserts that it passed (its report is shown on failure);
* ``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_interpret.py``: the cases
  below, run in the interpreter at small shapes with small tiles (multi-program grids,
  masks, atomics and the dbias workspace reduction are all exercised).

Casts are compared bit for bit; in the interpreter the kernels use the integer
emulation of float conversions (``_triton_common``), because the interpreter's own
conversions are wrong (ties, carries, subnormals, NaN, bf16 truncation).
"""

from __future__ import annotations

import pytest
import torch

from interpret_utils import HAVE_TRITON, INTERPRETED, run_in_interpreter

if not INTERPRETED:

    @pytest.mark.skipif(not HAVE_TRITON,
                        reason="triton is not installed: Triton kernels untested (torch path: test_kernels.py)")
    def test_triton_kernels_in_interpreter():
        run_in_interpreter(__file__)

else:
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from test_kernels import FP8_PAIRS, gemm_check, gemm_operands
    from tp_fuse.kernels import (
        dgelu_dbias,
        dswiglu,
        fp8_gemm,
        gelu_fwd,
        layernorm_fwd,
        quantize,
        record_kernel_paths,
        rmsnorm_fwd,
        swiglu_fwd,
    )
    from tp_fuse import kernels
    from tp_fuse.kernels import _triton_common as tc
    from tp_fuse.kernels import gemm_triton
    from tp_fuse.kernels.launch_count import count_launches
    from tp_fuse.kernels.testing import make_input, max_fp8_ulp_distance

    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    F32 = dict(rtol=1e-5, atol=1e-5)
    # numpy reports the inf/NaN arithmetic these tests feed in on purpose.
    pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
    # test_kernels.CASES with (17, 33) for its (33, 65): the interpreter pays per program and
    # per tile element, and (17, 33) is the smallest shape that is still ragged in both
    # directions over 2 x 2 programs of the interpreter's 16 x 32 tiles (4-row norm programs:
    # 5 of them, the last ragged; the dbias workspace still has 2 rows to sum).
    CASES = [(s, "contiguous") for s in [(1, 1), (7, 13), (17, 33), (2, 3, 17)]] + [
        ((17, 33), "transposed"), ((7, 13), "strided")]

    def _bytes(t):
        return t.view(torch.uint8)

    def _assert_same(a, b):
        """Bit-identical, including NaN encodings."""
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    def _assert_out_close(a, b):
        """Outputs of fp32 math done in another order: fp8 within one step, high
        precision within fp32 tolerance, or one rounding step of bf16/fp16."""
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
        if a.dtype in (E4M3, E5M2):
            assert max_fp8_ulp_distance(a, b) <= 1
        elif a.dtype == torch.float32:
            torch.testing.assert_close(a, b, **F32)
        else:
            eps = torch.finfo(a.dtype).eps
            torch.testing.assert_close(a.float(), b.float(), rtol=eps, atol=1e-5)

    # ------------------------------------------------------------------------------
    # the conversion helpers, exhaustively
    # ------------------------------------------------------------------------------

    @triton.jit
    def _convert_kernel(x_ptr, e4m3_ptr, e5m2_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(e4m3_ptr + offs, tc.quantize_values(x, 1.0, True, True), mask=m)
        tl.store(e5m2_ptr + offs, tc.quantize_values(x, 1.0, False, True), mask=m)
        tl.store(bf16_ptr + offs, tc.round_to(x, tl.bfloat16, True), mask=m)

    @triton.jit
    def _decode_kernel(c_ptr, e4m3_ptr, e5m2_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        c = tl.load(c_ptr + offs)
        tl.store(e4m3_ptr + offs, tc.fp8_bits_to_fp32(c, True))
        tl.store(e5m2_ptr + offs, tc.fp8_bits_to_fp32(c, False))

    def _dense_fp32_patterns():
        """Every bf16 pattern with 7 different low halves (ties 0x8000, just below /
        above ties, ...), plus all fp8 midpoints, +-inf and huge values."""
        hi = torch.arange(1 << 16, dtype=torch.int64) << 16
        lows = (0x0000, 0x8000, 0x7FFF, 0x8001, 0x0001, 0x4000, 0xFFFF)
        bits = torch.cat([hi | low for low in lows])
        x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
        extra = [torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, 460.0, 464.0, 470.0, 61440.0])]
        for f8 in (E4M3, E5M2):
            v = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(f8).float()
            v = v[v.isfinite()].unique()
            mid = (v[1:] + v[:-1]) / 2
            extra += [mid, -mid]
        return torch.cat([x, *extra])

    def test_emulated_conversions_match_torch_bitwise():
        x = _dense_fp32_patterns()
        n = x.numel()
        e4, e5 = torch.empty(n, dtype=E4M3), torch.empty(n, dtype=E5M2)
        bf = torch.empty(n, dtype=torch.bfloat16)
        _convert_kernel[(triton.cdiv(n, 16384),)](x, _bytes(e4), _bytes(e5), bf, n, BLOCK=16384)
        _assert_same(e4, torch.clamp(x, -448.0, 448.0).to(E4M3))
        _assert_same(e5, torch.clamp(x, -57344.0, 57344.0).to(E5M2))
        # torch encodes a bf16 NaN as 0x7FC0 | sign on some paths: compare NaN-ness there.
        ref = x.to(torch.bfloat16)
        nan = x.isnan()
        assert torch.equal(bf.isnan(), nan)
        assert torch.equal(bf.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])

    def test_emulated_fp8_decode_is_exact():
        codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
        e4, e5 = torch.empty(256), torch.empty(256)
        _decode_kernel[(1,)](codes, e4, e5, BLOCK=256)
        for got, f8 in ((e4, E4M3), (e5, E5M2)):
            ref = codes.view(f8).float()
            assert torch.equal(got.isnan(), ref.isnan())
            ok = ~ref.isnan()
            assert torch.equal(got[ok].view(torch.int32), ref[ok].view(torch.int32))  # incl. -0.0, inf

    # ------------------------------------------------------------------------------
    # quantize
    # ------------------------------------------------------------------------------

    @pytest.mark.parametrize("shape,layout", CASES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
    def test_quantize(shape, layout, dtype, fp8_dtype):
        x = make_input(shape, dtype, layout, std=60.0)
        if x.numel() > 4:
            x[(0,) * x.dim()] = float("inf")  # saturates
        scale = torch.tensor(3.5)
        with record_kernel_paths() as log:
            got = quantize(x, scale, fp8_dtype, transpose=True, backend="triton")
        ref = quantize(x, scale, fp8_dtype, transpose=True, backend="torch")
        assert log.last().backend == "triton" and log.last().variant == "tiles+emulated-casts"
        _assert_same(got[0], ref[0])
        _assert_same(got[1], ref[1])
        _assert_same(got[2], ref[2])  # amax bit-exact

    @pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
    def test_quantize_every_bf16_pattern(fp8_dtype):
        x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
        # As is (NaN and inf included: the amax is NaN); then scaled into the subnormal range
        # with the non-finite patterns zeroed, where the amax must be the largest finite |x|
        # (the cost is per element: two passes over the 65536 patterns, not three).
        finite = torch.where(x.isfinite(), x, torch.zeros((), dtype=x.dtype))
        amaxes = []
        for inp, scale in ((x, 1.0), (finite, 2.0**-7)):
            s = torch.tensor(scale)
            got = quantize(inp, s, fp8_dtype, backend="triton")
            ref = quantize(inp, s, fp8_dtype, backend="torch")
            _assert_same(got[0], ref[0])
            amaxes.append((got[2], ref[2]))
        (nan_got, nan_ref), (got_amax, ref_amax) = amaxes
        assert nan_got.isnan() and nan_ref.isnan()  # the patterns include NaN
        assert got_amax.item() == ref_amax.item() == float(x[x.isfinite()].float().abs().max())

    def test_quantize_empty():
        data, data_t, amax = quantize(torch.empty(0, 5), torch.tensor(1.0), E4M3, transpose=True, backend="triton")
        assert data.shape == (0, 5) and data_t.shape == (5, 0) and amax.item() == 0.0

    # ------------------------------------------------------------------------------
    # the FP8 state written by the kernels (the CUDA launch budget's fusions)
    # ------------------------------------------------------------------------------

    @pytest.mark.parametrize("start", [0.0, 5.0, 1e9, float("nan")], ids=["zero", "below", "above", "nan"])
    @pytest.mark.parametrize("with_nan", [False, True])
    def test_quantize_folds_amax_into_slot_and_writes_scale_inv(start, with_nan):
        x = make_input((33, 40), torch.bfloat16, "contiguous", std=30.0)
        if with_nan:
            x[3, 7] = float("nan")
        scale = torch.tensor(3.0)
        outs = {}
        for backend in ("triton", "torch"):
            slot, sinv = torch.tensor(start), torch.empty(())
            data, data_t, amax = quantize(x, scale, E4M3, transpose=True, backend=backend, amax_out=slot,
                                          scale_inv_out=sinv)
            assert amax is slot
            outs[backend] = (data, data_t, slot, sinv)
        for got, ref in zip(outs["triton"], outs["torch"]):
            _assert_same(got, ref)
        assert torch.equal(outs["torch"][3], torch.reciprocal(scale))

    @pytest.mark.parametrize("amax", [0.0, 2.5e-3, 700.0, 3e38, float("inf"), float("nan")])
    @pytest.mark.parametrize("pow2", [False, True])
    @pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
    def test_quantize_current_scaling_matches_torch(amax, pow2, fp8_dtype):
        x = make_input((20, 48), torch.bfloat16, "transposed", std=4.0)
        outs = {}
        for backend in ("triton", "torch"):
            state = dict(scale_out=torch.tensor(7.0), scale_inv_out=torch.empty(()), last_amax_out=torch.zeros(()),
                         nonfinite_count=torch.tensor(2), zero_count=torch.tensor(3))
            data, data_t = kernels.quantize_current_scaling(x, torch.tensor(amax, dtype=torch.bfloat16), fp8_dtype,
                                                            power_2_scale=pow2, transpose=True, backend=backend,
                                                            **state)
            outs[backend] = (data, data_t, *state.values())
        for got, ref in zip(outs["triton"], outs["torch"]):
            _assert_same(got, ref)

    @pytest.mark.parametrize("length", [1, 3, 16])
    @pytest.mark.parametrize("algos", ["max", "most_recent", "mixed"])
    @pytest.mark.parametrize("margin", [0, 2])
    def test_delayed_scale_update_matches_torch(length, algos, margin):
        g = torch.Generator().manual_seed(length)
        n = 6
        hist = torch.rand(n, length, generator=g) * 100
        hist[1, 0] = float("nan")
        hist[2, 0] = float("inf")
        hist[3] = 0.0  # no data: the scale is kept
        hist[4, 0] = 1e-40  # a subnormal amax: the scale clamps to the fp32 range
        recent = {"max": [False] * n, "most_recent": [True] * n, "mixed": [i % 2 == 0 for i in range(n)]}[algos]
        fp8_max = torch.tensor([448.0, 57344.0] * (n // 2), dtype=torch.float64)
        outs = {}
        for backend in ("triton", "torch"):
            state = [hist.clone(), torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5,
                     torch.zeros(n), torch.arange(n, dtype=torch.int64)]
            kernels.delayed_scale_update(
                *state, fp8_max, torch.full((n,), 2.0**margin, dtype=torch.float64), torch.tensor(recent),
                any_margin=margin != 0, any_most_recent=any(recent), all_most_recent=all(recent), backend=backend,
            )
            outs[backend] = state
        for got, ref in zip(outs["triton"], outs["torch"]):
            _assert_same(got, ref)

    @pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "gelu", "swiglu", "dgelu", "dswiglu"])
    def test_producers_fold_amax_and_write_scale_inv(kind):
        x = make_input((17, 32), torch.bfloat16, "contiguous", std=3.0)
        n = x.shape[-1]
        w, b = make_input((n,), torch.float32, seed=1, std=1.0), make_input((n,), torch.float32, seed=2, std=1.0)
        grad = make_input((17, 16 if kind == "dswiglu" else 32), torch.bfloat16, "contiguous", seed=3, std=1.0)
        outs = {}
        for backend in ("triton", "torch"):
            slot, sinv = torch.tensor(0.5), torch.empty(())
            kw = dict(scale=torch.tensor(20.0), fp8_dtype=E4M3, backend=backend, amax_out=slot, scale_inv_out=sinv)
            if kind == "layernorm":
                y = layernorm_fwd(x, w, b, 1e-5, **kw)[0]
            elif kind == "rmsnorm":
                y = rmsnorm_fwd(x, w, 1e-5, **kw)[0]
            elif kind == "gelu":
                y = gelu_fwd(x, **kw)[0]
            elif kind == "swiglu":
                y = swiglu_fwd(x, **kw)[0]
            elif kind == "dgelu":
                y = dgelu_dbias(grad, x, **kw)[0]
            else:
                y = dswiglu(grad, x, **kw)[0]
            outs[backend] = (y, slot, sinv)
        _assert_out_close(outs["triton"][0], outs["torch"][0])
        torch.testing.assert_close(outs["triton"][1], outs["torch"][1], **F32)
        _assert_same(outs["triton"][2], outs["torch"][2])

    def test_producers_without_amax_launch_no_fill():
        """with_amax=False: no zero-filled amax buffer (a launch on CUDA), no amax returned:
        each producer is exactly its one Triton launch."""
        x = make_input((8, 32), torch.bfloat16, "contiguous")
        w, b = torch.ones(32), torch.zeros(32)
        result = {}

        def run():
            result["gelu"] = gelu_fwd(x, backend="triton", with_amax=False)[1]
            result["norm"] = layernorm_fwd(x, w, b, 1e-5, backend="triton", with_amax=False)[3]

        count = count_launches(run)
        assert result == {"gelu": None, "norm": None}
        assert dict(count.by_kernel) == {"triton._gelu_fwd_kernel": 1, "triton._norm_fwd_kernel": 1}

    # ------------------------------------------------------------------------------
    # norms
    # ------------------------------------------------------------------------------

    @pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
    @pytest.mark.parametrize("shape,layout", CASES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("fp8_dtype", [None, E4M3])
    def test_norm(rms, shape, layout, dtype, fp8_dtype):
        x = make_input(shape, dtype, layout, std=2.0) + 0.5
        n = shape[-1]
        w = make_input((n,), torch.float32, seed=1, std=1.0)
        b = make_input((n,), torch.bfloat16, seed=2, std=1.0)
        kw = dict(scale=torch.tensor(30.0), fp8_dtype=fp8_dtype) if fp8_dtype else {}
        if rms:
            got = rmsnorm_fwd(x, w, 1e-5, backend="triton", **kw)
            ref = rmsnorm_fwd(x, w, 1e-5, backend="torch", **kw)
        else:
            got = layernorm_fwd(x, w, b, 1e-5, backend="triton", **kw)
            ref = layernorm_fwd(x, w, b, 1e-5, backend="torch", **kw)
        _assert_out_close(got[0], ref[0])
        for g, r in zip(got[1:], ref[1:]):  # (mean,) rstd, amax
            assert g.dtype == torch.float32 and g.shape == r.shape
            torch.testing.assert_close(g, r, **F32)

    # ------------------------------------------------------------------------------
    # activations
    # ------------------------------------------------------------------------------

    @pytest.mark.parametrize("shape,layout", CASES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("fp8_dtype", [None, E4M3, E5M2])
    def test_gelu_and_dgelu_dbias(shape, layout, dtype, fp8_dtype):
        x = make_input(shape, dtype, layout)
        x[(0,) * x.dim()] = -12.0  # deep negative tail
        grad = make_input(shape, dtype, layout, seed=3, std=1.0)
        kw = dict(scale=torch.tensor(40.0), fp8_dtype=fp8_dtype) if fp8_dtype else {}
        got, ref = gelu_fwd(x, backend="triton", **kw), gelu_fwd(x, backend="torch", **kw)
        _assert_out_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], **F32)
        got, ref = dgelu_dbias(grad, x, backend="triton", **kw), dgelu_dbias(grad, x, backend="torch", **kw)
        _assert_out_close(got[0], ref[0])
        assert got[1].dtype == dtype and got[1].shape == (shape[-1],)
        # dbias: Triton sums the fp32 dx (tiles, then the workspace); the torch path sums dx
        # rounded to the grad dtype, as tp_fuse.ops.Bias does. Bound: half an ulp per
        # rounded term, one rounding of each result, fp32 summation order.
        eps = torch.finfo(dtype).eps
        abs_sum = (ref[0].float() if fp8_dtype is None else _dgelu_abs(grad, x)).abs().reshape(-1, shape[-1]).sum(0)
        bound = (eps / 2 if dtype != torch.float32 else 0.0) * abs_sum + eps * ref[1].float().abs() + 1e-5
        assert ((got[1].float() - ref[1].float()).abs() <= bound).all()
        torch.testing.assert_close(got[2], ref[2], **F32)

    def _dgelu_abs(grad, x):
        """|dx| of the unquantized backward (the FP8 run's dbias sums these)."""
        return dgelu_dbias(grad, x, backend="torch")[0]

    def test_dgelu_dbias_no_rows():
        dx, dbias, amax = dgelu_dbias(torch.empty(0, 6), torch.empty(0, 6), backend="triton")
        assert dx.shape == (0, 6) and torch.equal(dbias, torch.zeros(6)) and amax.item() == 0.0

    # (17, 66): the 33 output columns and 17 rows are ragged over 2 x 2 programs (as CASES).
    GLU_CASES = [((1, 2), "contiguous"), ((7, 14), "contiguous"), ((17, 66), "contiguous"),
                 ((2, 3, 18), "contiguous"), ((17, 66), "transposed"), ((7, 14), "strided")]

    @pytest.mark.parametrize("shape,layout", GLU_CASES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("fp8_dtype", [None, E4M3])
    def test_swiglu_and_dswiglu(shape, layout, dtype, fp8_dtype):
        x = make_input(shape, dtype, layout)
        grad = make_input((*shape[:-1], shape[-1] // 2), dtype, seed=4, std=1.0)
        kw = dict(scale=torch.tensor(25.0), fp8_dtype=fp8_dtype) if fp8_dtype else {}
        got, ref = swiglu_fwd(x, backend="triton", **kw), swiglu_fwd(x, backend="torch", **kw)
        _assert_out_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], **F32)
        got, ref = dswiglu(grad, x, backend="triton", **kw), dswiglu(grad, x, backend="torch", **kw)
        _assert_out_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], **F32)

    # ------------------------------------------------------------------------------
    # FP8 GEMM: pointer kernel everywhere, TMA kernel where K allows it
    # ------------------------------------------------------------------------------

    # Interpreter tiles are 16 x 16 x 32 (gemm_triton._INTERPRETER_META). (33, 20, 48): ragged
    # M and N over 3 x 2 tiles (the last GROUP_M group has one row of tiles), 2 K steps, the
    # last one ragged; every operand-format pair, pointer and TMA kernel. The small shapes
    # take one pair each: one ragged tile with K < BLOCK_K (pointer only), and K % 16 == 0
    # inside a single tile (TMA too).
    GEMM_CASES = ([(1, 1, 1, E4M3, E4M3), (7, 13, 5, E5M2, E4M3), (7, 13, 48, E4M3, E5M2)]
                  + [(33, 20, 48, fa, fb) for fa, fb in FP8_PAIRS])

    @pytest.mark.parametrize("M,N,K,fa,fb", GEMM_CASES)
    def test_fp8_gemm_bias_gelu(M, N, K, fa, fb):
        a, b, sa, sb, bias = gemm_operands(M, N, K, fa, fb)
        bias = bias.to(torch.bfloat16)
        ref_out, ref_pre = fp8_gemm(a, b, sa, sb, torch.bfloat16, bias=bias, gelu=True, backend="torch")
        for tma in (False, True) if K % 16 == 0 else (False,):
            out, pre, variant = gemm_triton.fp8_gemm_triton(a, b, sa, sb, torch.bfloat16, bias, True, tma=tma)
            assert variant.startswith("tma" if tma else "pointer")
            gemm_check(out, pre, a, b, sa, sb, bias, True, torch.bfloat16)
            # vs torch._scaled_mm: same fp32 math, other summation order -> at most one
            # bf16 rounding step apart (and GELU of those inputs).
            torch.testing.assert_close(pre.float(), ref_pre.float(), rtol=2**-7, atol=1e-3)
            torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=1e-3)

    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("epilogue", ["none", "bias"])
    def test_fp8_gemm_epilogues(out_dtype, epilogue):
        a, b, sa, sb, bias = gemm_operands(17, 20, 48, E4M3, E5M2, seed=1)  # 2 x 2 ragged tiles, 2 K steps
        bias = bias if epilogue == "bias" else None
        with record_kernel_paths() as log:
            out, pre = fp8_gemm(a, b, sa, sb, out_dtype, bias=bias, backend="triton")
        assert log.last().variant.startswith("pointer[no TMA: not a CUDA device]")
        gemm_check(out, pre, a, b, sa, sb, bias, False, out_dtype)
        ref, _ = fp8_gemm(a, b, sa, sb, out_dtype, bias=bias, backend="torch")
        eps = torch.finfo(out_dtype).eps
        torch.testing.assert_close(out.float(), ref.float(), rtol=max(eps, 1e-6), atol=1e-4)

    def test_fp8_gemm_subnormal_and_strided_operands():
        # e5m2 subnormals are what the interpreter's own fp8 decode gets wrong.
        codes = torch.tensor([1, 2, 3, 0x81, 0x42, 0x3C], dtype=torch.uint8)
        a = codes.repeat(5, 8)[:, :40].contiguous().view(E5M2)  # [5, 40]
        b_wide = torch.randn(9, 80).to(E4M3)
        b = b_wide[:, ::2]  # [9, 40], inner stride 2: pointer kernel only
        sa, sb = torch.tensor(1024.0), torch.tensor(1.0)
        out, _ = fp8_gemm(a, b, sa, sb, torch.float32, backend="triton")
        gemm_check(out, None, a, b, sa, sb, None, False, torch.float32)
        with pytest.raises(ValueError, match="TMA"):
            gemm_triton.fp8_gemm_triton(a, b, sa, sb, torch.float32, None, False, tma=True)

    def test_cpu_auto_backend_is_torch_even_in_interpreter():
        with record_kernel_paths() as log:
            gelu_fwd(torch.randn(3, 4))
        assert log.last().backend == "torch"
