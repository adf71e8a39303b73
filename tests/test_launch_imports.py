"""What importing the launcher loads: config validation and runs that never checkpoint do not
import ``torch.distributed.checkpoint`` (about a CPU-second with the DTensor and sympy it pulls
in); it is loaded at the first checkpoint save or load (``launch/checkpoint/dcp_io.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import sys
    import tp_fuse.launch.api
    import tp_fuse.launch.config_validate
    import tp_fuse.launch.trainer
    print(sorted(m for m in sys.modules if m == "torch.distributed.checkpoint"
                 or m.startswith("torch.distributed.checkpoint.")
                 or m in ("tp_fuse.launch.checkpoint.dcp_io", "tp_fuse.launch.checkpoint.safe_dcp")))
    """
)


def test_importing_the_launcher_does_not_import_dcp():
    # A fresh interpreter: this test process has DCP loaded by other tests already.
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
