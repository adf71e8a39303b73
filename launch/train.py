"""Train a GPT with tp-fuse: ``torchrun --nproc-per-node=N launch/train.py +model=gpt [overrides]``.

Also runs as one process: ``python launch/train.py +model=gpt``. The Hydra config is
composed from ``configs/`` (``configs/train.yaml`` lists the groups), converted once into
typed dataclasses (``launch.config``) and validated before any process group exists.
See ``docs/launcher.md`` for the configuration reference.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

# `python launch/train.py` puts launch/ (not the repository root) on sys.path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from launch.checkpoint import CheckpointError  # noqa: E402
from launch.config import from_dict, validate  # noqa: E402
from launch.health import TrainingDivergedError  # noqa: E402
from launch.runtime import env_rank, env_world_size, rank_overrides, start  # noqa: E402
from launch.trainer import Trainer  # noqa: E402


def run(raw: DictConfig) -> Optional[float]:
    """Validate, start the processes, train; returns the final training loss.

    A bad checkpoint or a diverged run (raised identically on every rank) is printed
    once, by rank 0, without a traceback, and the process exits with status 1.
    """
    cfg = from_dict(OmegaConf.to_container(raw, resolve=True))  # type: ignore[arg-type]
    layout = validate(cfg, env_world_size())
    rt = start(cfg, layout, HydraConfig.get().runtime.output_dir)
    try:
        result = Trainer(cfg, rt).fit()
    except (CheckpointError, TrainingDivergedError) as exc:
        rt.abort()
        if env_rank() == 0:
            print(f"[tp-fuse] error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except BaseException:
        rt.abort()  # peers blocked in a collective with this rank fail now, not at the timeout
        raise
    rt.shutdown()
    return result.final_loss


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(raw: DictConfig) -> float:
    return run(raw)


if __name__ == "__main__":
    sys.argv += rank_overrides(sys.argv[1:])
    main()
