"""Triton block-quantization kernels vs the torch quantizers, bit for bit, in the interpreter.

Two modes, as in ``test_kernels_interpret.py`` (``TRITON_INTERPRET=1`` must be set before
triton is imported and must not leak into the rest of the suite):

* normal run: one test starts ONE pytest subprocess on this file with ``TRITON_INTERPRET=1``
  and asserts that it passed;
* ``TRITON_INTERPRET=1 python -m pytest tests/test_block_kernels_interpret.py``: the cases.

Every case compares data bytes and scale bytes (fp32 bit patterns, E8M0 codes) of both
layouts, and the non-finite amax count, between ``backend="triton"`` and ``"torch"`` of
:func:`tp_fuse.quantization.block.cast.quantize_layouts` and of ``BlockScalingQuantizer``.
Shapes are small (the interpreter runs programs one by one) but always span several
programs, and include partial last blocks in both directions.
"""

from __future__ import annotations

import pytest
import torch

from interpret_utils import HAVE_TRITON, INTERPRETED, run_in_interpreter

if not INTERPRETED:

    @pytest.mark.skipif(not HAVE_TRITON,
                        reason="triton is not installed: Triton block kernels untested")
    def test_triton_block_kernels_in_interpreter():
        run_in_interpreter(__file__)

else:
    pytest.importorskip("triton")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import tp_fuse as te
    from tp_fuse.kernels import record_kernel_paths
    from tp_fuse.quantization.block.cast import quantize_layouts
    from tp_fuse.quantization.block.quantizer import block_layout
    from tp_fuse.quantization.block.scaling import BlockSpec, ScaleRule
    from tp_fuse.quantization.op_quantizers import make_quantizer
    from tp_fuse.recipe import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling

    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

    LAYOUTS = {
        "1x128": (BlockSpec(1, 128), ScaleRule("fp32", power_2=True)),
        "128x128": (BlockSpec(128, 128), ScaleRule("fp32", power_2=True)),
        "mxfp8": (BlockSpec(1, 32), ScaleRule("e8m0")),
        "rowwise": (BlockSpec(1, None), ScaleRule("fp32", power_2=True)),
        # QParams(power_2_scale=False, amax_epsilon>0): exact fp8_max/amax scales.
        "1x128-nopow2-eps": (BlockSpec(1, 128), ScaleRule("fp32", power_2=False, amax_epsilon=1e-3)),
        "rowwise-nopow2": (BlockSpec(1, None), ScaleRule("fp32", power_2=False)),
    }
    # Tails in both directions, a single element, a single row / column, > 1 tile each way
    # ((130, 70): 2 row tiles of 128, 3 x 2 of the 64 x 64 MXFP8 tiles, 70 = 2 x 32 + 6;
    # (3, 200): 2 column tiles of 128, the last ragged).
    SHAPES = [(1, 1), (3, 200), (130, 70)]

    def _bits(t):
        """Exact bytes of a tensor (NaN payloads included), in a comparable dtype."""
        t = t.contiguous()
        return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)

    def _assert_same_payload(a, b):
        assert (a is None) == (b is None)
        if a is None:
            return
        assert a.spec == b.spec and a.data.dtype == b.data.dtype and a.scale_inv.dtype == b.scale_inv.dtype
        assert a.data.shape == b.data.shape and a.scale_inv.shape == b.scale_inv.shape
        assert torch.equal(_bits(a.data), _bits(b.data)), "data bytes differ"
        assert torch.equal(_bits(a.scale_inv), _bits(b.scale_inv)), "scale bytes differ"

    def _compare(x, layout, fp8_dtype, columnwise=True):
        spec, rule = LAYOUTS[layout]
        with record_kernel_paths() as log:
            got = quantize_layouts(x, spec, fp8_dtype, rule, columnwise=columnwise, backend="triton")
        ref = quantize_layouts(x, spec, fp8_dtype, rule, columnwise=columnwise, backend="torch")
        call = log.last("block_quantize")
        assert got.backend == "triton" and call.backend == "triton"
        assert call.variant == ("rows" if spec.cols is None else "tiles") + "+emulated-casts"
        _assert_same_payload(got.rowwise, ref.rowwise)
        _assert_same_payload(got.columnwise, ref.columnwise)
        assert torch.equal(got.nonfinite, ref.nonfinite)
        return got

    def _input(shape, dtype, seed, special=True):
        """Magnitudes over 12 decades (scales differ per block), a zero block, +-inf and NaN."""
        g = torch.Generator().manual_seed(seed)
        r, c = shape
        x = torch.randn(r, c, generator=g) * torch.logspace(-6, 6, c)
        if c >= 40:
            x[:, 3:40] = 0.0
        if special and r * c > 4:
            x[r // 2, c - 1] = float("inf")
            x[r - 1, c // 3] = -float("inf")
            x[0, c // 2] = float("nan")
        return x.to(dtype)

    INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    @pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
    def test_sweep_matches_torch_bitwise(layout, fp8_dtype):
        # Every (shape, special values) case once, the input dtype cycling over them: each
        # dtype meets several shapes of every layout (the interpreter runs programs one by one,
        # so the full product would cost three times as much for the same kernel paths).
        cases = [(shape, special) for shape in SHAPES for special in (False, True)]
        for k, (shape, special) in enumerate(cases):
            dtype = INPUT_DTYPES[k % len(INPUT_DTYPES)]
            _compare(_input(shape, dtype, seed=k // 2, special=special), layout, fp8_dtype)

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_strided_inputs_and_rowwise_only(layout):
        x = _input((96, 160), torch.float32, seed=7)
        _compare(x.t(), layout, E4M3)  # column-major
        _compare(x[:, ::2], layout, E4M3)  # inner stride 2
        _compare(x, layout, E4M3, columnwise=False)

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_zeros_subnormals_and_scale_boundaries(layout):
        # All-zero tensor; fp32 subnormals (scales overflow to inf -> 1); amaxes next to
        # powers of two, where a log2-based floor is off by one; values that saturate.
        k = torch.arange(-20, 20, dtype=torch.float32)
        below = torch.nextafter(torch.exp2(k), torch.zeros(()))  # just below 2**k
        above_56 = torch.nextafter(448.0 / torch.exp2(k), torch.full((), float("inf")))
        # 8 columns: the values sit in columns 0, 1 and 5 (an all-zero block: the first case).
        x = torch.zeros(130, 8)
        x[:40, 0], x[40:80, 0] = below, above_56
        x[80:120, 1] = torch.full((40,), 1e-40) * torch.arange(1, 41)
        x[120:, 5] = torch.tensor([448.5, 464.0, 1e30, -1e30, 57344.0, 61440.0, 3e38, -3e38, 0.5, 1.0])
        _compare(torch.zeros(40, 130), layout, E4M3)
        for fp8_dtype in (E4M3, E5M2):
            _compare(x, layout, fp8_dtype)
            _compare(x.t().contiguous(), layout, fp8_dtype)

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(
        layout=st.sampled_from(sorted(LAYOUTS)),
        rows=st.integers(1, 140),
        cols=st.integers(1, 140),
        log_scale=st.floats(-30, 30),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        e5m2=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_random_shapes_and_magnitudes(layout, rows, cols, log_scale, dtype, e5m2, seed):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(rows, cols, generator=g) * 2.0**log_scale).to(dtype)
        _compare(x, layout, E5M2 if e5m2 else E4M3)

    def test_empty_tensors():
        for layout in LAYOUTS:
            for shape in ((0, 40), (5, 0)):
                _compare(torch.empty(shape), layout, E4M3)

    # ---------------------------------------------------------------- the quantizers

    RECIPES = {"blockwise": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(), "rowwise": Float8RowwiseScaling()}
    # The roles left out below, each with the layout of the one tested.
    ROLES_LIKE = {("blockwise", "input"): ["grad_output"], ("blockwise", "weight"): [],
                  ("mxfp8", "grad_output"): ["input", "weight"], ("rowwise", "grad_output"): ["input", "weight"]}

    # Every distinct (block shape, scale rule, FP8 dtype) of a role (block_layout): the
    # Float8BlockScaling input's 1x128 (its grad_output's is the same), its weight's
    # 128x128; MXFP8 and row-wise give every role the same layout (E4M3 by default).
    @pytest.mark.parametrize("name,role", [("blockwise", "input"), ("blockwise", "weight"),
                                           ("mxfp8", "grad_output"), ("rowwise", "grad_output")])
    def test_block_quantizer_triton_equals_torch(name, role):
        spec, rule, dtype = block_layout(RECIPES[name], role)
        assert all(block_layout(RECIPES[name], r) == (spec, rule, dtype) for r in ROLES_LIKE[(name, role)])
        # 2 x 140 columns: 2 blocks of 128 (ragged) / 5 MXFP8 blocks; 48 rows: ragged 128-row blocks.
        x = _input((48, 140), torch.bfloat16, seed=3).reshape(2, 24, 140)
        torch_q, triton_q = (make_quantizer(RECIPES[name], role) for _ in range(2))
        triton_q.backend = "triton"
        for transpose in (False, True):
            ref, got = torch_q.quantize(x, transpose=transpose), triton_q.quantize(x, transpose=transpose)
            assert got.shape == ref.shape and got.dtype == ref.dtype
            _assert_same_payload(got._rowwise, ref._rowwise)
            _assert_same_payload(got._columnwise, ref._columnwise)
            gat_ref = torch_q.quantize_gatherable(x, None, transpose=transpose)
            with record_kernel_paths() as log:
                gat = triton_q.quantize_gatherable(x, None, transpose=transpose)
            assert log.backends("block_quantize") == ["triton"]
            _assert_same_payload(gat._rowwise, gat_ref._rowwise)
            _assert_same_payload(gat._columnwise, gat_ref._columnwise)
        assert int(triton_q.nonfinite_amax_count) == int(torch_q.nonfinite_amax_count) > 0
        assert triton_q.stats() == torch_q.stats()

    def test_auto_backend_on_cpu_is_torch_and_float64_cannot_take_triton():
        q = make_quantizer(Float8BlockScaling(), "input")
        with record_kernel_paths() as log:
            q.quantize(torch.randn(4, 128))
        assert log.last("block_quantize").backend == "torch"
        assert "Triton kernels are for CUDA" in log.last("block_quantize").reason
        q.backend = "triton"
        with pytest.raises(ValueError, match="float64"):
            q.quantize(torch.randn(4, 128, dtype=torch.float64))

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_training_step_through_triton_kernels_equals_torch(name):
        """fwd + dgrad + wgrad of a 2-layer MLP: every cast through Triton (both layouts of
        x, W and dy) gives bit-identical outputs and gradients to the torch quantizers."""
        recipe = RECIPES[name]

        def step(backend):
            torch.manual_seed(0)
            model = te.ops.Sequential(te.ops.Linear(128, 64), te.ops.GELU(), te.ops.Linear(64, 128))
            linears = [op for op in model.modules() if isinstance(op, te.ops.BasicLinear)]
            for op in linears:
                for q in op._quantizers.get(recipe).values():
                    q.backend = backend
            x = torch.randn(2, 64, 128, requires_grad=True)
            with record_kernel_paths() as log, te.autocast(recipe=recipe):
                y = model(x)
            y.float().square().sum().backward(inputs=[x, *model.parameters()])
            return log, y, x.grad, [p.grad for p in model.parameters()]

        with record_kernel_paths() as log_t:
            log_t_fwd, y_t, dx_t, g_t = step("triton")
        log_r_fwd, y_r, dx_r, g_r = step("torch")
        assert set(log_t.backends("block_quantize")) == {"triton"}
        assert len(log_t.backends("block_quantize")) == 6  # x and W of 2 layers, dy of 2 layers
        assert set(log_r_fwd.backends("block_quantize")) == {"torch"}
        assert torch.equal(y_t, y_r) and torch.equal(dx_t, dx_r)
        assert all(torch.equal(a, b) for a, b in zip(g_t, g_r))
