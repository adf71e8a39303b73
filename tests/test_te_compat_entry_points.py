"""TE entry points Megatron-Core's TE spec needs (issue 38), each against what TE's source says:
``DotProductAttention``, ``LayerNorm`` / ``RMSNorm``, ``GroupedLinear``, ``fp8.fp8_autocast`` /
``FP8GlobalStateManager``, ``distributed.CudaRNGStatesTracker`` / ``activation_recompute_forward``,
``tensor.QuantizedTensor``, ``router`` (refused when called), ``TE_API_VERSION`` and the strict
``transformer_engine`` alias (:mod:`tp_fuse.te.te_alias`, in a subprocess: it registers
``transformer_engine`` for the whole process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tp_fuse as te
from tp_fuse.distributed import CudaRNGStatesTracker, activation_recompute_forward, is_fp8_activation_recompute_enabled
from tp_fuse.fp8 import FP8GlobalStateManager, fp8_autocast
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling

torch.set_num_threads(1)


# ---- DotProductAttention -------------------------------------------------------------------


def _ref_attention(q, k, v, masked, scale):
    """float64 softmax(q k^T * scale, masked -> -inf) v on [s, b, h, d] inputs -> [s, b, h*dv]."""
    n, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(n // g, dim=2)
    v = v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double()) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v.double())
    return out.reshape(out.shape[0], out.shape[1], -1)


def _qkv(sq=6, skv=6, b=2, n=4, g=2, d=8, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sq, b, n, d, generator=gen), torch.randn(skv, b, g, d, generator=gen),
            torch.randn(skv, b, g, dv, generator=gen))


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_dpa_causal_and_no_mask_with_gqa(mask_type):
    q, k, v = _qkv()
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type=mask_type)
    out = dpa(q, k, v)
    assert out.shape == (6, 2, 32)
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1) if mask_type == "causal" else None
    torch.testing.assert_close(out.double(), _ref_attention(q, k, v, causal, 8 ** -0.5), rtol=1e-5, atol=1e-5)


def test_dpa_forward_mask_type_overrides_constructor_and_mask_ignored_for_causal():
    # Megatron: forward(q, k, v, attention_mask, attn_mask_type=...); TE ignores the mask for causal.
    q, k, v = _qkv()
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="padding")
    junk = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    out = dpa(q, k, v, junk, attn_mask_type="causal")
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    torch.testing.assert_close(out.double(), _ref_attention(q, k, v, causal, 8 ** -0.5), rtol=1e-5, atol=1e-5)


def test_dpa_padding_mask_true_is_masked_out():
    q, k, v = _qkv()
    pad = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    pad[1, ..., 4:] = True  # sample 1: last two keys are padding
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="padding")
    out = dpa(q, k, v, pad)
    masked = (pad.reshape(2, 1, 1, 6) | pad.reshape(2, 1, 6, 1))
    ref = _ref_attention(q, k, v, masked, 8 ** -0.5)
    keep = ~pad.reshape(2, 6).T  # rows of real queries (padded query rows are all -inf: NaN in the reference)
    torch.testing.assert_close(out.double()[keep], ref[keep], rtol=1e-5, atol=1e-5)


def test_dpa_sliding_window_softmax_scale_bshd_and_dv():
    q, k, v = _qkv(d=8, dv=4)
    dpa = te.DotProductAttention(4, (8, 4), num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal",
                                 window_size=(2, 0), softmax_scale=0.3)
    out = dpa(*(t.transpose(0, 1) for t in (q, k, v)))
    assert out.shape == (2, 6, 16)  # [b, s, n*dv]
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    masked = (j > i) | (j < i - 2)
    torch.testing.assert_close(out.transpose(0, 1).double(), _ref_attention(q, k, v, masked, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_dpa_window_checked_as_te_does():
    from tp_fuse.attention.dot_product_attention import check_set_window_size

    assert check_set_window_size("causal") == (-1, 0) and check_set_window_size("no_mask") == (-1, -1)
    with pytest.warns(UserWarning, match="window_size"):
        assert check_set_window_size("padding_causal", (4, 2)) == (4, 0)  # TE closes the right side
    with pytest.warns(UserWarning, match="window_size"):
        assert check_set_window_size("padding", (-1, 0)) == (-1, -1)
    with pytest.raises(ValueError, match="Invalid attn_mask_type"):
        check_set_window_size("bogus")
    with pytest.warns(UserWarning):
        dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, window_size=(1, 3))  # causal: becomes (1, 0)
    q, k, v = _qkv()
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    torch.testing.assert_close(dpa(q, k, v).double(), _ref_attention(q, k, v, (j > i) | (j < i - 1), 8 ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_dpa_cross_attention_bottom_right_and_tp_heads():
    # TE's num_attention_heads / num_gqa_groups are global: with tp_size 2 a rank holds half.
    q, k, v = _qkv(sq=3, skv=5, n=2, g=1)
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, tp_size=2, attention_type="cross",
                                 attn_mask_type="causal_bottom_right")
    out = dpa(q, k, v)
    i, j = torch.arange(3)[:, None], torch.arange(5)[None, :]
    torch.testing.assert_close(out.double(), _ref_attention(q, k, v, j > i + 2, 8 ** -0.5), rtol=1e-5, atol=1e-5)


def test_dpa_gradients_and_checkpoint_core_attention():
    q, k, v = (t.double().requires_grad_() for t in _qkv())
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2)
    out = dpa(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    dpa(q, k, v, checkpoint_core_attention=True).sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(t.grad, a, rtol=0, atol=0)


def test_dpa_dropout_draws_from_the_tracker_stream():
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, attention_dropout=0.5, get_rng_state_tracker=lambda: tracker)
    q, k, v = _qkv()
    states = tracker.get_states()
    global_before = torch.get_rng_state()
    a = dpa(q, k, v)
    assert torch.equal(torch.get_rng_state(), global_before)  # the caller's stream is untouched
    tracker.set_states(states)
    assert torch.equal(dpa(q, k, v), a)  # same stream state: same masks
    dpa.eval()
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    torch.testing.assert_close(dpa(q, k, v).double(), _ref_attention(q, k, v, causal, 8 ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(cp_group=object()), "cp_group"),
    (dict(cp_global_ranks=[0, 1]), "cp_global_ranks"),
    (dict(qkv_format="thd"), "qkv_format"),
    (dict(softmax_type="learnable"), "softmax_type"),
    (dict(attn_mask_type="causal", window_size=(-2, 0)), "window_size"),
])
def test_dpa_refuses_unsupported_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        te.DotProductAttention(4, 8, **kwargs)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(cu_seqlens_q=torch.tensor([0, 6])), "cu_seqlens_q"),
    (dict(max_seqlen_kv=6), "max_seqlen_kv"),
    (dict(qkv_format="thd"), "qkv_format"),
    (dict(core_attention_bias_type="post_scale_bias"), "core_attention_bias_type"),
])
def test_dpa_refuses_packed_sequences_in_forward(kwargs, arg):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=arg):
        te.DotProductAttention(4, 8, num_gqa_groups=2)(q, k, v, **kwargs)


# ---- LayerNorm / RMSNorm ---------------------------------------------------------------------


def test_layernorm_and_rmsnorm_match_torch_with_te_names():
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    ln = te.LayerNorm(hidden_size=8, eps=1e-5, sequence_parallel=True, params_dtype=torch.float64, device="cpu")
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    torch.testing.assert_close(ln(x), F.layer_norm(x, (8,), ln.weight, ln.bias, 1e-5))
    rms = te.RMSNorm(8, eps=1e-6, params_dtype=torch.float64)
    assert [n for n, _ in rms.named_parameters()] == ["weight"] and rms.weight.sequence_parallel is False
    with torch.no_grad():
        rms.weight.normal_()
    y = rms(x)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight)
    y.sum().backward()
    assert rms.weight.grad is not None and x.grad is not None


def test_norm_zero_centered_gamma_stores_gamma_minus_one():
    x = torch.randn(4, 8, dtype=torch.float64)
    ln = te.LayerNorm(8, zero_centered_gamma=True, params_dtype=torch.float64)
    assert torch.count_nonzero(ln.weight) == 0  # TE: initialized to 0, applied as (1 + weight)
    with torch.no_grad():
        ln.weight.fill_(0.5)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (8,)) * 1.5)


def test_reset_parameters_materializes_meta_and_initializes_as_te():
    # TE's deferred init: build on "meta", then reset_parameters() allocates and initializes.
    for m in (te.Linear(64, 32, device="meta"), te.LayerNormMLP(64, 128, device="meta"),
              te.LayerNorm(64, device="meta", zero_centered_gamma=True)):
        m.reset_parameters(defer_init=True)
        assert all(p.is_meta for p in m.parameters())
        m.reset_parameters()
        for n, p in m.named_parameters():
            assert not p.is_meta, n
            if n.endswith("bias") or n == "weight" and isinstance(m, te.LayerNorm):
                assert torch.count_nonzero(p) == 0, n
            elif n == "layer_norm_weight":
                assert torch.all(p == 1), n
            else:
                assert abs(p.std().item() - 0.023) < 0.005, n  # TE's default init_method
        assert m(torch.randn(3, 64)).shape[-1] in (32, 64)


def test_norm_argument_errors():
    with pytest.raises(ValueError, match="normalized_shape"):
        te.LayerNorm()
    with pytest.raises(ValueError, match="not both"):
        te.LayerNorm(8, hidden_size=8)
    with pytest.raises(ValueError, match="eps"):
        te.RMSNorm(8, eps=-1.0)
    with pytest.raises(ValueError, match="unexpected"):
        te.RMSNorm(8, foo=1)


# ---- GroupedLinear -------------------------------------------------------------------------------


def test_grouped_linear_module_matches_per_group_linears():
    torch.manual_seed(0)
    m = te.GroupedLinear(3, 8, 4, params_dtype=torch.float64)
    # TE's registration order (TE's test_grouped_linear compares parameters() with Linear's).
    assert [n for n, _ in m.named_parameters()] == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert [n for n, _ in te.GroupedLinear(2, 8, 4, return_bias=True).named_parameters()] == [
        "weight0", "bias0", "weight1", "bias1"]
    assert abs(m.weight0.std().item() - 0.023) < 0.01  # TE's default init normal(0, 0.023)
    with torch.no_grad():
        for i in range(3):
            getattr(m, f"bias{i}").normal_()
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    splits = [2, 0, 5]
    y = m(x, splits)
    parts = x.split(splits)
    ref = torch.cat([F.linear(p, getattr(m, f"weight{i}"), getattr(m, f"bias{i}")) for i, p in enumerate(parts)])
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    assert torch.count_nonzero(m.weight1.grad) == 0  # empty group


def test_get_align_size_for_quantization_te_values():
    from tp_fuse.fp8 import get_align_size_for_quantization
    from tp_fuse.recipe import CustomRecipe, MXFP8BlockScaling, NVFP4BlockScaling, Float8BlockScaling

    assert get_align_size_for_quantization(DelayedScaling()) == 16
    assert get_align_size_for_quantization(Float8CurrentScaling()) == 16
    assert get_align_size_for_quantization(Float8BlockScaling()) == 16
    assert get_align_size_for_quantization(MXFP8BlockScaling()) == 32
    assert get_align_size_for_quantization(NVFP4BlockScaling()) == 128
    assert get_align_size_for_quantization(CustomRecipe(qfactory=lambda role: None, quantization_alignment=64)) == 64
    with pytest.raises(ValueError, match="expected a tp_fuse.recipe recipe"):
        get_align_size_for_quantization("fp8")


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_general_grouped_gemm_is_the_per_group_general_gemm(layout):
    """TE's grouped GEMM entry point: each group's result is general_gemm's, bit for bit (an
    empty group included), into one output (fprop/dgrad) or one per group (wgrad)."""
    from tp_fuse.te.cpp_extensions import general_gemm, general_grouped_gemm

    gen = torch.Generator().manual_seed(0)
    splits, k, n = [3, 0, 4], 5, 6
    m = sum(splits)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)
    if layout == "NT":
        A, B, out = list(rnd(m, k).split(splits)), list(rnd(m, n).split(splits)), [rnd(n, k) for _ in splits]
    else:
        A = [rnd(n, k) for _ in splits]
        B = list(rnd(m, k if layout == "TN" else n).split(splits))
        out = [rnd(m, n if layout == "TN" else k)]
    ref = [o.clone() for o in (out if layout == "NT" else out[0].split(splits))]
    for i in range(3):
        if ref[i].numel():
            general_gemm(A[i], B[i], torch.float64, accumulate=True, layout=layout, out=ref[i])
    got, _, _ = general_grouped_gemm(A, B, out, [None] * 3, torch.float64, layout=layout, m_splits=splits,
                                     accumulate=True, single_output=layout != "NT")
    torch.testing.assert_close(got if layout == "NT" else [got], ref if layout == "NT" else [torch.cat(ref)],
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="single_output=True needs m_splits"):
        general_grouped_gemm(A, B, out, [None] * 3, torch.float64, layout=layout, single_output=True)


def test_fp8_padding_pads_each_group_and_unpadding_inverts_it():
    x = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    y, padded = te.Fp8Padding(3, 16)(x, [5, 0, 15])
    assert padded == [16, 0, 16]
    torch.testing.assert_close(y, torch.cat([x[:5], torch.zeros(11, 4, dtype=torch.float64), x[5:],
                                             torch.zeros(1, 4, dtype=torch.float64)]), rtol=0, atol=0)
    z = te.Fp8Unpadding(3, 16)(y * 2, [5, 0, 15])
    torch.testing.assert_close(z, 2 * x, rtol=0, atol=0)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0), rtol=0, atol=0)
    # align_size None: the active recipe's (TE's), fixed at the first forward.
    p = te.Fp8Padding(2)
    with te.autocast(recipe=DelayedScaling()):
        assert p(torch.randn(3, 4), [1, 2])[1] == [16, 16] and p.align_size == 16
    aligned = torch.randn(32, 4)
    assert te.Fp8Padding(2, 16)(aligned, [16, 16])[0] is aligned
    with pytest.raises(ValueError, match="m_splits has 1 entries, expected num_gemms=2"):
        te.Fp8Unpadding(2, 16)(aligned, [32])
    with pytest.raises(ValueError, match="align_size must be None or a positive int"):
        te.Fp8Padding(2, 0)


def test_grouped_linear_return_bias_adds_no_bias():
    m = te.GroupedLinear(2, 4, 3, return_bias=True, params_dtype=torch.float64)
    with torch.no_grad():
        m.bias0.fill_(1.0)
    x = torch.randn(5, 4, dtype=torch.float64)
    y, biases = m(x, [2, 3])
    torch.testing.assert_close(y, torch.cat([x[:2] @ m.weight0.T, x[2:] @ m.weight1.T]))
    assert len(biases) == 2 and torch.equal(biases[0], torch.ones(3, dtype=torch.float64))


def test_grouped_linear_refusals():
    with pytest.raises(ValueError, match="tp_size"):
        te.GroupedLinear(2, 4, 4, tp_size=2, parallel_mode="column")
    with pytest.raises(ValueError, match="delay_wgrad_compute must be a bool"):
        te.GroupedLinear(2, 4, 4, delay_wgrad_compute=1)
    with pytest.raises(ValueError, match="m_splits"):
        te.GroupedLinear(2, 4, 4)(torch.randn(3, 4), [3])


# ---- fp8 ---------------------------------------------------------------------------------------


def test_fp8_autocast_te_keywords_and_state_manager_reads_autocast():
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), DelayedScaling)  # TE's default
    recipe = Float8CurrentScaling()
    with fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=None):
        assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is recipe
        assert FP8GlobalStateManager.get_fp8_group() is None
        with te.autocast(enabled=False):
            assert not FP8GlobalStateManager.is_fp8_enabled()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    with pytest.raises(ValueError, match="calibrating"):
        with fp8_autocast(calibrating=True):
            pass
    with pytest.raises(NotImplementedError, match="reduce_and_update_fp8_tensors"):
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def test_state_manager_reset_is_empty_outside_autocast_and_refused_inside():
    FP8GlobalStateManager.reset()  # TE's tests call it after every case: nothing global here
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        with pytest.raises(ValueError, match="reset: called inside autocast"):
            FP8GlobalStateManager.reset()
        assert FP8GlobalStateManager.is_fp8_enabled()


def test_fp8_autocast_runs_a_te_linear_in_fp8():
    torch.manual_seed(0)
    m = te.Linear(32, 16)
    x = torch.randn(8, 32)
    with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        y = m(x)
    q = m.fp8_meta["scaling_fwd"]
    assert not torch.equal(y, m(x))  # FP8 differs from fp32 ...
    torch.testing.assert_close(y, m(x), rtol=0.2, atol=0.1)  # ... within FP8 error
    assert q.amax_history.abs().sum() > 0


# ---- distributed -----------------------------------------------------------------------------------


def test_cuda_rng_states_tracker_te_api():
    tr = CudaRNGStatesTracker()
    tr.add("model-parallel-rng", 5)
    with pytest.raises(ValueError, match="seed 5"):
        tr.add("other", 5)
    with pytest.raises(ValueError, match="already exists"):
        tr.add("model-parallel-rng", 6)
    before = torch.get_rng_state()
    with tr.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(5)))
    with tr.fork():
        b = torch.rand(4)  # the stream continues
    assert not torch.equal(a, b)
    saved = tr.get_states()
    with tr.fork():
        c = torch.rand(4)
    tr.set_states(saved)
    with tr.fork():
        assert torch.equal(torch.rand(4), c)
    with pytest.raises(ValueError, match="not added"):
        with tr.fork("nope"):
            pass
    assert te.distributed.CudaRNGStatesTracker is CudaRNGStatesTracker  # TE's path via tp_fuse.distributed


def test_activation_recompute_forward_marks_and_refuses_fp8():
    assert not is_fp8_activation_recompute_enabled()
    with activation_recompute_forward(activation_recompute=True, recompute_phase=False):
        assert is_fp8_activation_recompute_enabled()
    assert not is_fp8_activation_recompute_enabled()
    with fp8_autocast():
        with pytest.raises(NotImplementedError, match="tp_fuse.distributed.checkpoint"):
            with activation_recompute_forward(activation_recompute=True):
                pass


# ---- tensor, router, version ----------------------------------------------------------------------


def test_tensor_path_router_and_version():
    from tp_fuse.quantization import QuantizedTensor
    from tp_fuse.router import fused_topk_with_score_function
    from tp_fuse.tensor import QuantizedTensor as TensorPathQuantizedTensor
    from tp_fuse.te import TE_API_VERSION

    assert TensorPathQuantizedTensor is QuantizedTensor
    with pytest.raises(NotImplementedError, match="fused_topk_with_score_function"):
        fused_topk_with_score_function(torch.randn(4, 8), topk=2)
    major, minor = (int(p) for p in TE_API_VERSION.split(".")[:2])
    assert (2, 9) <= (major, minor) < (2, 12)  # what megatron-core 0.16.1 accepts
    assert te.__version__ == "0.1.0"  # tp_fuse's own version is unrelated


_ALIAS_SCRIPT = """
import importlib, sys
from tp_fuse.te import te_alias, TE_API_VERSION
te_alias.install()
import transformer_engine, transformer_engine.pytorch as tep, tp_fuse, tp_fuse.te.recipe
assert transformer_engine.__version__ == TE_API_VERSION
assert tep is tp_fuse
from transformer_engine.pytorch.module.base import get_ub
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint
from transformer_engine.pytorch.tensor import QuantizedTensor
from transformer_engine.common.recipe import DelayedScaling
r = DelayedScaling(margin=0, fp8_format=tp_fuse.recipe.Format.HYBRID, override_linear_precision=(False, False, False),
                   fp8_dpa=False, fp8_mha=False, params_dtype=None, device="cpu")
assert isinstance(r, tp_fuse.recipe.DelayedScaling)
for bad in (dict(fp8_dpa=True), dict(override_linear_precision=(False, False, True)), dict(foo=1)):
    try:
        DelayedScaling(**bad)
    except ValueError:
        pass
    else:
        raise AssertionError(bad)
try:
    importlib.import_module("transformer_engine.pytorch.no_such_module")
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("a missing TE module must not import")
try:
    from transformer_engine.pytorch.distributed import no_such_name
except ImportError:
    pass
else:
    raise AssertionError("a missing TE name must not import")
print("ok")
"""


def test_te_alias_is_strict_and_reports_the_api_version():
    res = subprocess.run([sys.executable, "-c", _ALIAS_SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
