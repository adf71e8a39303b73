"""Distributed checkpoints: save, find, verify and resume (``torch.distributed.checkpoint``,
through :mod:`tp_fuse.launch.checkpoint.dcp_io`, imported at the first save or load).

Contents of ``<checkpoint.dir>/step_XXXXXXXX/``:

* DCP files (``.metadata``, ``__<rank>_*.distcp``) holding
  ``model/<param>`` and ``optim/<param>/{exp_avg,exp_avg_sq,step}`` -- TP-sharded
  tensors as DTensors in their *full* (TP=1) layout, so a checkpoint loads at any TP
  size (DCP reads each rank's new slice); replicated tensors are written once; a tensor
  of unequal fused parts (``tp_fuse.layers.ShardSpec.sizes``: Phi-3's GQA ``[q; k; v]``) is
  written part by part, ``model/<param>/part<i>`` (and likewise under ``optim/``);
  ``rank<r>/fp8/<module>/<role>/{scale,amax_history,last_amax,nonfinite_amax_count}``
  (delayed-scaling state), ``rank<r>/rng/...`` (torch and dropout RNG states) and
  ``train/{step,consumed_samples}`` (position in the data).
* ``tp_fuse_checkpoint.json``: step, layout, model/FP8 config, and the size and
  SHA-256 of every file (checked before loading when ``checkpoint.verify``).

Atomicity: everything is written into ``.tmp-step_XXXXXXXX`` and renamed into place
only after all ranks finished and the manifest is on disk; ``latest`` is then replaced
atomically. A crash mid-save leaves a ``.tmp-*`` directory that is never read (and
is removed by the next save), so the previous checkpoint is never damaged.

Safety: a checkpoint directory is untrusted. Nothing in it is unpickled beyond tensors
(``torch.load(weights_only=True)``) and DCP's ``.metadata``, which is read by an unpickler
admitting exact (module, name) pairs of data classes and then checked to hold tensor
entries only (``tp_fuse.launch.checkpoint.safe_dcp``). Non-tensor state is stored as tensors or JSON.
Parameters or optimizer state that are not finite are never saved, and retention never
deletes the newest checkpoint. Which run a directory belongs to, and which checkpoint a
start resumes, is decided in ``tp_fuse.launch.checkpoint.run_identity``; one job at a time holds the
directory (``tp_fuse.launch.checkpoint.dir_lock``); loaded tensors are range-checked before use
(``tp_fuse.launch.checkpoint.loaded_state``: e.g. an inf FP8 scale is refused, naming its key).

Resharding: model and optimizer tensors reshard to any TP/DP layout. Per-rank state
(RNG, FP8 amax histories) is restored per rank when the layout is unchanged; after a
layout change the FP8 state of rank 0 is used everywhere (it is identical on all ranks
with ``fp8.group=world``) and RNG streams are re-seeded from ``trainer.seed`` and the step.
The mapping of the live training state onto these keys, and back, is
:mod:`tp_fuse.launch.checkpoint.training_state`'s; this module owns the directory, saving
and loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..runtime import Runtime
from .dir_lock import DirLock
from .dir_lock import acquire as acquire_dir_lock
from .errors import CheckpointError
from .files import FORMAT_VERSION, describe_os_error, file_table, read_manifest, verify_files, write_atomic
from .run_identity import IDENTITY_FILE, MANIFEST, decide_start, decision_from_box, decision_to_box, list_step_dirs
from .run_identity import read_manifest_run_id
from .loaded_state import loaded_state_problem
from .run_owner import live_owner_problem, mark_ended
from .training_state import TrainingState, apply_state_dict, build_state_dict, reseed_rng

__all__ = ["CheckpointError", "CheckpointManager", "MANIFEST"]

LATEST = "latest"


def _say(line: str) -> None:
    print(f"[tp-fuse] {line}", file=sys.stderr, flush=True)


class CheckpointManager:
    """Saves to and resumes from one checkpoint directory (all ranks call every method).

    Args:
        root: the checkpoint directory (shared by all ranks).
        rt: the runtime (groups, mesh, rank).
        keep: number of checkpoints of this run to keep.
        verify: check SHA-256 hashes before loading (sizes are always checked).
        writer_factory: builds DCP's storage writer for a directory (default: DCP's
            ``FileSystemWriter``; tests inject faults).
    """

    def __init__(
        self,
        root: str,
        rt: Runtime,
        *,
        keep: int = 2,
        verify: bool = True,
        writer_factory: Optional[Callable[[str], Any]] = None,
    ) -> None:
        self.root = os.path.abspath(root)
        self.rt = rt
        self.keep = keep
        self.verify = verify
        self.writer_factory = writer_factory
        self.run_id: Optional[str] = None  # set by :meth:`start`
        self.lock: Optional[DirLock] = None  # rank 0, from :meth:`start` until :meth:`release`
        # Rank 0: the lock created the directory. If nothing was saved into it, :meth:`release`
        # removes it again (checkpoint.interval=0 must not leave an empty checkpoints/ behind).
        self._created_root = False
        self._job: Optional[str] = None  # rank 0: the job key that claimed the directory (start)

    def release(self) -> None:
        """Give up the directory's lock (rank 0; a no-op elsewhere and when not held)."""
        if self.lock is not None:
            if self.lock.lost() is None and self._job is not None:
                with contextlib.suppress(OSError, CheckpointError):  # best effort: the next job checks the pid
                    mark_ended(self.root, self.run_id, self._job)
            self.lock.release()
            self.lock = None
            if self._created_root:
                self._remove_if_unused()

    def _remove_if_unused(self) -> None:
        """Remove the directory this job created if it holds no more than the run's identity
        file (nothing was saved: nothing to resume, so ``run.json`` alone means nothing)."""
        with contextlib.suppress(OSError):  # gone, unreadable, or filled by someone else meanwhile
            if set(os.listdir(self.root)) <= {IDENTITY_FILE}:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.root, IDENTITY_FILE))
                os.rmdir(self.root)  # fails (and stays) if anything appeared in between

    # ---- discovery ----------------------------------------------------------

    def complete_checkpoints(self, run_id: Optional[str] = None) -> list[str]:
        """Complete checkpoint directories (manifest present), oldest first; only ``run_id``'s if given."""
        found = [p for _, p, complete in list_step_dirs(self.root) if complete]
        if run_id is not None:
            found = [p for p in found if read_manifest_run_id(p) == run_id]
        return found

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint, or None."""
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def latest_of_run(self) -> Optional[str]:
        """The newest complete checkpoint of this run (the one it resumed counts), or None."""
        found = self.complete_checkpoints(self.run_id) if self.run_id is not None else []
        return found[-1] if found else None

    def start(self, resume: Union[bool, str], *, restarted: bool, job: str, overwrite: bool) -> Optional[str]:
        """Decide (rank 0) and agree (all ranks) on the run id and the checkpoint to resume.

        Rank 0 first takes the directory's lock for the job's life (:mod:`tp_fuse.launch.checkpoint.dir_lock`;
        given up by :meth:`release`). Returns the checkpoint directory to :meth:`load`, or
        None to start at step 0. Raises :class:`CheckpointError` on every rank when another
        job holds the directory, or it belongs to another run (see :mod:`tp_fuse.launch.checkpoint.run_identity`).
        """
        box: list[Any] = [None, None, [], None]
        if self.rt.is_rank0:
            try:
                # The lock first: a second job on this directory must change nothing in it.
                if self.lock is None:
                    self._created_root = not os.path.lexists(self.root)
                    self.lock = acquire_dir_lock(self.root, job=job, say=_say)
                    # A lock got without taking over a dead job's lock file, while run.json
                    # says another job runs: that job's lock file was deleted (run_owner).
                    owner = live_owner_problem(self.root, job) if self.lock is not None and \
                        self.lock.took_over is None else None
                    if owner is not None:
                        raise CheckpointError(owner)
                self._job = job
                decision = decide_start(self.root, resume, restarted=restarted, job=job, overwrite=overwrite)
                if self.lock is not None:
                    self.lock.set_run_id(decision.run_id)
                box = decision_to_box(decision)
            except CheckpointError as exc:  # the directory is in use, or holds a link or special file
                box = ["", None, [], str(exc)]
            except OSError as exc:
                box = ["", None, [], f"checkpoint.dir {self.root}: {exc.strerror or exc} ({exc.filename or ''})"]
        if self.rt.layout.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.rt.topology.world_group)
        decision = decision_from_box(box)
        if decision.error is not None:
            self.release()
            raise CheckpointError(decision.error)
        if self.rt.is_rank0:
            for line in decision.messages:
                print(f"[tp-fuse] {line}", file=sys.stderr, flush=True)
        self.run_id = decision.run_id
        return decision.resume_from

    # ---- save -------------------------------------------------------------------

    def save(self, state: TrainingState, extra: Optional[dict[str, Any]] = None) -> str:
        """Write a checkpoint of ``state`` atomically; returns its directory.

        Raises :class:`CheckpointError` on every rank, with the previous checkpoint
        intact, when parameters or optimizer state are not finite, or when writing fails
        (the cause named: e.g. no space left on the device of the checkpoint directory).
        """
        rt = self.rt
        name = f"step_{state.step:08d}"
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".tmp-{name}")
        self._refuse_nonfinite(state)
        # Rank 0 holds the directory's lock: if its file went, another job may be here now.
        problem = self.lock.lost() if self.lock is not None else None
        if rt.is_rank0 and problem is None:
            try:
                os.makedirs(self.root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
                os.makedirs(tmp)
            except OSError as exc:
                problem = f"cannot create {tmp}: {exc.strerror or exc}"
        self._raise_if_any(problem, state.step)
        # torch.distributed.checkpoint loads at the first save: runs that never save skip it.
        from . import dcp_io

        sd = build_state_dict(state, rt, fp8_rank=rt.rank, with_rng=True, for_load=False)
        try:
            dcp_io.write_state_dict(sd, tmp, self.writer_factory, rt.topology.world_group)
        except dcp_io.FAILURES as exc:  # DCP raises the same failure on every rank
            cause = dcp_io.describe_write_failure(exc, tmp, sd)
            if rt.is_rank0:
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the last good one stays
            raise CheckpointError(self._save_failed(state.step, cause)) from None
        rt.barrier()
        problem = None
        if rt.is_rank0:
            try:
                self._finish_save(state, tmp, final, name, extra)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                problem = describe_os_error(exc, tmp)
        self._raise_if_any(problem, state.step)
        return final

    def _finish_save(self, state: TrainingState, tmp: str, final: str, name: str,
                     extra: Optional[dict[str, Any]]) -> None:
        """Rank 0: manifest, rename into place, ``latest``, retention (this run's only)."""
        manifest = {
            "format": FORMAT_VERSION,
            "run_id": self.run_id,
            "step": state.step,
            "loss": state.last_loss,
            "consumed_samples": state.loader.consumed_samples,
            "world_size": self.rt.layout.world_size,
            "tp": self.rt.layout.tp,
            "dp": self.rt.layout.dp,
            "model": state.model_config,
            "fp8_recipe": None if state.recipe is None else repr(state.recipe),
            "amax_history_len": getattr(state.recipe, "amax_history_len", None),
            "time": time.time(),
            "files": file_table(tmp),
            **(extra or {}),
        }
        write_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
        if os.path.exists(final):
            # Same step saved again (e.g. after a restart): swap, never leave no copy.
            old = os.path.join(self.root, f".old-{name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        write_atomic(os.path.join(self.root, LATEST), name + "\n")
        # Only this run's checkpoints are pruned, never the one just written.
        own = [p for p in self.complete_checkpoints(self.run_id) if p != final]
        for path in own[: max(0, len(own) - (self.keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)

    def _raise_if_any(self, problem: Optional[str], step: int) -> None:
        """Rank 0's problem (or None) raised as the same CheckpointError on every rank."""
        box = [problem]
        if self.rt.layout.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.rt.topology.world_group)
        if box[0] is not None:
            raise CheckpointError(self._save_failed(step, box[0]))

    def _save_failed(self, step: int, cause: str) -> str:
        last = self.complete_checkpoints(self.run_id)
        kept = f"the last good checkpoint {last[-1]} is intact" if last else "no earlier checkpoint of this run exists"
        return f"saving checkpoint step {step} in {self.root} failed: {cause}; {kept}"

    def _refuse_nonfinite(self, state: TrainingState) -> None:
        """Raise on every rank if any rank's parameters or optimizer state hold NaN/inf."""
        bad = None
        for name, p in state.model.named_parameters():
            tensors = {"parameter": p.detach(), **{
                f"optimizer state {k} of": t for k, t in state.optimizer.state.get(p, {}).items()
                if torch.is_tensor(t) and t.is_floating_point()
            }}
            for what, t in tensors.items():
                t = t.to_local() if isinstance(t, DTensor) else t  # FSDP2: this rank's shard
                if not bool(torch.isfinite(t).all()):
                    bad = f"{what} {name}"
                    break
            if bad is not None:
                break
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.rt.device)
        if self.rt.layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.rt.topology.world_group)
        if float(flag) > 0:
            where = f"{bad} is" if bad is not None else "another rank's parameters or optimizer state are"
            raise CheckpointError(self._save_failed(
                state.step, f"refusing to save: {where} not finite (NaN/inf); training has diverged"
            ))

    # ---- load -------------------------------------------------------------------

    def load(self, path: str, state: TrainingState) -> int:
        """Restore ``state`` from the checkpoint at ``path``; returns its step.

        Raises :class:`CheckpointError` for a missing, incomplete, corrupt or
        incompatible checkpoint (the same error on every rank).
        """
        # torch.distributed.checkpoint loads at the first load: runs that start fresh skip it.
        from . import dcp_io

        rt = self.rt
        problem: list[Optional[str]] = [None]
        manifest: dict[str, Any] = {}
        if rt.is_rank0:
            try:
                manifest = read_manifest(path)
                problem[0] = (verify_files(path, manifest, verify_hashes=self.verify)
                              or dcp_io.unlisted_file(path, manifest["files"]))
                if problem[0] is not None:
                    problem[0] = f"checkpoint {path} is corrupt: {problem[0]}"
                elif not self.verify:
                    print(f"[tp-fuse] checkpoint.verify=false: loading {path} WITHOUT checking file hashes "
                          "(sizes only); flipped bytes would go unnoticed", file=sys.stderr, flush=True)
            except CheckpointError as exc:
                problem[0] = str(exc)
        box = [problem[0], manifest]
        if rt.layout.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=rt.topology.world_group)
        if box[0] is not None:
            raise CheckpointError(box[0])
        manifest = box[1]
        self._check_compatible(path, manifest, state)

        same_layout = manifest["world_size"] == rt.layout.world_size and manifest["tp"] == rt.layout.tp
        saved_fp8 = manifest.get("fp8_recipe") is not None and state.recipe is not None
        saved_fp8 = saved_fp8 and repr(state.recipe).split("(")[0] == manifest["fp8_recipe"].split("(")[0]
        state_for_load = dataclasses.replace(state, recipe=state.recipe if saved_fp8 else None)
        if state.recipe is not None and not saved_fp8 and rt.is_rank0:
            # Accepted (weights and optimizer state carry over), but FP8 scaling restarts from scratch.
            saved = manifest.get("fp8_recipe")
            _say(f"note: checkpoint {path} was trained "
                 + (f"with another FP8 recipe ({saved.split('(')[0]})" if saved else "without FP8")
                 + f"; this run uses {type(state.recipe).__name__}: its FP8 state (amax history, scales) starts fresh")
        sd = build_state_dict(
            state_for_load, rt, fp8_rank=rt.rank if same_layout else 0, with_rng=same_layout, for_load=True
        )
        try:
            dcp_io.read_state_dict(sd, path, rt.topology.world_group)
        except dcp_io.FAILURES as exc:  # DCP's is a BaseException; name the checkpoint
            ours = next((e for e in dcp_io.chain(exc) if isinstance(e, CheckpointError)), None)
            if ours is not None:
                raise CheckpointError(f"checkpoint {path}: {ours}") from None
            raise CheckpointError(f"checkpoint {path} could not be loaded: {dcp_io.describe_dcp_failure(exc)}") from exc
        self._refuse_out_of_range(path, sd)
        apply_state_dict(sd, state_for_load, rt, same_layout)
        state.step = int(sd["train/step"])
        loss = manifest.get("loss")
        state.last_loss = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
        state.loader.load_state_dict({"consumed_samples": int(sd["train/consumed_samples"])})
        if not same_layout:
            reseed_rng(state, rt)
        return state.step

    def _refuse_out_of_range(self, path: str, sd: dict[str, Any]) -> None:
        """Raise the same CheckpointError on every rank if any rank loaded state out of range.

        Per-rank FP8 state differs between ranks, so every rank checks what it loaded and
        the first rank's problem is raised everywhere (one small all-gather, once per load).
        """
        problem = loaded_state_problem(sd)
        problems = [problem]
        if self.rt.layout.world_size > 1:
            problems = [None] * self.rt.layout.world_size
            dist.all_gather_object(problems, problem, group=self.rt.topology.world_group)
        first = next((p for p in problems if p is not None), None)
        if first is not None:
            raise CheckpointError(f"checkpoint {path}: {first}; refusing to resume from it (damaged or crafted?)")

    def _check_compatible(self, path: str, manifest: dict[str, Any], state: TrainingState) -> None:
        saved = manifest.get("model", {})
        diffs = [f"model.{k}: checkpoint {saved.get(k)!r}, config {v!r}"
                 for k, v in state.model_config.items() if k != "name" and saved.get(k) != v]
        if diffs:
            raise CheckpointError(f"checkpoint {path} was trained with a different model: " + "; ".join(diffs))
        hist = manifest.get("amax_history_len")
        cur = getattr(state.recipe, "amax_history_len", None)
        if hist is not None and cur is not None and hist != cur:
            raise CheckpointError(
                f"checkpoint {path}: fp8.amax_history_len was {hist}, config has {cur}; "
                "the amax histories cannot be restored"
            )
