"""tp_fuse's debug features through nvdlfw-inspect (Transformer Engine's debug API calls)."""

from __future__ import annotations

import textwrap

import pytest
import torch

nvdlfw = pytest.importorskip("nvdlfw_inspect")
import nvdlfw_inspect.api as debug_api  # noqa: E402

import tp_fuse as te  # noqa: E402
import tp_fuse.debug  # noqa: E402
from debug_logging import start_debug  # noqa: E402
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

TE_YAML = """
log_fc1:
  enabled: True
  layers:
    layer_name_regex_pattern: .*fc1
  transformer_engine:
    LogTensorStats:
      enabled: True
      tensors: [activation, gradient, weight]
      stats: [max, min, mean, std, l1_norm]
      freq: 2
    LogFp8TensorStats:
      enabled: True
      tensors_struct:
        - tensor: activation
          stats: [underflows%, mse]
disable_fc2:
  enabled: True
  layers:
    layer_name_regex_pattern: .*fc2
  transformer_engine:
    DisableFP8GEMM:
      enabled: True
      gemms: [fprop, dgrad]
"""


@pytest.fixture
def api(tmp_path):
    """initialize(config, feature_dirs=[tp_fuse's]) -> the logger; end_debug afterwards."""
    started = []

    def start(config: str, **kwargs):
        logger = start_debug(tmp_path, config, **kwargs)
        started.append(True)
        return logger

    yield start
    if started:
        debug_api.end_debug()


def _mlp(seed=0):
    torch.manual_seed(seed)
    m = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.GELU(), te.ops.Linear(64, 32))
    m[0].basic_linear.name = "decoder.1.fc1"
    m[2].basic_linear.name = "decoder.1.fc2"
    return m


def _step(model, x, recipe=DelayedScaling()):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = model(x)
    y.sum().backward()
    return y.detach(), x.grad


def test_te_yaml_initialize_steps_log_stats_through_nvdlfw_inspect(api):
    logger = api(TE_YAML)
    model = _mlp()
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for x in xs:
        _step(model, x)
        debug_api.step()
    # freq: 2 -> iterations 0 and 2; TE's names <layer>_<tensor>_<stat>.
    assert {it for (_, it) in logger.rows if "_max" in _} == {0, 2}
    assert logger.rows[("decoder.1.fc1_activation_max", 0)] == pytest.approx(xs[0].max().item())
    assert logger.rows[("decoder.1.fc1_activation_mean", 2)] == pytest.approx(xs[2].mean().item(), abs=1e-6)
    assert logger.rows[("decoder.1.fc1_activation_std", 0)] == pytest.approx(xs[0].std().item(), rel=1e-5)
    w = model[0].basic_linear.weight.detach()
    assert logger.rows[("decoder.1.fc1_weight_l1_norm", 0)] == pytest.approx(w.abs().sum().item(), rel=1e-5)
    # LogFp8TensorStats has no freq: every iteration.
    assert {it for (n, it) in logger.rows if n == "decoder.1.fc1_activation_mse"} == {0, 1, 2}
    assert 0 < logger.rows[("decoder.1.fc1_activation_mse", 1)] < 1e-2
    assert not any(n.startswith("decoder.1.fc2") for (n, _) in logger.rows)
    # Selected layers run unfused, through the debug path.
    report = str(te.explain(model))
    assert "debug features enabled on decoder.1.fc" in report or "tp_fuse.debug features" in report


def test_disable_fp8_gemm_takes_effect(api):
    api(TE_YAML)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    model = _mlp()
    y, _ = _step(model, x, Float8CurrentScaling())
    # fc2's fprop in high precision: y equals fc2 applied in fp32 to fc1's (FP8) output
    # (current scaling: the reference pass casts fc1's operands with the same scales).
    with te.autocast(recipe=Float8CurrentScaling()):
        h = model[1](model[0](x))
    fc2 = model[2]
    ref = torch.nn.functional.linear(h.detach(), fc2.basic_linear.weight.detach(), fc2.bias_op.bias.detach())
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert debug_api.transformer_engine.fp8_gemm_enabled("decoder.1.fc2", gemm="fprop", iteration=0)[0] is False
    assert debug_api.transformer_engine.fp8_gemm_enabled("decoder.1.fc2", gemm="wgrad", iteration=0)[0] is True
    assert debug_api.transformer_engine.fp8_gemm_enabled("decoder.1.fc1", gemm="fprop", iteration=0)[0] is True


def test_disable_fp8_layer_runs_like_no_fp8(api):
    api("""
    off:
      enabled: True
      layers:
        layer_types: [fc1]
      transformer_engine:
        DisableFP8Layer:
          enabled: True
    """)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 64))
    model[0].basic_linear.name = "decoder.1.fc1"
    y, dx = _step(model, x)
    w, b = model[0].basic_linear.weight.detach(), model[0].bias_op.bias.detach()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, torch.ones(16, 64) @ w, rtol=1e-6, atol=1e-6)


def test_per_tensor_scaling_returns_a_current_scaled_float8_tensor(api):
    api("""
    pts:
      enabled: True
      layers:
        layer_name_regex_pattern: .*fc1
      transformer_engine:
        PerTensorScaling:
          enabled: True
          gemms_struct:
            - gemm: fprop
              tensors: [activation, weight]
    """)
    from tp_fuse.quantization.float8.delayed_scaling import DelayedScalingQuantizer

    t = torch.randn(24, 64)
    q = DelayedScalingQuantizer(DelayedScaling(), "input")
    assert debug_api.transformer_engine.modify_tensor_enabled("decoder.fc1", gemm="fprop", tensor_name="activation",
                                                              iteration=0)[0]
    assert not debug_api.transformer_engine.modify_tensor_enabled("decoder.fc1", gemm="dgrad", tensor_name="weight",
                                                                  iteration=0)[0]
    out = debug_api.transformer_engine.modify_tensor("decoder.fc1", gemm="fprop", tensor_name="activation", tensor=t,
                                                     default_quantizer=q, iteration=0)
    assert isinstance(out, te.Float8Tensor) and out.fp8_dtype == q.fp8_dtype
    torch.testing.assert_close(out.dequantize(), t, rtol=0.07, atol=1e-3)
    # The layer trains with it (both fprop operands FP8, current-scaled).
    model = _mlp()
    _step(model, torch.randn(16, 32))
    with pytest.raises(ValueError, match="PerTensorScaling.*per-tensor FP8 recipe"):
        debug_api.transformer_engine.modify_tensor("decoder.fc1", gemm="fprop", tensor_name="weight", tensor=t,
                                                   default_quantizer=None, iteration=0)


def test_no_config_defaults_and_unselected_layers_stay_fused(api, tmp_path):
    api(TE_YAML)
    assert debug_api.transformer_engine.fp8_gemm_enabled("decoder.9.qkv", gemm="fprop", iteration=0)[0]
    assert not debug_api.transformer_engine.modify_tensor_enabled("decoder.9.qkv", gemm="fprop",
                                                                  tensor_name="activation", iteration=0)[0]
    assert not debug_api.transformer_engine.inspect_tensor_enabled("decoder.9.qkv", tensor_name="activation",
                                                                   iteration=0)[0]
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 64), te.ops.GELU())
    model[0].basic_linear.name = "decoder.9.proj"
    _step(model, torch.randn(4, 32))
    assert "debug features enabled" not in str(te.explain(model))


def test_attach_debug_api_uses_tp_fuse_layer_names(api):
    logger = api("""
    s:
      enabled: True
      layers:
        layer_name_regex_pattern: ^0\\.fc1$
      transformer_engine:
        LogTensorStats:
          enabled: True
          tensors: [output]
          stats: [amax]
    """)
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(32, 64, userbuffers_options={"comm_name": "fc1"}))
    assert tp_fuse.debug.attach_debug_api(model) == ["0.fc1"]
    y, _ = _step(model, torch.randn(4, 32))
    debug_api.step()
    assert logger.rows[("0.fc1_output_amax", 0)] == pytest.approx(y.abs().max().item())


@pytest.mark.parametrize("yaml_text, match", [
    ("""
    s:
      enabled: True
      layers: {layer_name_regex_pattern: .*}
      transformer_engine:
        LogTensorStats: {enabled: True, tensors: [activation], stats: [median]}
    """, r"decoder.1.fc1: transformer_engine.LogTensorStats.stats: unknown statistic\(s\) \['median'\]"),
    ("""
    s:
      enabled: True
      layers: {layer_name_regex_pattern: .*}
      transformer_engine:
        DisableFP8GEMM: {enabled: True, gemms: [fprop, xgrad]}
    """, r"transformer_engine.DisableFP8GEMM.gemms: unknown name\(s\) \['xgrad'\]"),
    ("""
    s:
      enabled: True
      layers: {layer_name_regex_pattern: .*}
      transformer_engine:
        FakeQuant: {enabled: True, gemms: [fprop], tensors: [activation], quant_format: FP8E3M4}
    """, r"transformer_engine.FakeQuant.quant_format: expected one of .*got 'FP8E3M4'"),
])
def test_wrong_feature_options_name_the_key(api, yaml_text, match):
    api(yaml_text)
    with pytest.raises(ValueError, match=match):
        _step(_mlp(), torch.randn(4, 32))


def test_unknown_feature_and_missing_feature_dir_are_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""
    s:
      enabled: True
      layers: {layer_name_regex_pattern: .*}
      transformer_engine:
        LogTensorStatz: {enabled: True}
    """))
    try:
        with pytest.raises(AssertionError, match="Could not find feature 'LogTensorStatz' in namespace "
                                                 "'transformer_engine'"):
            debug_api.initialize(str(path), feature_dirs=[tp_fuse.debug.FEATURE_DIR], log_dir=str(tmp_path))
    finally:
        debug_api.end_debug()
    path.write_text("s: {enabled: True, layers: {layer_name_regex_pattern: .*}, LogTensorStats: {enabled: True}}\n")
    debug_api.initialize(str(path), log_dir=str(tmp_path))  # no tp_fuse feature dir
    try:
        with pytest.raises(ValueError, match=r"feature_dirs=\[tp_fuse.debug.FEATURE_DIR\]"):
            _step(_mlp(), torch.randn(4, 32))
    finally:
        debug_api.end_debug()


def test_debug_session_and_debug_api_do_not_share_a_layer(api):
    api(TE_YAML)
    model = te.ops.Sequential(te.ops.Linear(32, 64, userbuffers_options={"comm_name": "fc1"}))
    tp_fuse.debug.attach_debug_api(model)
    session = tp_fuse.debug.DebugSession({"s": {"layers": {"layer_name_regex_pattern": ".*"},
                                                "transformer_engine": {"DisableFP8Layer": {}}}})
    with pytest.raises(ValueError, match="either a DebugSession or the debug API"):
        session.attach(model)


@pytest.mark.parametrize("recipe_name", ["MXFP8BlockScaling", "Float8BlockScaling"])
def test_log_fp8_tensor_stats_under_block_recipes(api, recipe_name):
    import tp_fuse.recipe as recipes

    logger = api("""
    s:
      enabled: True
      layers: {layer_name_regex_pattern: .*fc1}
      transformer_engine:
        LogFp8TensorStats:
          enabled: True
          tensors: [activation]
          stats: [mse, underflows%, scale_inv_min, scale_inv_max, scale_inv_std]
    """)
    recipe = getattr(recipes, recipe_name)()
    torch.manual_seed(0)
    model = te.ops.Sequential(te.ops.Linear(128, 128))
    model[0].basic_linear.name = "d.fc1"
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(3))
    _step(model, x, recipe)
    debug_api.step()
    with te.autocast(recipe=recipe):
        q = model[0].basic_linear.fp8_quantizers()["input"].quantize(x)
    d = q._rowwise.dequantize()
    assert logger.rows[("d.fc1_activation_mse", 0)] == pytest.approx(((d.double() - x.double()) ** 2).mean().item())
    s_inv = q._rowwise.scale_inv.double()
    assert logger.rows[("d.fc1_activation_scale_inv_min", 0)] == s_inv.min().item()
    assert logger.rows[("d.fc1_activation_scale_inv_max", 0)] == s_inv.max().item()
    assert logger.rows[("d.fc1_activation_scale_inv_std", 0)] == pytest.approx(s_inv.std().item(), rel=1e-6)


def test_scale_inv_std_under_a_per_tensor_recipe_is_an_error(api):
    api("""
    s:
      enabled: True
      layers: {layer_name_regex_pattern: .*fc1}
      transformer_engine:
        LogFp8TensorStats: {enabled: True, tensors: [activation], stats: [scale_inv_std]}
    """)
    with pytest.raises(ValueError, match="scale_inv_std describes the block scales"):
        _step(_mlp(), torch.randn(4, 32))
