"""The TE room (``tp_fuse.te``) is the top floor: TE's names and module paths still resolve
(to the same objects), and importing a lower floor does not import the floors above it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import tp_fuse as te


def _run(code: str) -> None:
    # A fresh interpreter: this one has imported everything already.
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_lower_floors_do_not_import_upper_ones() -> None:
    _run("""
        import sys
        import tp_fuse.comm
        upper = [m for m in sys.modules if m.startswith(("tp_fuse.layers", "tp_fuse.te", "tp_fuse.launch"))]
        assert not upper, upper
        import tp_fuse.ops
        upper = [m for m in sys.modules if m.startswith(("tp_fuse.layers", "tp_fuse.te", "tp_fuse.launch"))]
        assert not upper, upper
    """)


def test_te_paths_are_the_te_room_modules() -> None:
    _run("""
        import sys
        import tp_fuse.module.base as base
        import tp_fuse.te.module.base as real
        assert base is real
        from tp_fuse.constants import TE_DType
        from tp_fuse.te.constants import TE_DType as real_map
        assert TE_DType is real_map
        import tp_fuse.attention.multi_head_attention as mha
        assert mha is sys.modules["tp_fuse.te.attention.multi_head_attention"]
        import tp_fuse.transformer, tp_fuse.cpp_extensions
        assert tp_fuse.transformer is sys.modules["tp_fuse.te.transformer"]
        # No second copy of any TE module was loaded under its TE path.
        assert not [m for m in sys.modules if m.startswith("tp_fuse.module.") and m != "tp_fuse.module.base"]
    """)


def test_te_names_on_the_package() -> None:
    from tp_fuse import te as room

    for name in ("Linear", "LayerNormLinear", "LayerNormMLP", "MultiheadAttention", "TransformerLayer"):
        assert getattr(te, name) is getattr(room, name)
        assert name in te.__all__
    assert te.module.base.initialize_ub is room.module.base.initialize_ub
    assert te.cpp_extensions.general_gemm is room.cpp_extensions.general_gemm
