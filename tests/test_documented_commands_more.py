"""The documented commands of docs/launcher.md, docs/debug.md and docs/scale-out.md run as
written: the rules, and the other docs' blocks, are in test_documented_commands.py. Two
modules so that make test's two pytest-xdist workers (whole modules each) share the
suite's longest part.
"""

from __future__ import annotations

import pytest
from test_documented_commands import MORE_DOCS, cases, launcher, run_block  # noqa: F401 (launcher: a fixture)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("commands", cases(MORE_DOCS))
def test_documented_commands_run_as_written(commands, tmp_path, launcher):
    run_block(commands, tmp_path, launcher)
