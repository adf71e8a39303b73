"""tools/gpu_check.py (``make gpu-check``) on CPU: the no-CUDA exit, the orchestration
(time budget, failing and raising steps, summary JSON + Markdown), the parsing of what
the GPU steps produce, and the kernel and TP=2 checks themselves on CPU (Triton's
interpreter; gloo ranks on CPU). The GPU numbers themselves need a GPU."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    # tools/ is not a package: import its scripts by name (spawned ranks inherit sys.path).
    tools = os.path.join(REPO, "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(name)


gc = _load("gpu_check")


def test_without_cuda_prints_one_line_and_exits_0(tmp_path, monkeypatch, capsys):
    # In this process (the script is ``sys.exit(main())``; a subprocess costs an interpreter
    # and a torch import): torch sees no CUDA device, as on a CPU machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert gc.main(["--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], lines
    assert not out.exists()  # nothing was run, nothing written


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_run_steps_budget_errors_and_summary(tmp_path):
    clock = FakeClock()
    seen_timeouts = []

    def passing(out_dir, timeout_s):
        seen_timeouts.append(timeout_s)
        clock.t += 100
        return True, {"tflops": 12.5, "counts": {"passed": 3}}

    def failing(out_dir, timeout_s):
        seen_timeouts.append(timeout_s)
        clock.t += 50
        return False, {"why": "loss diverged"}

    def raising(out_dir, timeout_s):
        clock.t += 10
        raise RuntimeError("kernel exploded")

    def timing_out(out_dir, timeout_s):
        clock.t += timeout_s
        raise subprocess.TimeoutExpired(["x"], timeout_s)

    def cannot_run_here(out_dir, timeout_s):
        return True, {"skipped": "needs two GPUs"}

    steps = [gc.Step("a", 150, passing), gc.Step("b", 150, failing), gc.Step("c", 60, raising),
             gc.Step("d", 500, timing_out), gc.Step("e", 60, passing)]
    results = gc.run_steps(steps, str(tmp_path), budget_s=300, clock=clock)
    assert [r.status for r in results] == ["passed", "failed", "error", "error", "skipped"]
    skipped = gc.run_steps([gc.Step("tp2", 60, cannot_run_here)], str(tmp_path), budget_s=60, clock=clock)[0]
    assert (skipped.status, skipped.detail) == ("skipped", "needs two GPUs")
    assert seen_timeouts == [150, 150]  # each within its own limit while the budget lasts
    assert "kernel exploded" in results[2].detail
    assert results[3].detail == "timed out after 140 s" and results[3].seconds == 140  # the budget left
    assert "budget" in results[4].detail

    info = {"cuda": True, "name": "Fake GPU", "capability": "sm_90", "torch": "x", "cuda_version": "12.x"}
    jpath, mpath = gc.write_summary(results, info, str(tmp_path / "summary"))
    data = json.loads(open(jpath).read())
    assert data["ok"] is False and data["device"]["name"] == "Fake GPU"
    assert [s["name"] for s in data["steps"]] == list("abcde") and data["steps"][0]["summary"]["tflops"] == 12.5
    md = open(mpath).read()
    assert md.startswith("# tp-fuse GPU check: Fake GPU")
    assert "| b | failed | 50.0 |" in md and "kernel exploded" in md and "- tflops: 12.5" in md


def test_default_steps_fit_in_fourteen_minutes():
    assert [s.name for s in gc.STEPS] == ["bench_gpu", "gpu_tests", "triton_bitexact", "bench_kernels", "gpt_fp8",
                                          "tp2", "gpt_compiled", "host_profile"]
    assert gc.STEPS[0].timeout_s <= 5 * 60  # the benchmark runs first, in at most 5 minutes
    assert sum(s.timeout_s for s in gc.STEPS) <= gc.BUDGET_S <= 14 * 60


def test_bench_gpu_step(tmp_path, monkeypatch):
    """step_bench_gpu: the benchmark's command (budget 30 s inside the step's limit), its
    table and summary; after a timeout, the rows it had written (never an earlier run's)."""
    rows = [{"shape": "gemm_bound", "variant": "torch_bf16", "status": "ok", "ratio_vs_torch_bf16": 1.0,
             "wall_us": 20000.0, "kernels": 24, "tflops": 650.0},
            {"shape": "gemm_bound", "variant": "fp8_blockwise", "status": "skipped", "reason": "needs sm90"}]
    summary = {"gemm_bound": {"torch_bf16": "1.00x torch bf16, 20000 us, 24 kernels, 650 TFLOP/s",
                              "fp8_blockwise": "skipped: needs sm90"}}
    assert gc.summarize_bench_gpu(rows) == summary
    calls = []

    def fake_run(cmd, timeout_s, log_path, env=None):
        calls.append(cmd)
        assert cmd[cmd.index("--budget-s") + 1] == "270" and timeout_s == 300
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump(rows, f)
        return subprocess.CompletedProcess(cmd, 0, "| shape | variant |\n", "")

    monkeypatch.setattr(gc, "_run", fake_run)
    assert gc.step_bench_gpu(str(tmp_path), 300) == (True, summary)
    assert calls[0][1].endswith(os.path.join("examples", "bench_gpu.py"))
    assert open(tmp_path / "bench_gpu.md").read() == "| shape | variant |\n"

    def timing_out(cmd, timeout_s, log_path, env=None, partial=rows[:1]):
        if partial:  # the shapes finished before the limit
            with open(cmd[cmd.index("--json") + 1], "w") as f:
                json.dump(partial, f)
        raise subprocess.TimeoutExpired(cmd, timeout_s)

    monkeypatch.setattr(gc, "_run", timing_out)
    ok, partial = gc.step_bench_gpu(str(tmp_path), 300)
    assert not ok and partial == {"timed_out_after_s": 300,
                                  "gemm_bound": {"torch_bf16": summary["gemm_bound"]["torch_bf16"]}}
    monkeypatch.setattr(gc, "_run", lambda *a, **k: timing_out(*a, **k, partial=None))
    with pytest.raises(subprocess.TimeoutExpired):  # nothing written this time: the earlier file is not read
        gc.step_bench_gpu(str(tmp_path), 300)


def test_parse_pytest_counts():
    out = "....ss\n=== short test summary ===\n12 passed, 3 skipped, 1 deselected in 4.20s\n"
    assert gc.parse_pytest_counts(out) == {"passed": 12, "skipped": 3, "deselected": 1}
    assert gc.parse_pytest_counts("1 failed, 2 passed, 1 error in 1s") == {"failed": 1, "passed": 2, "error": 1}
    assert gc.parse_pytest_counts("") == {}


def _write_metrics(run_dir, losses, tps):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "val_loss": 9.0}) + "\n")  # not a training row
        for i, (loss, t) in enumerate(zip(losses, tps)):
            f.write(json.dumps({"step": 10 * (i + 1), "loss": loss, "tokens_per_s": t}) + "\n")


def test_gpt_step_orchestration_and_comparison(tmp_path, monkeypatch):
    """step_gpt_fp8 runs the launcher three times with the right overrides and compares
    the metrics the runs wrote (here: written by a fake runner)."""
    calls = []
    fake = {"none": ([3.0, 2.0], [10.0, 1000.0, 1000.0]), "delayed": ([3.1, 2.02], [5.0, 1500.0, 1500.0]),
            "current": ([3.0, 2.3], [5.0, 1200.0, 1200.0])}

    def fake_run(cmd, timeout_s, log_path, env=None):
        calls.append(cmd)
        fp8 = next(a.split("=")[1] for a in cmd if a.startswith("fp8="))
        run_dir = next(a.split("=", 1)[1] for a in cmd if a.startswith("hydra.run.dir="))
        losses, tps = fake[fp8]
        _write_metrics(run_dir, losses + [losses[-1]], tps)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gc, "_run", fake_run)
    ok, summary = gc.step_gpt_fp8(str(tmp_path), 100)
    assert len(calls) == 3
    for cmd in calls:
        assert {"+model=gpt", "trainer.max_steps=100", "trainer.dtype=bfloat16", "trainer.device=cuda"} <= set(cmd)
    assert summary["bf16_final_loss"] == 2.0
    assert summary["fp8_delayed_loss_rel_diff"] == pytest.approx(0.01)
    assert summary["fp8_delayed_tokens_per_s_ratio"] == pytest.approx(1.5)  # first row (warm-up) left out
    assert summary["fp8_current_loss_rel_diff"] == pytest.approx(0.15)
    assert ok is False  # current scaling's loss is 15 % off: not parity


def test_kernel_check_runs_under_the_triton_interpreter(tmp_path):
    out = tmp_path / "k.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_check_kernels.py"), "--device", "cpu",
                           "--rows", "16", "--cols", "32", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["ok"], proc.stdout + proc.stderr
    assert report["kernels"]["quantize+transpose torch.float8_e4m3fn"]["bit_exact_fraction"] == 1.0
    assert len(report["kernels"]) == 12
    assert all(report["kernels"][f"block_quantize {r}"]["ok"] for r in ("blockwise", "mxfp8", "rowwise"))


def test_tp2_check_skips_without_two_gpus(monkeypatch):
    # Two ranks on one GPU cannot work (NCCL refuses, gloo cannot send CUDA tensors): the
    # first GPU run died in gloo; now the check says why it did not run.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    report = _load("gpu_check_tp2").run_tp2("cuda")
    assert report["ok"] and "needs two GPUs (this machine has 1)" in report["skipped"]


@pytest.mark.multirank
def test_tp2_check_on_cpu():
    # Smaller than the GPU run (CI time); FP8 dimensions still multiples of 16.
    report = _load("gpu_check_tp2").run_tp2("cpu", num_layers=1, hidden_size=64, max_seq_len=32, vocab_size=64)
    assert report["ok"], report
    assert report["fp32"]["max_rel_diff"] <= 1e-4 and len(report["fp8_delayed"]["tp2"]) == 3


def test_host_profile_on_cpu(tmp_path):
    """Step 6's script on CPU with a tiny shape: every variant timed and profiled, and the
    sync counter sees a device-to-host read (the plain torch step has none)."""
    hp = _load("gpu_host_profile")
    report = hp.run([(32, 16)], "cpu", torch.float32, repeats=2, top=3)
    rows = report["shapes"][0]["variants"]
    assert list(rows) == ["torch", "tp_fuse", "fp8 delayed", "fp8 current", "fp8 block"]
    for r in rows.values():
        assert r["wall_us"] >= r["host_us"] > 0 and r["aten_calls"] > 0 and len(r["top_cpu"]) == 3
    assert rows["torch"]["syncs"] == 0 and rows["torch"]["wall_vs_torch"] == 1.0
    hp.print_report(report)
