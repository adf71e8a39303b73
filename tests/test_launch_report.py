"""What the launcher reports (issue 25): a trustworthy MFU peak, MFU bounded and labelled,
the ETA, the end-of-run summary, a note at every checkpoint save, the run directory in
train.log, no empty checkpoints/ directory, and the note when FP8 state starts fresh.

Single process (the peak measurement's timing is injected: a fake clock and matmul).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tp_fuse.launch.api import train
from tp_fuse.launch.logging.peak import CpuProbe, PeakCache, PeakFlops, cuda_datasheet_peak, measure_cpu_peak
from tp_fuse.launch.logging.report import StepMeter, format_eta
from tp_fuse.launch.logging.summary import RunSummary, summary_lines

CPU = torch.device("cpu")


class FakeTiming:
    """A clock that advances only when a matmul runs: ``trial_times[i]`` seconds per matmul
    during trial i (after the warm-up, which takes ``warmup_s``), i.e. a machine whose load
    changes from trial to trial."""

    def __init__(self, warmup_s: float, per_matmul_s: list[float], reps: int) -> None:
        self.now = 0.0
        self.calls = 0
        self.warmup_s = warmup_s
        self.per_matmul_s = per_matmul_s
        self.reps = reps

    def clock(self) -> float:
        return self.now

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.calls == 0:
            self.now += self.warmup_s
        else:
            self.now += self.per_matmul_s[(self.calls - 1) // self.reps]
        self.calls += 1


def _probe(per_matmul_s: list[float], warmup_s: float = 0.01, n: int = 64) -> CpuProbe:
    # min_trial_s / warmup_s = 4 matmuls per trial.
    fake = FakeTiming(warmup_s, per_matmul_s, reps=4)
    return CpuProbe(n=n, trials=len(per_matmul_s), min_trial_s=0.04, clock=fake.clock, matmul=fake.matmul)


def test_cpu_peak_is_the_best_trial_of_equal_work():
    # Trials under load (slow) and one quiet trial: the peak is the quiet one, not a mean.
    per = [0.02, 0.5, 0.001, 0.3, 0.02]
    peak = measure_cpu_peak(torch.float32, None, 1, _probe(per))
    assert peak == pytest.approx(2 * 64**3 / 0.001)


def test_cpu_peak_is_cached_per_machine_reused_and_remeasured_on_request(tmp_path):
    first = PeakFlops.detect(CPU, torch.float32, None, 1, cache_dir=str(tmp_path), probe=_probe([0.002] * 3))
    assert first.value == pytest.approx(2 * 64**3 / 0.002)
    assert "measured now, cached in" in first.source and first.kind == "CPU peak measured now"
    entries = json.loads((tmp_path / "cpu_peak.json").read_text())
    (key,) = entries
    assert "float32" in key and "1 ranks x" in key
    # A later run reuses it: its own (slower, noisier) measurement is not even run.
    again = PeakFlops.detect(CPU, torch.float32, None, 1, cache_dir=str(tmp_path), probe=_probe([1.0] * 3))
    assert again.value == first.value and "cached in" in again.source and "measured now" not in again.source
    assert "trainer.peak_flops=remeasure measures again" in again.source
    # Another dtype is another entry; remeasure replaces the value.
    PeakFlops.detect(CPU, torch.bfloat16, None, 1, cache_dir=str(tmp_path), probe=_probe([0.004] * 3))
    assert len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2
    new = PeakFlops.detect(CPU, torch.float32, None, 1, user_peak="remeasure", cache_dir=str(tmp_path),
                           probe=_probe([0.001] * 3))
    assert new.value == pytest.approx(2 * 64**3 / 0.001) and "measured now" in new.source
    assert PeakCache(str(tmp_path)).get(key)[0] == pytest.approx(new.value)


@pytest.mark.parametrize("content", [b"not json", b'{"k": 1}', b"x" * (1 << 20), "link"])
def test_damaged_peak_cache_reads_as_missing(tmp_path, content):
    path = tmp_path / "cpu_peak.json"
    if content == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        os.symlink(tmp_path / "elsewhere.json", path)
    else:
        path.write_bytes(content)
    peak = PeakFlops.detect(CPU, torch.float32, None, 1, cache_dir=str(tmp_path), probe=_probe([0.002] * 2))
    assert "measured now" in peak.source


def test_implausible_cached_value_is_ignored(tmp_path):
    PeakFlops.detect(CPU, torch.float32, None, 1, cache_dir=str(tmp_path), probe=_probe([0.002] * 2))
    data = json.loads((tmp_path / "cpu_peak.json").read_text())
    for entry in data.values():
        entry["flops_per_rank"] = 1e30  # no CPU does that: damaged or crafted
    (tmp_path / "cpu_peak.json").write_text(json.dumps(data))
    peak = PeakFlops.detect(CPU, torch.float32, None, 1, cache_dir=str(tmp_path), probe=_probe([0.002] * 2))
    assert "measured now" in peak.source and peak.value < 1e15


def test_user_peak_and_data_sheet_peaks_per_dtype():
    user = PeakFlops.detect(CPU, torch.float32, None, 4, user_peak=2e11)
    assert user.value == 8e11 and "trainer.peak_flops=2e+11 (set by the user)" in user.source
    assert cuda_datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16, False)[0] == 989e12
    assert cuda_datasheet_peak("NVIDIA H100 PCIe", torch.bfloat16, False)[0] == 756e12
    assert cuda_datasheet_peak("NVIDIA H100 80GB HBM3", torch.float32, False)[0] == 67e12
    assert cuda_datasheet_peak("NVIDIA H100 80GB HBM3", torch.float32, True)[0] == 494e12
    peak, why = cuda_datasheet_peak("NVIDIA GeForce GTX 1080", torch.bfloat16, False)
    assert peak is None and "trainer.peak_flops" in why
    assert cuda_datasheet_peak("NVIDIA A10G", torch.float32, False)[0] is None
    assert cuda_datasheet_peak("NVIDIA H100", torch.float16, False)[0] is None


def test_mfu_never_above_100_percent_and_a_wrong_cached_peak_is_dropped(tmp_path):
    peak = PeakFlops.detect(CPU, torch.float32, None, 1, cache_dir=str(tmp_path), probe=_probe([0.002] * 2))
    said: list[str] = []
    # 1e9 FLOP per token and 1000 tokens in 1 s: 1e12 FLOP/s, far above the "measured" peak.
    meter = StepMeter(1000, 1e9, peak, max_steps=10, start_step=0, warn=said.append)
    for step in (1, 2):
        assert "mfu" not in meter.metrics(step, 1.0, CPU)
    assert len(said) == 1 and "above 100%" in said[0] and "MFU is not shown" in said[0]
    assert "trainer.peak_flops" in said[0] and "the next run measures again" in said[0]
    assert json.loads((tmp_path / "cpu_peak.json").read_text()) == {}
    assert "mfu" not in meter.totals() and "above 100%" in meter.mfu_withdrawn
    # A plausible peak: MFU shown, below 100%; an unknown peak: never shown.
    ok = StepMeter(1000, 1e9, PeakFlops(4e12, "test", "test"), 10, 0)
    assert ok.metrics(1, 1.0, CPU)["mfu"] == pytest.approx(0.25) and ok.totals()["mfu"] == pytest.approx(0.25)
    unknown = StepMeter(1000, 1e9, PeakFlops(None, "n/a (no peak)"), 10, 0)
    assert "mfu" not in unknown.metrics(1, 1.0, CPU) and "mfu" not in unknown.totals()


def test_eta_format_and_robust_estimate():
    assert format_eta(1309) == "21m49s" and format_eta(45) == "45s" and format_eta(7387) == "2h03m07s"
    assert format_eta(0) == "0s" and format_eta(-3) == "0s"
    meter = StepMeter(100, 1.0, PeakFlops(None, "n/a"), max_steps=100, start_step=0)
    # A slow first step (start-up) and an odd slow step (validation) do not inflate the estimate.
    times = [30.0, 1.0, 1.0, 9.0, 1.0, 1.0]
    for step, t in enumerate(times, 1):
        eta = meter.metrics(step, t, CPU)["eta_s"]
    assert eta == pytest.approx(1.0 * (100 - len(times)))
    totals = meter.totals()
    assert totals["steps"] == 6 and totals["total_s"] == pytest.approx(43.0)
    assert totals["mean_step_s"] == pytest.approx(13.0 / 5)


def test_summary_block_contents():
    lines = summary_lines(RunSummary(
        start_step=0, last_step=300, max_steps=300, losses={299: 2.5, 300: 2.4012}, val_losses={200: 2.7, 300: 2.512},
        wall_s=1309.2, totals={"steps": 300, "total_s": 1200.0, "mean_step_s": 0.205, "tokens_per_s": 9990.0,
                               "mfu": 0.123},
        peak_source="171.5 GFLOP/s (CPU peak measured now)", mfu_note=None, peak_mem_gib=1.234,
        mem_what="peak RSS", run_dir="/runs/a", checkpoint="/runs/a/checkpoints/step_00000300",
        checkpoint_hint="", wandb="offline, files in /runs/a/wandb/x; upload them with: wandb sync /runs/a/wandb/x",
    ))
    text = "\n".join(lines)
    assert lines[0] == "[tp-fuse] run summary:"
    for needle in ("steps            300/300", "train 2.4012 (step 300), val 2.5120 (step 300)", "21m49s in total",
                   "205 ms/step mean", "9,990 tokens/s", "MFU              12.3% of a peak of 171.5 GFLOP/s",
                   "1.23 GiB (peak RSS, rank 0)", "run dir          /runs/a",
                   "last checkpoint  /runs/a/checkpoints/step_00000300", "wandb sync /runs/a/wandb/x"):
        assert needle in text, needle
    bare = "\n".join(summary_lines(RunSummary(
        start_step=0, last_step=2, max_steps=2, losses={1: 3.0, 2: 2.9}, val_losses={}, wall_s=0.4,
        totals={"steps": 2, "total_s": 0.3, "mean_step_s": 0.1, "tokens_per_s": 100.0}, peak_source="n/a",
        mfu_note="the peak is unknown: no data-sheet peak known for X", peak_mem_gib=0.5, mem_what="peak RSS",
        run_dir="/r", checkpoint=None, checkpoint_hint="checkpoint.interval=0, checkpoint.save_final=false",
        wandb=None)))
    assert "MFU              n/a (the peak is unknown" in bare and "0.4s in total" in bare
    assert "none (checkpoint.interval=0, checkpoint.save_final=false)" in bare and "off (logger=none)" in bare
    assert "val n/a" in bare


TINY = ["+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
        "trainer.global_batch_size=4", "trainer.micro_batch_size=4", "trainer.log_interval=2",
        "trainer.val_interval=0", "logger=none", "trainer.progress=false"]


def test_run_reports_saves_summary_and_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    result = train([*TINY, "trainer.max_steps=4", "checkpoint.interval=2"], str(run_dir))
    err = capsys.readouterr().err
    ck = run_dir / "checkpoints"
    for step in (2, 4):
        assert f"[tp-fuse] saved checkpoint step {step} -> {ck / f'step_{step:08d}'}" in err
    assert result.checkpoint == str(ck / "step_00000004")
    summary = err[err.index("[tp-fuse] run summary:"):]
    assert f"  last checkpoint  {ck / 'step_00000004'}" in summary and f"  run dir          {run_dir}" in summary
    assert f"train {result.final_loss:.4f} (step 4)" in summary
    # The MFU is there and bounded, or withdrawn with its reason: never above 100%.
    mfu = summary.split("  MFU              ", 1)[1].split("\n", 1)[0]
    assert mfu.startswith("n/a (") or float(mfu.split("%", 1)[0]) <= 100.0
    assert "[tp-fuse] parameters: " in err and "in the model" in err and "on each rank (layout TP=1 x DP=1" in err
    assert "peak = " in err and ("measured" in err or "trainer.peak_flops" in err)


def test_no_checkpoint_dir_without_saves_and_fp8_note_on_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train([*TINY, "trainer.max_steps=2"], str(run_dir))  # checkpoint.interval=0 (default), no final save
    assert not (run_dir / "checkpoints").exists()
    assert "none (checkpoint.interval=0, checkpoint.save_final=false)" in capsys.readouterr().err
    ck = tmp_path / "ck"
    train([*TINY, "trainer.max_steps=2", "checkpoint.save_final=true", f"checkpoint.dir={ck}"], str(run_dir))
    capsys.readouterr()
    train([*TINY, "trainer.max_steps=3", "fp8=delayed", "checkpoint.resume=true", f"checkpoint.dir={ck}"],
          str(tmp_path / "run2"))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[tp-fuse] note:")]
    assert len(notes) == 1
    assert "was trained without FP8" in notes[0] and "FP8 state (amax history, scales) starts fresh" in notes[0]
