"""The FP8 host path's Python cost, counted deterministically (issue 35 point 2).

On a GPU every Python call on the hot path is host time the step waits for. These tests
count the Python function calls (``sys.setprofile`` 'call' events: the interpreter's own
count, independent of machine load) of one warmed-up FP8 GEMM and one cast, and pin a
budget that the per-call checks, environment reads and backend choices of the old path
exceeded. They also check that a warmed-up FP8 Linear step reads no environment variable,
builds no formatted string and queries no device capability: decisions made once per
signature (``kernels.gemm.Fp8GemmPlan``, ``tp_fuse.settings``) are looked up.

Budgets (CPU, delayed scaling, grad mode off as in the fuser's autograd functions, after
warm-up; Python calls measured before -> after the plans, ``python_calls`` below):

* ``quantization.fp8_gemm`` of Float8Tensors, default CPU path: 25 -> 14;
  strict-CUDA mode (the GPU's branches, ``_scaled_mm``'s conformance check included): 67 -> 19;
* ``kernels.fp8_gemm`` of FP8 bytes: 54 -> 17 (strict-CUDA mode: 63 -> 17);
* ``DelayedScalingQuantizer.quantize``: 31 -> 22.
"""

from __future__ import annotations

import dis
import os
import sys
from collections import Counter
from typing import Callable

import pytest
import torch

import tp_fuse
from tp_fuse import kernels, ops
from tp_fuse.quantization import fp8_gemm
from tp_fuse.quantization.float8.delayed_scaling import DelayedScalingQuantizer
from tp_fuse.recipe import DelayedScaling
from tp_fuse.strict import STRICT_ENV

GEMM_BUDGET = 16  # quantization.fp8_gemm, CPU emulation (was 25)
STRICT_GEMM_BUDGET = 22  # the same in strict-CUDA mode (was 67)
KERNEL_GEMM_BUDGET = 20  # kernels.fp8_gemm of bytes (was 54; strict-CUDA mode 63)
CAST_BUDGET = 24  # DelayedScalingQuantizer.quantize (was 31)

# Opcodes that build formatted strings (f-strings) in CPython 3.11-3.13.
_FORMAT_OPS = {dis.opmap[name] for name in ("FORMAT_VALUE", "BUILD_STRING", "FORMAT_SIMPLE",
                                            "FORMAT_WITH_SPEC", "CONVERT_VALUE") if name in dis.opmap}
_TP_FUSE = os.path.dirname(tp_fuse.__file__)


def python_calls(fn: Callable[[], object]) -> Counter:
    """``Counter`` of ``(file name, function)`` for every Python function called by ``fn()``
    (``fn`` itself excluded)."""
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[(os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    calls[(os.path.basename(fn.__code__.co_filename), fn.__code__.co_name)] -= 1
    return +calls


def _operands() -> tuple:
    torch.manual_seed(0)
    qx = DelayedScalingQuantizer(DelayedScaling(), "input")
    qw = DelayedScalingQuantizer(DelayedScaling(), "weight")
    x, w = torch.randn(32, 64), torch.randn(128, 64)
    return qx, x, qx.quantize(x), qw.quantize(w)


def _warm(fn: Callable[[], object]) -> Callable[[], object]:
    for _ in range(3):
        fn()
    return fn


def _budget(fn: Callable[[], object], budget: int) -> None:
    # Grad mode off, as inside the fuser's autograd functions, where the hot path runs.
    with torch.no_grad():
        calls = python_calls(_warm(fn))
    total = sum(calls.values())
    assert total <= budget, f"{total} Python calls, budget {budget}: {calls.most_common()}"


def test_fp8_gemm_host_budget(tp_settings):
    tp_settings(**{STRICT_ENV: "0"})  # the CPU path (CI's strict pass sets the variable)
    _, _, xq, wq = _operands()
    _budget(lambda: fp8_gemm(xq, wq, torch.bfloat16), GEMM_BUDGET)
    _budget(lambda: fp8_gemm(xq, xq, torch.bfloat16, transpose_a=True, transpose_b=True), GEMM_BUDGET)
    one = torch.tensor(1.0)
    a8, b8 = xq._fp8, wq._fp8
    _budget(lambda: kernels.fp8_gemm(a8, b8, one, one, torch.bfloat16), KERNEL_GEMM_BUDGET)


def test_fp8_gemm_host_budget_on_the_cuda_branches(tp_settings):
    """Strict-CUDA mode runs the GPU's branches (``torch._scaled_mm``'s checks included):
    the conformance check is made once per signature, not per call."""
    tp_settings(**{STRICT_ENV: "1"})
    _, _, xq, wq = _operands()
    _budget(lambda: fp8_gemm(xq, wq, torch.bfloat16), STRICT_GEMM_BUDGET)
    one = torch.tensor(1.0)
    a8, b8 = xq._fp8, wq._fp8
    _budget(lambda: kernels.fp8_gemm(a8, b8, one, one, torch.bfloat16), KERNEL_GEMM_BUDGET)


def test_cast_host_budget():
    qx, x, _, _ = _operands()
    _budget(lambda: qx.quantize(x), CAST_BUDGET)


def test_a_new_signature_is_checked_on_its_first_call_and_every_call():
    """Plans keep decisions, not errors: a bad signature raises on every call, with the
    message a per-call check gives."""
    _, _, xq, wq = _operands()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"fp8_gemm: out_dtype: expected one of"):
            fp8_gemm(xq, wq, torch.int32)
        with pytest.raises(ValueError, match=r"b: expected \[N, K\] with K = a.shape\[1\] = 64"):
            kernels.fp8_gemm(xq._fp8, wq._fp8.t(), xq._sinv, wq._sinv, torch.float32)


def test_settings_changes_reach_planned_gemms(tp_settings):
    """A plan is keyed on the settings snapshot: switching the CPU GEMM takes effect on the
    next call of an already planned signature."""
    _, _, xq, wq = _operands()
    one = torch.tensor(1.0)
    kernels.fp8_gemm(xq._fp8, wq._fp8, one, one, torch.float32)
    tp_settings(TP_FUSE_CPU_FP8_GEMM="scaled_mm")
    with kernels.record_kernel_paths() as log:
        kernels.fp8_gemm(xq._fp8, wq._fp8, one, one, torch.float32)
    assert log.last("fp8_gemm").variant == "scaled_mm"


def _linear_step() -> Callable[[], None]:
    torch.manual_seed(0)
    seq = ops.Sequential(ops.Linear(64, 128))
    x = torch.randn(32, 64, requires_grad=True)

    def step() -> None:
        with tp_fuse.autocast(recipe=DelayedScaling()):
            y = seq(x)
        y.sum().backward()

    return _warm(step)


@pytest.mark.parametrize("strict", [False, True], ids=["cpu", "cuda-branches"])
def test_warm_fp8_linear_step_reads_no_environment_and_formats_no_string(strict, tp_settings):
    """No ``os.environ`` read, no ``get_device_capability``, no ``str.format`` or f-string
    in tp_fuse's code during a warmed-up FP8 Linear forward + backward."""
    tp_settings(**{STRICT_ENV: "1" if strict else "0"})
    step = _linear_step()
    seen: Counter = Counter()

    def trace(frame, event, arg):
        code = frame.f_code
        if event == "call":
            if code.co_filename.endswith("os.py") or code.co_filename == "<frozen os>":
                seen[f"os.{code.co_name}"] += 1
            if code.co_name == "get_device_capability":
                seen["get_device_capability"] += 1
            if code.co_filename.startswith(_TP_FUSE):
                frame.f_trace_opcodes = True
                return trace
            return None
        if event == "opcode" and code.co_code[frame.f_lasti] in _FORMAT_OPS:
            seen[f"f-string in {os.path.basename(code.co_filename)}:{frame.f_lineno}"] += 1
        return trace

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "format" and isinstance(
                getattr(arg, "__self__", None), str):
            seen[f"str.format from {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"] += 1

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    assert not seen, dict(seen)
