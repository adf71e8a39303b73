"""launch/plot_fp8_stats.py: a plot for every recipe (per-tensor, block-scaled, NVFP4) and for a
``+model=hf`` run's GEMM names; listing, name errors, one-point histories.

The metrics files are written the way the launcher writes them: ``Fp8StatsCollector`` (the
trainer's collector) observes a tiny model trained with each recipe for a few steps and
``MetricsSink`` (the trainer's writer) stores its records in ``fp8_stats.jsonl``.
"""

from __future__ import annotations

import math

import pytest
import torch

import tp_fuse as te
from tp_fuse import recipe as R
from tp_fuse.debug import Fp8StatsCollector
from tp_fuse.launch.logging.metrics import MetricsSink
from tp_fuse.launch.plot_fp8_stats import Fp8Stats, figure, main, plot

matplotlib = pytest.importorskip("matplotlib")  # the optional `plot` extra

RECIPES = {
    "delayed": R.DelayedScaling, "current": R.Float8CurrentScaling, "blockwise": R.Float8BlockScaling,
    "mxfp8": R.MXFP8BlockScaling, "rowwise": R.Float8RowwiseScaling, "nvfp4": R.NVFP4BlockScaling,
}
HF_GEMM = "model.model.layers.0/mlp.down_proj._tp.ops.linear"


class _Gpt(torch.nn.Module):
    """Two layers named like the launcher's GPT: ``layers.<i>`` with ``fc1``/``fc2`` GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.ops.Sequential(te.ops.BasicLinear(128, 128, userbuffers_options={"comm_name": "fc1"}),
                              te.ops.BasicLinear(128, 128, userbuffers_options={"comm_name": "fc2"}))
            for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _HfLike(torch.nn.Module):
    """One GEMM at an HF-wrapped path (``model.model.layers.0.mlp.down_proj._tp.ops.linear``)."""

    def __init__(self) -> None:
        super().__init__()
        op = te.ops.BasicLinear(128, 128)
        tp = torch.nn.Module()
        tp.ops = torch.nn.ModuleDict({"linear": op})  # registered first: the path name_linears sees
        self.model = torch.nn.Module()
        self.model.model = torch.nn.Module()
        self.model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.model.layers[0].mlp = torch.nn.Module()
        self.model.model.layers[0].mlp.down_proj = torch.nn.Module()
        self.model.model.layers[0].mlp.down_proj._tp = tp
        self.seq = te.ops.Sequential(op)

    def forward(self, x):
        return self.seq(x)


def _write_run(run_dir, model, recipe, steps: int) -> None:
    """``steps`` training steps with FP8 statistics logged at each, as the launcher does."""
    torch.manual_seed(0)
    collector = Fp8StatsCollector()
    collector.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MetricsSink(str(run_dir), True, None)
    for step in range(1, steps + 1):
        collector.active = True
        x = torch.randn(128, 128)
        with te.autocast(recipe=recipe):
            y = model(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        sink.log(step, {"loss": 1.0}, collector.collect())
    sink.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, cls in RECIPES.items():
        out[name] = tmp_path_factory.mktemp(name)
        _write_run(out[name], _Gpt(), cls(), steps=2)
    out["hf"] = tmp_path_factory.mktemp("hf")
    _write_run(out["hf"], _HfLike(), R.Float8BlockScaling(), steps=2)
    return out


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_plot_every_recipe(runs, recipe, tmp_path):
    stats = Fp8Stats(str(runs[recipe]))
    assert stats.gemm_names() == ["layers.0/fc1", "layers.0/fc2", "layers.1/fc1", "layers.1/fc2"]
    per_tensor = recipe in ("delayed", "current")
    if recipe in ("delayed", "blockwise"):
        # The image (plot() = figure() + savefig): one recipe of each kind of panels; the
        # others draw the same panels through the same code (~1 CPU-s per image).
        out = tmp_path / "fp8.png"
        assert plot(stats, str(out)) == "layers.0/fc1"
        assert out.stat().st_size > 10_000
    fig, name = figure(stats, "layers.1/fc2")
    assert name == "layers.1/fc2"
    panels = ["amax", "scale", "mse"] if per_tensor else ["amax", "block_scale_inv_min", "block_scale_inv_max", "mse"]
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert len(titles) == len(panels) + 1 and titles[-1].startswith("underflow %")
    for ax in fig.axes[: len(panels)]:
        # input, weight and grad_output, two finite points each
        assert [line.get_label() for line in ax.lines] == ["input", "weight", "grad_output"]
        for line in ax.lines:
            assert list(line.get_xdata()) == [1, 2]
            assert all(math.isfinite(v) for v in line.get_ydata())


def test_hf_run_names_and_partial_gemm_name(runs, tmp_path, capsys):
    stats = Fp8Stats(str(runs["hf"]))
    assert stats.gemm_names() == [HF_GEMM]
    assert plot(stats, str(tmp_path / "a.png")) == HF_GEMM  # no layers.0/fc1: the first GEMM
    assert plot(stats, str(tmp_path / "b.png"), gemm="layers.0/mlp.down_proj") == HF_GEMM
    main([str(runs["hf"]), "--list"])
    listing = capsys.readouterr().out
    assert f"  {HF_GEMM}  [input, weight, grad_output]: amax, block_scale_inv_max" in listing
    assert "2 records, steps 1..2, 1 GEMMs" in listing


def test_missing_gemm_or_stat_is_a_clear_error_listing_what_exists(runs, tmp_path):
    run = str(runs["blockwise"])
    with pytest.raises(SystemExit) as exc:
        main([run, str(tmp_path / "x.png"), "--gemm", "layers.7/fc1"])
    msg = str(exc.value)
    assert "--gemm 'layers.7/fc1' is not a GEMM of" in msg and "layers.1/fc2" in msg
    with pytest.raises(SystemExit, match=r"matches 2 GEMMs .*\n  layers.0/fc1\n  layers.1/fc1"):
        main([run, str(tmp_path / "x.png"), "--gemm", "fc1"])
    # scale is a per-tensor statistic: a blockwise run has block scales instead
    with pytest.raises(SystemExit, match=r"--stats: scale not logged for layers.0/fc1 .* it has: amax, "
                                         r"block_scale_inv_max, block_scale_inv_min, block_scale_inv_std, mse"):
        main([run, str(tmp_path / "x.png"), "--stats", "amax,scale"])
    with pytest.raises(SystemExit, match=r"fp8_stats.jsonl: no such file; expected the run directory"):
        main([str(tmp_path), "--list"])
    assert not (tmp_path / "x.png").exists()


def test_one_point_history_is_a_marker(tmp_path):
    _write_run(tmp_path, _Gpt(), R.DelayedScaling(), steps=1)
    fig, _ = figure(Fp8Stats(str(tmp_path)), panels=["underflow_pct"])
    for ax in fig.axes[:2]:
        assert ax.lines
        for line in ax.lines:
            assert list(line.get_xdata()) == [1] and line.get_marker() == "o"
    main([str(tmp_path), str(tmp_path / "one.png"), "--stats", "amax"])
    assert (tmp_path / "one.png").stat().st_size > 5_000


def test_non_finite_values_and_missing_matplotlib(tmp_path, monkeypatch):
    # NaN/inf are written as strings by MetricsSink; the plot keeps the record (a gap) and draws the rest.
    sink = MetricsSink(str(tmp_path), True, None)
    for step, amax in ((1, 1.0), (2, float("inf")), (3, 4.0)):
        sink.log(step, {"loss": 1.0}, {f"fp8/layers.0/fc1/{r}/{s}": amax if s == "amax" else 1.0
                                       for r in ("input", "weight", "grad_output")
                                       for s in ("amax", "scale", "mse", "underflow_pct")})
    sink.close()
    fig, _ = figure(Fp8Stats(str(tmp_path)))
    ys = list(fig.axes[0].lines[0].get_ydata())
    assert ys[0] == 1.0 and math.isinf(ys[1]) and ys[2] == 4.0
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r"plotting needs matplotlib .*pip install -e \.\[plot\]"):
        main([str(tmp_path), str(tmp_path / "x.png")])
