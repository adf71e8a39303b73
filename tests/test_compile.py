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


# ``reduce-overhead`` (CUDA graphs on a GPU) rides on the fp32 run: on CPU inductor ignores
# the CUDA-graph part of the mode, so the run checks that the mode reaches torch.compile and
# that tracing does not break (the CUDA-graph modes are refused on CUDA: below). The FP8 runs
# take the configured default mode.
@pytest.mark.parametrize("fp8,recompute,mode", [("none", "none", "reduce-overhead"), ("delayed", "none", "default"),
                                                ("delayed", "full", "default")])
def test_compiled_layers_train_like_eager(tmp_path, capsys, monkeypatch, fp8: str, recompute: str, mode: str) -> None:
    """``recompute=full``: the compiled layer body runs again inside tp_fuse.checkpoint's
    recompute, whose FP8 scale replay acts on the quantizers the compiled casts use. The
    run summary reports the run's graphs, graph breaks and compile time. Every layer is
    compiled with ``trainer.compile_mode``."""
    args = [*RUN, f"fp8={fp8}", f"trainer.activation_checkpointing={recompute}"]
    eager = train(args, str(tmp_path / "eager"))
    assert "torch.compile" not in "".join(capsys.readouterr())  # only compiled runs report it
    modes = []
    real_compile = torch.compile

    def spy(*a, **kw):
        modes.append(kw.get("mode"))
        return real_compile(*a, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mode_arg = [] if mode == "default" else [f"trainer.compile_mode={mode}"]  # default: the config's
    compiled = train([*args, "trainer.compile=true", *mode_arg], str(tmp_path / "compiled"))
    counters = torch._dynamo.utils.counters
    assert modes and set(modes) == {mode}, modes  # every TransformerLayer, with the mode
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

