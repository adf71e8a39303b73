"""Programmatic entry points: compose a config and train in the current process.

For notebooks and tests; the command line is ``launch/train.py``::

    from tp_fuse.launch.api import compose, train
    cfg = compose(["+model=gpt", "fp8=delayed", "trainer.max_steps=50"])
    result = train(["+model=gpt", "trainer.max_steps=50"], run_dir="runs/a")
    print(result.final_loss)

``train`` starts (and afterwards destroys) the default process group itself unless one
exists: one process, or each rank of a job started some other way.
"""

from __future__ import annotations

import sys
from typing import Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from .comm_timeout import CollectiveTimeoutError, explain_comm_failure
from .config import CONFIG_DIR, TrainConfig
from .config_parse import from_dict
from .config_validate import validate
from .models.build import ModelFactory
from .runtime import env_world_size, start
from .trainer import Trainer

__all__ = ["CONFIG_DIR", "compose", "train"]



def compose(overrides: list[str]) -> TrainConfig:
    """The typed config for command-line style ``overrides`` (not yet validated)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        raw = hydra_compose(config_name="train", overrides=list(overrides))
    data = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(data, dict)
    return from_dict(data)


def train(overrides: list[str], run_dir: str, model_factory: Optional[ModelFactory] = None):
    """Validate, start, train and shut down, in this process; returns the ``TrainResult``."""

    cfg = compose(overrides)
    layout = validate(cfg, env_world_size())
    rt = start(cfg, layout, run_dir)
    try:
        result = Trainer(cfg, rt, model_factory).fit()
    except BaseException as exc:
        # Before the abort: the explanation is agreed through the process group's store.
        why = (explain_comm_failure(exc, rt.rank, rt.dist.world_size, cfg.parallel.timeout_s)
               if isinstance(exc, Exception) else None)
        rt.abort()  # peers blocked in a collective with this rank fail now, not at the timeout
        if why is not None:
            print(f"[tp-fuse] error: {why}", file=sys.stderr, flush=True)
            raise CollectiveTimeoutError(why) from exc
        raise
    rt.shutdown()
    return result
