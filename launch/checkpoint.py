"""Distributed checkpoints: save, find, verify and resume (``torch.distributed.checkpoint``).

Contents of ``<checkpoint.dir>/step_XXXXXXXX/``:

* DCP files (``.metadata``, ``__<rank>_*.distcp``) holding
  ``model/<param>`` and ``optim/<param>/{exp_avg,exp_avg_sq,step}`` -- TP-sharded
  tensors as DTensors in their *full* (TP=1) layout, so a checkpoint loads at any TP
  size (DCP reads each rank's new slice); replicated tensors are written once;
  ``rank<r>/fp8/<module>/<role>/{scale,amax_history,last_amax,nonfinite_amax_count}``
  (delayed-scaling state), ``rank<r>/rng/...`` (torch and dropout RNG states) and
  ``train/{step,consumed_samples}`` (position in the data).
* ``tp_fuse_checkpoint.json``: step, layout, model/FP8 config, and the size and
  SHA-256 of every file (checked before loading when ``checkpoint.verify``).

Atomicity: everything is written into ``.tmp-step_XXXXXXXX`` and renamed into place
only after all ranks finished and the manifest is on disk; ``latest`` is then replaced
atomically. A crash mid-save leaves a ``.tmp-*`` directory that is never read (and
is removed by the next save), so the previous checkpoint is never damaged.

Safety: no pickle of arbitrary objects is ever loaded. Tensors are read by DCP with
``torch.load(weights_only=True)``; DCP's ``.metadata`` (a pickle) is read with an
unpickler that only admits DCP's metadata classes (``launch.safe_dcp``).

Resharding: model and optimizer tensors reshard to any TP/DP layout. Per-rank state
(RNG, FP8 amax histories) is restored per rank when the layout is unchanged; after a
layout change the FP8 state of rank 0 is used everywhere (it is identical on all ranks
with ``fp8.group=world``) and RNG streams are re-seeded from ``trainer.seed`` and the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard

from layers import get_shard_spec
from layers.fsdp import copy_dp_shard_, dp_shard_like, dp_unsharded, dp_unsharded_empty
from tp_fuse import autocast
from tp_fuse.debug import name_linears
from tp_fuse.quantization import DelayedScalingQuantizer
from tp_fuse.recipe import Recipe

from .data import BatchLoader
from .model import dropout_seed
from .runtime import Runtime
from .safe_dcp import SafeFileSystemReader

__all__ = ["CheckpointError", "CheckpointManager", "TrainingState", "MANIFEST"]

MANIFEST = "tp_fuse_checkpoint.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_QUANTIZER_FIELDS = ("scale", "amax_history", "last_amax", "nonfinite_amax_count")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or incompatible with the config."""


@dataclasses.dataclass
class TrainingState:
    """What a checkpoint captures (references to the live objects, plus the step)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: BatchLoader
    recipe: Optional[Recipe]
    fp8_group: Optional[dist.ProcessGroup]
    seed: int
    model_config: dict[str, Any]
    step: int = 0


# ---- helpers ------------------------------------------------------------------------


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_table(directory: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and name != MANIFEST:
            out[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    return out


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _global_view(local: torch.Tensor, spec: Any, rt: Runtime) -> torch.Tensor:
    """A TP shard as a DTensor of the full tensor (replicated tensors as they are).

    The sharded dim of size ``extent`` is viewed as ``(blocks, extent / blocks)`` so that
    every block is split evenly over the TP ranks (``layers.ShardSpec``): the stored
    global shape is the same at every TP size.
    """
    if spec is None:
        return local
    d, b = spec.dim, spec.blocks
    shape = list(local.shape)
    view = local.reshape(shape[:d] + [b, shape[d] // b] + shape[d + 1 :])
    return DTensor.from_local(view, rt.topology.mesh, [Replicate(), Shard(d + 1)], run_check=False)


def _fp8_quantizers(state: TrainingState) -> dict[str, dict[str, DelayedScalingQuantizer]]:
    """Delayed-scaling quantizers of every BasicLinear, by module path and role.

    Asking the ops inside an autocast creates missing quantizers (e.g. before the first
    step of a resumed run) with the recipe the training loop uses.
    """
    if state.recipe is None:
        return {}
    out: dict[str, dict[str, DelayedScalingQuantizer]] = {}
    with autocast(recipe=state.recipe, amax_reduction_group=state.fp8_group):
        for name in name_linears(state.model):
            qs = name.op.fp8_quantizers() or {}
            delayed = {role: q for role, q in qs.items() if isinstance(q, DelayedScalingQuantizer)}
            if delayed:
                out[name.qualname] = delayed
    return out


class CheckpointManager:
    """Saves to and resumes from one checkpoint directory (all ranks call every method).

    Args:
        root: the checkpoint directory (shared by all ranks).
        rt: the runtime (groups, mesh, rank).
        keep: number of checkpoints to keep.
        verify: check file sizes and hashes before loading.
    """

    def __init__(self, root: str, rt: Runtime, *, keep: int = 2, verify: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.rt = rt
        self.keep = keep
        self.verify = verify

    # ---- discovery ----------------------------------------------------------

    def complete_checkpoints(self) -> list[str]:
        """Complete checkpoint directories (manifest present), oldest first."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, MANIFEST)):
                found.append((int(m.group(1)), os.path.join(self.root, name)))
        return [p for _, p in sorted(found)]

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint, or None."""
        found = self.complete_checkpoints()
        return found[-1] if found else None

    # ---- state dict -----------------------------------------------------------

    def _state_dict(self, state: TrainingState, *, fp8_rank: int, with_rng: bool, for_load: bool) -> dict[str, Any]:
        rt = self.rt
        sd: dict[str, Any] = {}
        optimized = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
        for name, p in state.model.named_parameters():
            spec = get_shard_spec(p)
            # FSDP2 parameters (DTensors over DP) are stored as their whole TP shard.
            local = dp_unsharded_empty(p) if for_load else dp_unsharded(p.detach())
            sd[f"model/{name}"] = _global_view(local, spec, rt)
            if id(p) not in optimized:
                continue  # frozen parameter: no optimizer state
            # A parameter that never had a gradient has no AdamW state yet: zeros and
            # step 0 are exactly what AdamW would start from.
            opt_state = state.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                t = opt_state.get(key) if not for_load else None
                t = dp_unsharded(t) if t is not None else torch.zeros_like(dp_unsharded_empty(p))
                sd[f"optim/{name}/{key}"] = _global_view(t, spec, rt)
            step = opt_state.get("step") if not for_load else None
            sd[f"optim/{name}/step"] = step.detach().cpu() if step is not None else torch.zeros((), dtype=torch.float32)
        sd["train/step"] = torch.tensor(state.step, dtype=torch.int64)
        sd["train/consumed_samples"] = torch.tensor(state.loader.consumed_samples, dtype=torch.int64)
        for qualname, qs in _fp8_quantizers(state).items():
            for role, q in qs.items():
                for field in _QUANTIZER_FIELDS:
                    t = getattr(q, field)
                    sd[f"rank{fp8_rank}/fp8/{qualname}/{role}/{field}"] = torch.empty_like(t) if for_load else t.detach()
        if with_rng:
            for key, t in self._rng_state(state).items():
                sd[f"rank{rt.rank}/rng/{key}"] = torch.empty_like(t) if for_load else t
        return sd

    def _rng_state(self, state: TrainingState) -> dict[str, torch.Tensor]:
        out = {"torch_cpu": torch.get_rng_state()}
        if self.rt.device.type == "cuda":
            out["torch_cuda"] = torch.cuda.get_rng_state(self.rt.device)
        rng = getattr(state.model, "dropout_rng", None)
        if rng is not None:
            out.update({f"dropout/{k}": v for k, v in rng.state_dict().items()})
        return out

    # ---- save -------------------------------------------------------------------

    def save(self, state: TrainingState, extra: Optional[dict[str, Any]] = None) -> str:
        """Write a checkpoint of ``state`` atomically; returns its directory."""
        rt = self.rt
        name = f"step_{state.step:08d}"
        final = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".tmp-{name}")
        if rt.is_rank0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            os.makedirs(tmp)
        rt.barrier()
        sd = self._state_dict(state, fp8_rank=rt.rank, with_rng=True, for_load=False)
        dcp.save(sd, storage_writer=FileSystemWriter(tmp), process_group=rt.topology.world_group)
        rt.barrier()
        if rt.is_rank0:
            manifest = {
                "format": FORMAT_VERSION,
                "step": state.step,
                "consumed_samples": state.loader.consumed_samples,
                "world_size": rt.layout.world_size,
                "tp": rt.layout.tp,
                "dp": rt.layout.dp,
                "model": state.model_config,
                "fp8_recipe": None if state.recipe is None else repr(state.recipe),
                "amax_history_len": getattr(state.recipe, "amax_history_len", None),
                "time": time.time(),
                "files": _file_table(tmp),
                **(extra or {}),
            }
            _write_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
            if os.path.exists(final):
                # Same step saved again (e.g. after a restart): swap, never leave no copy.
                old = os.path.join(self.root, f".old-{name}")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _write_atomic(os.path.join(self.root, LATEST), name + "\n")
            for path in self.complete_checkpoints()[: -self.keep]:
                shutil.rmtree(path, ignore_errors=True)
        rt.barrier()
        return final

    # ---- load -------------------------------------------------------------------

    def _read_manifest(self, path: str) -> dict[str, Any]:
        mpath = os.path.join(path, MANIFEST)
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path} does not exist")
        if not os.path.isfile(mpath):
            raise CheckpointError(
                f"checkpoint {path} is incomplete or not a tp-fuse checkpoint (no {MANIFEST}); "
                "it may be a save that crashed"
            )
        try:
            with open(mpath) as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {exc}") from exc
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
        return manifest

    def _verify_files(self, path: str, manifest: dict[str, Any]) -> Optional[str]:
        for name, info in manifest.get("files", {}).items():
            fpath = os.path.join(path, name)
            if not os.path.isfile(fpath):
                return f"file {name} is missing"
            size = os.path.getsize(fpath)
            if size != info["size"]:
                return f"file {name} has {size} bytes, the manifest says {info['size']}"
            if self.verify and _sha256(fpath) != info["sha256"]:
                return f"file {name} does not match its SHA-256 in the manifest (corrupt)"
        return None

    def load(self, path: str, state: TrainingState) -> int:
        """Restore ``state`` from the checkpoint at ``path``; returns its step.

        Raises :class:`CheckpointError` for a missing, incomplete, corrupt or
        incompatible checkpoint (the same error on every rank).
        """
        rt = self.rt
        problem: list[Optional[str]] = [None]
        manifest: dict[str, Any] = {}
        if rt.is_rank0:
            try:
                manifest = self._read_manifest(path)
                problem[0] = self._verify_files(path, manifest)
                if problem[0] is not None:
                    problem[0] = f"checkpoint {path} is corrupt: {problem[0]}"
            except CheckpointError as exc:
                problem[0] = str(exc)
        box = [problem[0], manifest]
        if rt.layout.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise CheckpointError(box[0])
        manifest = box[1]
        self._check_compatible(path, manifest, state)

        same_layout = manifest["world_size"] == rt.layout.world_size and manifest["tp"] == rt.layout.tp
        saved_fp8 = manifest.get("fp8_recipe") is not None and state.recipe is not None
        saved_fp8 = saved_fp8 and repr(state.recipe).split("(")[0] == manifest["fp8_recipe"].split("(")[0]
        state_for_load = dataclasses.replace(state, recipe=state.recipe if saved_fp8 else None)
        sd = self._state_dict(
            state_for_load, fp8_rank=rt.rank if same_layout else 0, with_rng=same_layout, for_load=True
        )
        try:
            dcp.load(sd, storage_reader=SafeFileSystemReader(path), process_group=rt.topology.world_group)
        except (Exception, DCPCheckpointException) as exc:  # DCP's is a BaseException; name the checkpoint
            raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from exc
        self._apply(sd, state_for_load, same_layout)
        state.step = int(sd["train/step"])
        state.loader.load_state_dict({"consumed_samples": int(sd["train/consumed_samples"])})
        if not same_layout:
            self._reseed_rng(state)
        return state.step

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

    @torch.no_grad()
    def _apply(self, sd: dict[str, Any], state: TrainingState, same_layout: bool) -> None:
        def local(t: Any) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        opt_state: dict[int, dict[str, torch.Tensor]] = {}
        index = {id(p): i for i, p in enumerate(p for g in state.optimizer.param_groups for p in g["params"])}
        for name, p in state.model.named_parameters():
            copy_dp_shard_(p, local(sd[f"model/{name}"]).reshape(p.shape))
            if id(p) in index:
                opt_state[index[id(p)]] = {
                    "step": sd[f"optim/{name}/step"].clone(),
                    "exp_avg": dp_shard_like(local(sd[f"optim/{name}/exp_avg"]).reshape(p.shape).clone(), p),
                    "exp_avg_sq": dp_shard_like(local(sd[f"optim/{name}/exp_avg_sq"]).reshape(p.shape).clone(), p),
                }
        opt_sd = state.optimizer.state_dict()
        opt_sd["state"] = opt_state
        state.optimizer.load_state_dict(opt_sd)

        rank = self.rt.rank if same_layout else 0
        for qualname, qs in _fp8_quantizers(state).items():
            for role, q in qs.items():
                for field in _QUANTIZER_FIELDS:
                    getattr(q, field).copy_(sd[f"rank{rank}/fp8/{qualname}/{role}/{field}"])
        if same_layout:
            prefix = f"rank{self.rt.rank}/rng/"
            rng = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
            torch.set_rng_state(rng["torch_cpu"])
            if "torch_cuda" in rng:
                torch.cuda.set_rng_state(rng["torch_cuda"], self.rt.device)
            dropout = getattr(state.model, "dropout_rng", None)
            if dropout is not None:
                dropout.load_state_dict({k[len("dropout/"):]: v for k, v in rng.items() if k.startswith("dropout/")})

    def _reseed_rng(self, state: TrainingState) -> None:
        """After a layout change per-rank RNG streams cannot be mapped: start fresh ones."""
        seed = state.seed + 1_000_003 * state.step
        torch.manual_seed(seed + self.rt.rank)
        dropout = getattr(state.model, "dropout_rng", None)
        if dropout is not None:
            fresh = type(dropout)(dropout_seed(seed, self.rt.topology.dp_rank), self.rt.topology.tp_rank,
                                  dropout.device)
            dropout.load_state_dict(fresh.state_dict())
