"""The op layer's hook registry (tp_fuse.ops.hooks): packages above it register, the op layer
calls, and running ops never imports the debug package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import tp_fuse.debug.inspect_api as inspect_api
from tp_fuse import ops
from tp_fuse.ops import hooks


def test_first_forward_hooks_run_once_per_op_in_order(monkeypatch) -> None:
    monkeypatch.setattr(hooks, "_FIRST_FORWARD", list(hooks._FIRST_FORWARD))
    seen: list[tuple[str, object]] = []

    def first(op):
        seen.append(("first", op))

    def second(op):
        seen.append(("second", op))

    assert hooks.register_first_forward_hook(first) is first
    hooks.register_first_forward_hook(second)
    hooks.register_first_forward_hook(first)  # once only
    linear = ops.BasicLinear(8, 4)
    model = ops.Sequential(linear)
    model(torch.randn(2, 8))
    model(torch.randn(2, 8))
    assert [(tag, op) for tag, op in seen] == [("first", linear), ("second", linear)]


def test_registry_refuses_a_non_callable() -> None:
    with pytest.raises(ValueError, match="callable"):
        hooks.register_first_forward_hook("not a hook")  # type: ignore[arg-type]


def test_debug_package_registers_its_join() -> None:
    assert inspect_api.join_debug_api_at_first_forward in hooks.first_forward_hooks()


def test_running_ops_does_not_import_the_debug_package() -> None:
    code = textwrap.dedent("""
        import sys, torch
        from tp_fuse import ops
        ops.Sequential(ops.BasicLinear(8, 4), ops.Bias(4))(torch.randn(2, 8))
        assert not [m for m in sys.modules if m.startswith("tp_fuse.debug")], "op layer imported tp_fuse.debug"
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
