"""TE's ``transformer_engine.pytorch.utils`` device queries under tp_fuse's names."""

import pytest
import torch

import tp_fuse as te
import tp_fuse.utils as tp_fuse_utils
from tp_fuse.utils import get_device_compute_capability, is_non_tn_fp8_gemm_supported


def test_compute_capability_is_a_pair_and_exported_at_top_level():
    # TE exports it from transformer_engine.pytorch and .utils; the same function here.
    assert te.get_device_compute_capability is get_device_compute_capability
    cap = get_device_compute_capability()
    assert isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(v, int) for v in cap)
    if torch.cuda.is_available():
        assert cap == torch.cuda.get_device_capability()
    else:
        # No GPU: every "sm90 or newer" requirement must read False.
        assert cap == (0, 0) and not cap >= (9, 0)


def test_fp8_gemms_run_tn_so_transposes_are_used():
    # False everywhere: the FP8 GEMMs here read the cached FP8 transpose (TN layout).
    assert is_non_tn_fp8_gemm_supported() is False
    q = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, device="cpu")
    q.set_usage(rowwise=True, columnwise=True)
    x = q(torch.randn(4, 8))
    t = x.transpose_data()
    assert t.shape == (8, 4) and torch.equal(t.view(torch.uint8), x._data.t().contiguous().view(torch.uint8))


def test_te_init_and_mask_helpers():
    torch.manual_seed(0)
    w = torch.empty(4000)
    assert tp_fuse_utils.init_method_normal(0.5)(w) is w and abs(w.std().item() - 0.5) < 0.02
    tp_fuse_utils.scaled_init_method_normal(0.5, 8)(w)
    assert abs(w.std().item() - 0.5 / 4.0) < 0.005  # sigma / sqrt(2 * num_layers)
    scores = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    out = tp_fuse_utils.attention_mask_func(scores, mask)
    assert out is scores and torch.equal(out, torch.where(mask, -10000.0, 0.0))
    with pytest.raises(ValueError, match="sigma"):
        tp_fuse_utils.init_method_normal(0.0)
    with pytest.raises(ValueError, match="num_layers"):
        tp_fuse_utils.scaled_init_method_normal(0.1, 0)
