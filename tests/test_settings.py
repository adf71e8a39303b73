"""tp_fuse's environment switches: one snapshot, read once, changed only by ``override``."""

from __future__ import annotations

import os

import pytest

from tp_fuse import settings
from tp_fuse.strict import strict_cuda_enabled


def test_override_sets_the_environment_and_the_snapshot_and_restores_both():
    before, env_before = settings.current(), os.environ.get(settings.STRICT_ENV)
    with settings.override(TP_FUSE_STRICT_CUDA="1", TP_FUSE_CPU_FP8_GEMM="scaled_mm") as now:
        assert now is settings.current() and now is not before
        assert now.strict_cuda and strict_cuda_enabled() and now.cpu_fp8_gemm == "scaled_mm"
        assert os.environ[settings.STRICT_ENV] == "1"  # what a process started here inherits
        with settings.override(TP_FUSE_STRICT_CUDA=None):
            assert not settings.current().strict_cuda and settings.STRICT_ENV not in os.environ
        assert settings.current() is now
    assert settings.current() is before and os.environ.get(settings.STRICT_ENV) == env_before


def test_the_environment_is_not_read_after_the_snapshot(monkeypatch):
    """A variable set behind tp_fuse's back changes nothing until an override re-reads it."""
    flag = settings.current().strict_cuda
    monkeypatch.setenv(settings.STRICT_ENV, "0" if flag else "1")
    assert strict_cuda_enabled() == flag


@pytest.mark.parametrize("variables, message", [
    ({"TP_FUSE_FP8_GEMM": "cublas"}, r"TP_FUSE_FP8_GEMM: expected one of \('torch', 'triton'\), got 'cublas'"),
    ({"TP_FUSE_CPU_FP8_GEMM_UNITS": "amx"}, r"TP_FUSE_CPU_FP8_GEMM_UNITS: expected one of"),
    ({"TP_FUSE_STRICT_CUDA": "yes"}, r"TP_FUSE_STRICT_CUDA: expected 0 or 1, got 'yes'"),
    ({"TP_FUSE_STRICT": "1"}, r"\['TP_FUSE_STRICT'\] are not tp_fuse switches"),
    ({"TP_FUSE_SIMULATE_CUDA": "1"}, r"TP_FUSE_SIMULATE_CUDA is fixed when tp_fuse is imported"),
])
def test_refused_overrides_change_nothing(variables, message):
    before = settings.current()
    env = {name: os.environ.get(name) for name in variables}
    with pytest.raises(ValueError, match=message):
        with settings.override(**variables):
            pass
    assert settings.current() is before
    assert {name: os.environ.get(name) for name in variables} == env
