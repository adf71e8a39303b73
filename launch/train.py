"""Train a GPT with tp-fuse: ``torchrun --nproc-per-node=N launch/train.py +model=gpt [overrides]``.

Also runs as one process: ``python launch/train.py +model=gpt``. The Hydra config is
composed from ``configs/`` (``configs/train.yaml`` lists the groups), converted once into
typed dataclasses (``tp_fuse.launch.config``, by ``tp_fuse.launch.config_parse``) and
validated (``tp_fuse.launch.config_validate``) before any process group exists.
See ``docs/launcher.md`` for the configuration reference.
"""

from __future__ import annotations

import atexit
import gc

# No garbage collection during start-up: imports (torch, sympy, hydra, wandb) create millions
# of long-lived objects and little garbage, and each full collection walks all of them (seven
# per run, 0.15-1 s each). run() freezes what the imports left, collects the start-up garbage
# of the run once and re-enables the collector. Only when run as the program: importing this
# file leaves the importer's collector alone.
if __name__ == "__main__":
    gc.disable()

import os  # noqa: E402
import sys  # noqa: E402
from typing import Optional  # noqa: E402

# Before any other import: `python launch/train.py` puts launch/ on sys.path, where
# launch/logging/ would stand in for the standard library's logging; _tp_fuse_checkout takes
# it off and imports tp_fuse from this checkout (see its docstring).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_fuse_checkout import use_checkout  # noqa: E402

use_checkout()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from tp_fuse.launch.checkpoint.manager import CheckpointError  # noqa: E402
from tp_fuse.launch.comm_timeout import explain_comm_failure  # noqa: E402
from tp_fuse.launch.config_parse import from_dict  # noqa: E402
from tp_fuse.launch.config_validate import validate  # noqa: E402
from tp_fuse.launch.config_errors import CONFIG_DIR, precheck, report_and_exit  # noqa: E402
from tp_fuse.launch.health import TrainingDivergedError  # noqa: E402
from tp_fuse.launch.logging.runlog import tee_output  # noqa: E402
from tp_fuse.launch.runtime import env_rank, env_world_size, rank_overrides, start  # noqa: E402
from tp_fuse.launch.trainer import Trainer  # noqa: E402


def run(raw: DictConfig) -> Optional[float]:
    """Validate, start the processes, train; returns the final training loss.

    A bad checkpoint or a diverged run (raised identically on every rank) is printed
    once, by rank 0, without a traceback, and the process exits with status 1.
    """
    # The imports' objects (nothing of this run yet) are frozen: no collection walks them again
    # until the interpreter's final one. _unfreeze is registered before start() registers
    # _free_process_groups_before_finalization, so at exit (atexit runs last-in first-out) that
    # collection walks only this run's objects (its process-group cycles), not every module's
    # (a full collection, 0.2-0.3 s per process); then _unfreeze hands the rest to the final one.
    gc.freeze()
    atexit.unregister(_unfreeze)  # once, however often run() runs in one process
    atexit.register(_unfreeze)
    cfg = from_dict(OmegaConf.to_container(raw, resolve=True))  # type: ignore[arg-type]
    layout = validate(cfg, env_world_size())
    rt = start(cfg, layout, HydraConfig.get().runtime.output_dir)
    # Rank 0's output (start report, log lines, warnings, errors) also goes to train.log.
    with tee_output(os.path.join(rt.run_dir, "train.log"), rt.is_rank0):
        try:
            trainer = Trainer(cfg, rt)
            # One collection frees the run's start-up garbage (cycles holding tensors would
            # otherwise stay for the whole run); it walks only what was made since the freeze.
            gc.collect()
            gc.enable()
            result = trainer.fit()
        except (CheckpointError, TrainingDivergedError) as exc:
            rt.abort()
            if env_rank() == 0:
                print(f"[tp-fuse] error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(getattr(exc, "exit_status", 1)) from None  # an interrupted export: 128 + signal
        except KeyboardInterrupt:  # Ctrl-C outside the training loop (which stops with a save)
            rt.abort()
            _interrupted()
        except Exception as exc:
            # A collective that timed out because a rank did not arrive: one line on every
            # rank that sees it, naming the ranks and parallel.timeout_s (agreed through the
            # store, so before the abort), instead of gloo's bare "Timed out" traceback.
            why = explain_comm_failure(exc, rt.rank, rt.dist.world_size, cfg.parallel.timeout_s)
            rt.abort()  # peers blocked in a collective with this rank fail now, not at the timeout
            if why is None:
                raise
            print(f"[tp-fuse] error: {why}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except BaseException:
            rt.abort()  # peers blocked in a collective with this rank fail now, not at the timeout
            raise
        rt.shutdown()
    return result.final_loss


def _unfreeze() -> None:
    """At exit: hand the frozen objects back to the interpreter's final collection, which frees
    them as it always did (nanobind, in Triton, reports its objects left unfreed as leaks).
    The collector is disabled first: one full collection at shutdown, not two."""
    gc.disable()
    gc.unfreeze()


def _interrupted() -> None:
    """SIGINT before or after the training loop: one line, no traceback, status 130."""
    if env_rank() == 0:
        # Not "nothing was saved": after the loop its checkpoints are (SIGINT during an export
        # is the export's own error, which names the checkpoint).
        print("[tp-fuse] interrupted (SIGINT) outside the training loop; checkpoints saved before are kept, "
              "nothing else was saved", file=sys.stderr, flush=True)
    raise SystemExit(130) from None


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(raw: DictConfig) -> float:
    return run(raw)


if __name__ == "__main__":
    # Config errors are reported before Hydra creates a run directory: one line, rank 0 only.
    error = precheck(sys.argv[1:], CONFIG_DIR, env_world_size())
    if error is not None:
        report_and_exit(error, env_rank())
    sys.argv += rank_overrides(sys.argv[1:])
    try:
        main()
    except KeyboardInterrupt:  # during start-up: Hydra, imports, process-group rendezvous
        _interrupted()
