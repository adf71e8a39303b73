"""A collective that times out names the rank that did not arrive and ``parallel.timeout_s``
(issue 24, case 8): 2 gloo ranks, one process start.

Rank 0 stops for longer than ``parallel.timeout_s`` in the middle of step 2 (a stall: a
slow file system, a debugger, a swapped-out host). Rank 1, waiting in the next collective,
used to fail with gloo's ``Timed out waiting 3000ms for recv operation to complete`` and a
traceback; now both ranks -- rank 1 when it gives up, rank 0 when it comes back and finds
its peer gone -- say which rank did not arrive and name ``parallel.timeout_s``. The
checkpoint of step 1 is there and complete (nothing else changed).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.multirank

TIMEOUT_S = 3
STALL_S = 9  # > parallel.timeout_s + the waiting rank's grace (at most parallel.timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stalled_run(rank: int, world: int, port: int, run_dir: str, ck: str) -> dict[str, Any]:
    from tp_fuse.launch.api import train
    from tp_fuse.launch.comm_timeout import CollectiveTimeoutError
    from tp_fuse.layers import GPT

    # The launcher starts its own group, with parallel.timeout_s as the collective timeout.
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    forwards = [0]

    def factory(*args: Any, **kwargs: Any) -> GPT:
        model = GPT(*args, **kwargs)

        def stall(module: Any, inputs: Any) -> None:
            if module.training:
                forwards[0] += 1
                if rank == 0 and forwards[0] == 3:  # step 2's first micro-batch
                    time.sleep(STALL_S)

        model.register_forward_pre_hook(stall)
        return model

    out: dict[str, Any] = {}
    try:
        train(["+model=gpt", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
               "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.max_steps=4",
               "trainer.val_interval=0", "logger=none", "trainer.progress=false", f"parallel.timeout_s={TIMEOUT_S}",
               "checkpoint.interval=1", f"checkpoint.dir={ck}"], run_dir, model_factory=factory)
        out["error"] = None
    except CollectiveTimeoutError as e:
        out["error"] = str(e)
        out["cause"] = repr(e.__cause__)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"unexplained {type(e).__name__}: {e}"
    # run_distributed's worker destroys the default group after this function.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("timeout")
    values = run_distributed(2, _stalled_run, _free_port(), str(tmp / "run"), str(tmp / "ck"), timeout=240)
    return [{**v, "ck": tmp / "ck"} for v in values]


def test_the_waiting_rank_names_the_rank_that_did_not_arrive(results) -> None:
    msg = results[1]["error"]
    assert msg == (f"rank 1: a collective timed out after parallel.timeout_s={TIMEOUT_S} s: rank [0] did not arrive "
                   f"(rank(s) [1] were waiting in it). Raise parallel.timeout_s if rank [0] was slow but alive (a "
                   f"long data load, checkpoint write or compilation); otherwise see its output for why it stopped"), msg
    assert "Timed out" in results[1]["cause"], results[1]["cause"]  # gloo's error is kept as the cause


def test_the_late_rank_is_told_too(results) -> None:
    msg = results[0]["error"]
    assert msg is not None and msg.startswith(
        f"rank 0: rank [0] (this one included) did not arrive at a collective within "
        f"parallel.timeout_s={TIMEOUT_S} s; rank(s) [1] waited for it and gave up"), msg


def test_the_checkpoint_before_the_stall_is_kept(results) -> None:
    ck = results[0]["ck"]
    assert (ck / "step_00000001" / ".metadata").is_file(), sorted(os.listdir(ck))
