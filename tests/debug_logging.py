"""nvdlfw-inspect debug sessions for tests: tp_fuse's features and a logger that records
every statistic it is given (shared by the debug-API and TE module-class tests)."""

from __future__ import annotations

import textwrap
from typing import Any

import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import BaseLogger

import tp_fuse.debug


class RecordingLogger(BaseLogger):
    """A statistics logger recording what nvdlfw-inspect's MetricLogger is given:
    ``rows[(name, iteration)] = value``."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], float] = {}

    def log_scalar(self, name, value, iteration, **kwargs):
        self.rows[(name, iteration)] = float(value)


def start_debug(tmp_path: Any, config: str, **kwargs: Any) -> RecordingLogger:
    """``debug_api.initialize`` with the YAML ``config`` (dedented) and tp_fuse's feature
    directory; returns the recording logger. The caller ends it with ``debug_api.end_debug()``."""
    path = tmp_path / "debug.yaml"
    path.write_text(textwrap.dedent(config))
    logger = RecordingLogger()
    debug_api.initialize(config_file=str(path), feature_dirs=[tp_fuse.debug.FEATURE_DIR],
                         statistics_logger=logger, log_dir=str(tmp_path), **kwargs)
    return logger
