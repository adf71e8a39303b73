"""``trainer.compile=true``: torch.compile'd TransformerLayers train like eager ones.

One small run per recipe (compiling is slow on 2 CPU cores). The tp-fuse fusion groups are
traced into each layer's graph (``tp_fuse/ops/compiled``): no graph break, one graph per
layer -- checked through dynamo's counters -- and the same losses as eager. Under FP8 the
logged statistics (``fp8_stats.jsonl``: the casts run the eager quantizers and report to
the same collector) match eager: scales and amaxes to 1e-5; the underflow/overflow
percentages may differ by a few elements, since inductor's attention backward rounds
the gradients near FP8's smallest value differently.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch._dynamo

from tp_fuse.launch.api import train
from tp_fuse.launch.models.build import check_compile_mode
from tolerances import tols

RUN = [
    "+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
    "trainer.global_batch_size=4", "trainer.micro_batch_size=4", "trainer.max_steps=2", "trainer.log_interval=1",
    "trainer.val_interval=0", "logger=none", "trainer.progress=false", "checkpoint.save_final=false",
]


@pytest.mark.parametrize("fp8,recompute", [("none", "none"), ("delayed", "none"), ("delayed", "full")])
def test_compiled_layers_train_like_eager(tmp_path, capsys, fp8: str, recompute: str) -> None:
    """``recompute=full``: the compiled layer body runs again inside tp_fuse.checkpoint's
    recompute, whose FP8 scale replay acts on the quantizers the compiled casts use. The
    run summary reports the run's graphs, graph breaks and compile time."""
    args = [*RUN, f"fp8={fp8}", f"trainer.activation_checkpointing={recompute}"]
    eager = train(args, str(tmp_path / "eager"))
    assert "torch.compile" not in "".join(capsys.readouterr())  # only compiled runs report it
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train([*args, "trainer.compile=true"], str(tmp_path / "compiled"))
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])  # the fusion groups are traced
    summary = "".join(capsys.readouterr())
    report = re.search(r"torch\.compile +(\d+) graphs?, 0 graph breaks, ([0-9.]+) s compiling", summary)
    assert report and int(report[1]) == counters["stats"]["unique_graphs"] and float(report[2]) > 0, report
    assert sorted(compiled.losses) == [1, 2]
    for step, loss in eager.losses.items():
        assert abs(compiled.losses[step] - loss) <= tols(torch.float32)["atol"], (step, compiled.losses, eager.losses)
    if fp8 != "none":
        stats = [[json.loads(line) for line in open(tmp_path / run / "fp8_stats.jsonl")] for run in ("eager", "compiled")]
        assert len(stats[0]) == len(stats[1]) == 2
        for want, got in zip(*stats):
            assert want.keys() == got.keys()
            for key, value in want.items():
                if isinstance(value, float) and not key.endswith("_pct"):
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-12), key


def test_reduce_overhead_mode_trains_the_default_gpt_like_eager(tmp_path, monkeypatch) -> None:
    """``trainer.compile_mode=reduce-overhead`` (CUDA graphs on a GPU): the default GPT's
    layers are compiled with that mode, dynamo traces them without a graph break, and the
    losses of a few steps equal eager's within fp32 tolerance (CPU: inductor ignores the
    CUDA-graph part of the mode, so this checks that the mode reaches torch.compile and
    that tracing does not break, not the graphs themselves)."""
    args = ["+model=gpt", "data.seq_len=64", "trainer.global_batch_size=2", "trainer.micro_batch_size=2",
            "trainer.max_steps=3", "trainer.log_interval=1", "trainer.val_interval=0", "logger=none",
            "trainer.progress=false", "checkpoint.save_final=false", "fp8=none"]
    eager = train(args, str(tmp_path / "eager"))
    modes = []
    real_compile = torch.nn.Module.compile

    def spy(self, *a, **kw):
        modes.append(kw.get("mode"))
        return real_compile(self, *a, **kw)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train([*args, "trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
                     str(tmp_path / "compiled"))
    counters = torch._dynamo.utils.counters
    assert modes and set(modes) == {"reduce-overhead"}, modes  # every TransformerLayer, with the mode
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert sorted(compiled.losses) == [1, 2, 3]
    for step, loss in eager.losses.items():
        assert abs(compiled.losses[step] - loss) <= tols(torch.float32)["atol"], (step, compiled.losses, eager.losses)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_on_cuda(mode) -> None:
    """Regression (H200): the default GPT compiled with ``reduce-overhead`` failed in its
    first backward (CUDA graph outputs overwritten); the CUDA-graph modes are refused on
    CUDA with a message naming the working modes, and stay allowed on CPU."""
    with pytest.raises(ValueError, match=rf"trainer.compile_mode={mode} records CUDA graphs.*compile_mode=default"):
        check_compile_mode(mode, torch.device("cuda", 0))
    check_compile_mode(mode, torch.device("cpu"))
    for ok in ("default", "max-autotune-no-cudagraphs"):
        check_compile_mode(ok, torch.device("cuda", 0))

