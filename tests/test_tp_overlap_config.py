"""Overlap configuration (Megatron YAML), TPOverlap, and the single-process (TP=1) behaviour
of the overlap fusions. Multi-rank overlap tests are in test_tp_overlap.py."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tolerances import assert_close
from tp_fuse.ops import AllGather, AllReduce, BasicLinear, Bias, LayerNorm, ReduceScatter, Sequential
from tp_fuse.overlap.config import GemmOverlapConfig, OverlapConfig, TPOverlap

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "megatron_overlap.yaml")


def test_defaults_follow_megatron():
    cfg = OverlapConfig()
    methods = {k: (e.method, e.num_splits) for k, e in cfg.gemms.items()}
    assert methods["qkv_fprop"][0] == methods["fc1_fprop"][0] == "ring_exchange"
    assert methods["proj_fprop"] == methods["fc2_fprop"] == ("pipeline", 4)
    for key in ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"):
        assert methods[key][0] == "bulk", key
    assert methods["proj_dgrad"][0] == methods["fc2_dgrad"][0] == "ring_exchange"
    assert len(cfg.gemms) == 12 and cfg.enabled and cfg.ignored_fields() == []
    # Unnamed GEMMs take the defaults of their parallel role.
    assert cfg.resolve(None, "fprop", "column") == ("column_fprop", GemmOverlapConfig("ring_exchange"))
    assert cfg.resolve(None, "fprop", "row")[1].method == "pipeline"


def test_megatron_yaml_loads_as_is():
    with pytest.warns(UserWarning, match="num_sm"):
        cfg = OverlapConfig.from_yaml(FIXTURE)
    assert cfg.source == FIXTURE
    assert cfg.entry("proj_fprop") == GemmOverlapConfig(
        "pipeline", num_splits=2, gpu_only=cfg.entry("proj_fprop").gpu_only,
        explicit=cfg.entry("proj_fprop").explicit,
    )
    assert cfg.entry("fc2_fprop").method == "ring_exchange"
    assert (cfg.entry("fc1_dgrad").method, cfg.entry("fc1_dgrad").num_splits) == ("pipeline", 2)
    # Keys the file does not mention keep Megatron's defaults.
    assert cfg.entry("qkv_wgrad").method == "bulk" and cfg.entry("proj_wgrad").method == "bulk"
    ignored = cfg.ignored_fields()
    assert "proj_fprop.num_sm=24 (SMs given to the communication kernel (GPU-only))" in ignored
    assert any(i.startswith("fc2_fprop.atomic_gemm=0") for i in ignored)
    assert any(i.startswith("proj_fprop.fp8_buf=0") for i in ignored)
    # aggregate: 0 is the default behaviour, so nothing to report for it.
    assert not any("aggregate" in i for i in ignored)


def test_yaml_text_and_ignored_settings_without_effect():
    text = "fc1_fprop:\n  method: ring_exchange\n  aggregate: 1\n  num_splits: 8\n"
    cfg = OverlapConfig.from_yaml(text, warn_ignored=False)
    ignored = cfg.ignored_fields()
    assert any(i.startswith("fc1_fprop.aggregate=1 (not implemented") for i in ignored), ignored
    assert "fc1_fprop.num_splits=8 (only the pipeline method splits)" in ignored


@pytest.mark.parametrize(
    "text, needles",
    [
        ("fc3_fprop:\n  method: bulk\n", ["fc3_fprop", "unknown GEMM name"]),
        ("qkv_fprop:\n  method: ring_exchange\n  num_smm: 4\n", ["qkv_fprop", "num_smm", "unknown field"]),
        ("qkv_fprop:\n  method: ring\n", ["qkv_fprop", "'ring'", "ring_exchange"]),
        ("qkv_fprop:\n  num_splits: 2\n", ["qkv_fprop", "'method' is required"]),
        ("proj_fprop:\n  method: pipeline\n  num_splits: 0\n", ["proj_fprop", "num_splits"]),
        ("proj_fprop:\n  method: pipeline\n  aggregate: 3\n", ["proj_fprop", "aggregate"]),
        ("proj_fprop: pipeline\n", ["proj_fprop", "mapping"]),
        ("- qkv_fprop\n", ["expected a mapping"]),
    ],
)
def test_bad_yaml_raises_naming_the_problem(text, needles):
    with pytest.raises(ValueError) as e:
        OverlapConfig.from_yaml(text)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_extra_layers_disable_and_with_entry():
    with pytest.raises(ValueError, match="lm_head_fprop"):
        OverlapConfig.from_dict({"lm_head_fprop": {"method": "ring_exchange"}})
    cfg = OverlapConfig.from_dict({"lm_head_fprop": {"method": "ring_exchange"}}, extra_layers=["lm_head"])
    assert cfg.resolve("lm_head", "fprop", "column")[0] == "lm_head_fprop"
    with pytest.raises(ValueError, match="lm_head_dgrad"):
        cfg.resolve("lm_head", "dgrad", "column")
    with pytest.raises(ValueError, match="'attn'"):
        cfg.resolve("attn", "fprop", "column")
    off = cfg.disable("fc2_fprop", "qkv")
    assert not off.entry("fc2_fprop").enabled and off.entry("fc2_dgrad").enabled
    assert not any(off.entry(f"qkv_{s}").enabled for s in ("fprop", "dgrad", "wgrad"))
    assert cfg.entry("fc2_fprop").enabled  # copies, the original is unchanged
    with pytest.raises(ValueError, match="unknown GEMM name 'fc9'"):
        cfg.disable("fc9")
    changed = cfg.with_entry("proj_fprop", method="ring_exchange", num_splits=3)
    assert changed.entry("proj_fprop").method == "ring_exchange"
    assert "proj_fprop.num_splits=3 (only the pipeline method splits)" in changed.ignored_fields()
    with pytest.raises(ValueError, match="enabled"):
        OverlapConfig(enabled=1)  # type: ignore[arg-type]


def test_tp_overlap_validates_its_arguments():
    from tp_fuse import comm

    pool = comm.UserBufferPool()
    ov = TPOverlap(OverlapConfig(enabled=False), pool)
    assert ov.pool is pool and not ov.config.enabled
    with pytest.raises(ValueError, match="OverlapConfig"):
        TPOverlap({"qkv_fprop": {}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="UserBufferPool"):
        TPOverlap(pool=object())
    with pytest.raises(ValueError, match="save_gathered_input"):
        TPOverlap(save_gathered_input="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TPOverlap"):
        AllGather(overlap=OverlapConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ProcessGroup"):
        ReduceScatter(process_group="tp")  # type: ignore[arg-type]
    # An op without an explicit TPOverlap owns a default one (created once).
    ag = AllGather()
    assert ag.default_overlap() is ag.default_overlap()
    assert ag.default_overlap().config.enabled


def test_tp1_nothing_to_overlap_identity_and_reasons():
    """Without torch.distributed the TP size is 1: comm ops are identities, nothing fuses."""
    torch.manual_seed(0)
    lin1 = BasicLinear(5, 6, userbuffers_options={"comm_name": "fc1"})
    bias1 = Bias(6)
    lin2 = BasicLinear(6, 5, userbuffers_options={"comm_name": "fc2"})
    with torch.no_grad():
        bias1.bias.normal_()
    seq = Sequential(AllGather(), lin1, bias1, lin2, ReduceScatter(), LayerNorm(5), AllGather(), AllReduce())
    x = torch.randn(3, 5, dtype=torch.float64).float().requires_grad_()
    y = seq(x)
    y.square().sum().backward()
    ref_x = x.detach().double().requires_grad_()
    h = ref_x @ lin1.weight.double().t() + bias1.bias.double()
    h = h @ lin2.weight.double().t()
    ref = torch.nn.functional.layer_norm(h, (5,))
    ref.square().sum().backward()
    assert_close(y, ref)
    assert_close(x.grad, ref_x.grad)
    text = str(seq.explain())
    # AG+GEMM and GEMM+RS, fwd and bwd; and once each in the compile section's window lines.
    assert text.count("TP size 1: nothing to overlap") == 6, text
    assert text.count("the eager fuser does not fuse it either: TP size 1: nothing to overlap") == 2, text
    assert "AllGather followed by AllReduce, not BasicLinear: no GEMM to overlap the gather with" in text
    fuser = seq.fusers()[0]
    names = [type(op).__name__ for op, _ in fuser.forward_ops + fuser.backward_ops]
    assert not any(n.startswith("Userbuffers") for n in names), names


def test_allgather_followed_by_layernorm_reason():
    seq = Sequential(AllGather(), LayerNorm(4), BasicLinear(4, 4))
    text = str(seq.explain())
    assert "AllGather followed by LayerNorm, not BasicLinear" in text


def test_bad_userbuffers_options_raise_at_fusion():
    seq = Sequential(AllGather(), BasicLinear(4, 4, userbuffers_options={"comm_name": "fc1", "overlapp": 1}))
    # TP size 1 rejects before looking at options, so check the resolver directly.
    from tp_fuse.ops.fused.userbuffers_common import resolve_overlap

    with pytest.raises(ValueError, match="overlapp"):
        resolve_overlap(seq[1], seq[0])
    lin = BasicLinear(4, 4, userbuffers_options={"overlap": TPOverlap()})
    with pytest.raises(ValueError, match="different TPOverlap"):
        resolve_overlap(lin, AllGather(overlap=TPOverlap()))
    with pytest.raises(ValueError, match="must be a tp_fuse.overlap.config.TPOverlap"):
        resolve_overlap(BasicLinear(4, 4, userbuffers_options={"overlap": "x"}), AllGather())
    with pytest.raises(ValueError, match="comm_name"):
        resolve_overlap(BasicLinear(4, 4, userbuffers_options={"comm_name": 3}), AllGather())
    shared = TPOverlap()
    assert resolve_overlap(BasicLinear(4, 4, userbuffers_options={"overlap": shared}), AllGather(overlap=shared)) is shared


def test_config_warning_can_be_silenced():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OverlapConfig.from_yaml(FIXTURE, warn_ignored=False)
