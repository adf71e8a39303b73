"""A checkpoint save cut short by the process's file-size limit (``ulimit -f``) is named as
that (issue 40 point 8): torch.save's own report was "unexpected pos 704 vs 598"."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from test_launch_train import ROOT

# torch.save's zip writer says "unexpected pos 704 vs 598" for this model's save (no OSError
# in the chain); COMMON's FP8 model keeps DCP's EFBIG instead. Both are named as the limit.
ARGS = ["+model=gpt", "trainer.max_steps=1", "logger=none", "trainer.progress=false", "trainer.val_interval=0"]


def test_a_file_size_limit_during_a_save_is_named(tmp_path):
    limit = 64 << 10  # the step-1 checkpoint of the default +model=gpt is ~10 MB

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), *ARGS,
                           "checkpoint.interval=1", f"checkpoint.dir={tmp_path / 'ck'}",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240, preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("[tp-fuse] error: ")]
    assert len(errors) == 1 and "unexpected pos" not in errors[0], proc.stderr[-3000:]
    # Either the EFBIG that DCP kept in its failure chain, or torch.save's short-write report:
    # both are named as the limit (which of the two a save gives depends on where it is cut).
    assert errors[0].startswith(f"[tp-fuse] error: saving checkpoint step 1 in {tmp_path / 'ck'} failed: "), errors[0]
    assert f"file-size limit (ulimit -f: {limit} bytes)" in errors[0], errors[0]
