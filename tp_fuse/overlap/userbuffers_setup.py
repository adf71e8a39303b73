"""Transformer Engine's userbuffers setup calls, mapped onto :class:`TPOverlap` objects.

TE users configure communication/GEMM overlap with
``transformer_engine.pytorch.module.base.initialize_ub(shape, tp_size, use_fp8=...,
quantization_modes=..., dtype=..., ub_cfgs=..., bootstrap_backend=...)`` and
``destroy_ub()``; here the same calls (also under ``tp_fuse.module.base``) build one
:class:`TPOverlap` per :class:`UserBufferQuantizationMode` from ``ub_cfgs`` (TE's dict,
which is Megatron-LM's ``tp_comm_overlap_cfg``).

Explicit objects stay the primary API: a ``TPOverlap`` passed to a comm op (``overlap=``,
or handed to it from its ``BasicLinear``'s ``userbuffers_options={"overlap": ...}``) wins.
Only a comm op without one reads the registered objects (``TPCommOperation.window_overlap``) -- the one process-wide state that
TE's call implies (TE keeps a dict of communicators per GEMM name and mode; here one
``TPOverlap`` per mode serves every GEMM name, its pool keeps one workspace per name).
A window running quantized reads the ``FP8`` object, otherwise the ``NONE`` one; a
mode that was not registered is a ValueError, as TE's lookup fails. Fusers re-decide
their fusions after ``initialize_ub``/``destroy_ub`` (:func:`ub_generation` is part of
their fusion key).

What the arguments do here:

* ``shape``: validated ``[rows, hidden]`` and recorded; workspaces are allocated at first
  use, sized by the tensors (TE allocates them now).
* ``tp_size``: must divide the world size (TE's TP domains); a window whose TP group
  has another size is a ValueError.
* ``dtype``, ``bootstrap_backend``: validated and recorded (the overlap ops use the
  window's process group and the tensors' dtype; no bootstrap group is created).
* ``with_cublasmp=True``: refused (no cuBLASMp backend here).
* ``ub_cfgs`` fields: as :class:`~tp_fuse.overlap.config.OverlapConfig`; TE's
  ``is_reduce_scatter`` must agree with the window's collective, and ``method:
  external`` (TE's proj/fc2 wgrad default) maps to the default entry, whose wgrad the
  row-parallel fusion does not consult. TE's checks on the dict are kept: ``pipeline``
  for an all-gather, a wgrad entry beside a non-bulk qkv/fc1 dgrad, ``atomic_gemm``
  without FP8, ``external`` outside proj/fc2 wgrad.

TE raises TypeError/RuntimeError for some of these mistakes; here each is a ValueError
that names what was wrong and what was expected.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .config import GEMM_LAYERS, GEMM_STAGES, OverlapConfig, TPOverlap, megatron_defaults

__all__ = [
    "UserBufferQuantizationMode",
    "destroy_ub",
    "get_ub",
    "initialize_ub",
    "is_ub_initialized",
    "registered_overlap",
    "ub_generation",
    "using_cublasmp_backend",
]


class UserBufferQuantizationMode(enum.Enum):
    """Quantization of the windows a registered ``TPOverlap`` serves (TE's enum)."""

    NONE = "none"
    FP8 = "fp8"


# TE's defaults: which GEMM stages reduce-scatter (the rest all-gather), and the two dgrad
# stages that turn into reduce-scatters when given a non-bulk method.
_REDUCE_SCATTER = frozenset({"proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"})
_DGRAD_RS = ("qkv_dgrad", "fc1_dgrad")
_EXTERNAL = ("proj_wgrad", "fc2_wgrad")
_DEFAULTS = megatron_defaults()


@dataclasses.dataclass(frozen=True)
class UserbuffersState:
    """What ``initialize_ub`` registered (read by the overlap fusions' window lookup)."""

    overlaps: dict[UserBufferQuantizationMode, TPOverlap]
    shape: tuple[int, int]
    tp_size: int
    dtype: torch.dtype
    bootstrap_backend: Optional[str]


# The one process-wide state TE's initialize_ub implies (module docstring).
_state: Optional[UserbuffersState] = None
_generation = 0


def _modes(use_fp8: bool, quantization_modes: Any) -> list[UserBufferQuantizationMode]:
    if not quantization_modes:
        warnings.warn(
            "initialize_ub: use_fp8 is deprecated (as in Transformer Engine); pass "
            "quantization_modes=[UserBufferQuantizationMode.NONE | FP8]",
            DeprecationWarning,
            stacklevel=3,
        )
        return [UserBufferQuantizationMode.FP8 if use_fp8 else UserBufferQuantizationMode.NONE]
    if not isinstance(quantization_modes, list):
        raise ValueError(
            f"initialize_ub: quantization_modes must be a list of UserBufferQuantizationMode, "
            f"got {type(quantization_modes).__name__}"
        )
    bad = [m for m in quantization_modes if not isinstance(m, UserBufferQuantizationMode)]
    if bad:
        raise ValueError(f"initialize_ub: quantization_modes must hold UserBufferQuantizationMode values, got {bad}")
    if len(set(quantization_modes)) != len(quantization_modes):
        raise ValueError(f"initialize_ub: quantization_modes lists a mode twice: {quantization_modes}")
    return list(quantization_modes)


def _translate(cfg: Optional[Mapping[str, Any]], mode: UserBufferQuantizationMode) -> dict[str, dict]:
    """TE's ``ub_cfgs`` dict for one mode -> an ``OverlapConfig.from_dict`` mapping, with TE's checks."""
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise ValueError(f"initialize_ub: ub_cfgs must be a dict (or a list of dicts), got {type(cfg).__name__}")
    out: dict[str, dict] = {}
    for name, raw in cfg.items():
        if not isinstance(raw, Mapping):
            raise ValueError(f"initialize_ub: ub_cfgs[{name!r}] must be a dict of fields, got {raw!r}")
        entry = dict(raw)
        method = entry.get("method")
        if name in _DGRAD_RS and method not in (None, "bulk"):
            wgrad = name.replace("dgrad", "wgrad")
            if wgrad in cfg:
                raise ValueError(
                    f"initialize_ub: ub_cfgs gives {wgrad!r} while {name!r} uses the non-bulk method "
                    f"{method!r}: that dgrad then reduce-scatters dx itself and the wgrad overlap is unused "
                    "(Transformer Engine's rule); drop one of them"
                )
        rs = name in _REDUCE_SCATTER or (name in _DGRAD_RS and method not in (None, "bulk"))
        given_rs = entry.pop("is_reduce_scatter", rs)
        if bool(given_rs) != rs:
            raise ValueError(
                f"initialize_ub: ub_cfgs[{name!r}]['is_reduce_scatter']={given_rs!r}, but this GEMM stage "
                f"{'reduce-scatters' if rs else 'all-gathers'} here (the window's collective decides)"
            )
        if method == "pipeline" and not rs:
            raise ValueError(
                f"initialize_ub: ub_cfgs[{name!r}]: the 'pipeline' method needs a reduce-scatter; "
                "this GEMM stage all-gathers (use 'ring_exchange' or 'bulk')"
            )
        if method == "external":
            if name not in _EXTERNAL:
                raise ValueError(
                    f"initialize_ub: ub_cfgs[{name!r}]: method 'external' is only for {list(_EXTERNAL)}"
                )
            entry["method"] = "bulk"  # the row-parallel wgrad reuses the gathered dy: not consulted
        if entry.get("atomic_gemm") and mode is not UserBufferQuantizationMode.FP8:
            raise ValueError(
                f"initialize_ub: ub_cfgs[{name!r}]: atomic_gemm needs UserBufferQuantizationMode.FP8, "
                f"got {mode}"
            )
        if "method" not in entry and name in _DEFAULTS:  # TE merges the fields into its default
            entry["method"] = _DEFAULTS[name].method
        out[str(name)] = entry
    return out


def _check_shape(shape: Any) -> tuple[int, int]:
    ok = isinstance(shape, (list, tuple)) and len(shape) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape
    )
    if not ok:
        raise ValueError(
            f"initialize_ub: shape must be [sequence_length * batch_size, hidden_size] (two positive "
            f"ints), got {shape!r}"
        )
    return int(shape[0]), int(shape[1])


def initialize_ub(
    shape: list,
    tp_size: int,
    use_fp8: bool = False,
    quantization_modes: Optional[list[UserBufferQuantizationMode]] = None,
    dtype: torch.dtype = torch.bfloat16,
    ub_cfgs: Optional[Union[dict, list[dict]]] = None,
    bootstrap_backend: Optional[Union[str, "dist.Backend"]] = None,
    with_cublasmp: bool = False,
) -> None:
    """Register one ``TPOverlap`` per quantization mode, built from ``ub_cfgs`` (TE's call).

    Args: as Transformer Engine's ``initialize_ub`` (see the module docstring for what
    each does here). ``ub_cfgs`` is one dict for every mode or a list with one per mode.
    """
    global _state, _generation
    rows_hidden = _check_shape(shape)
    modes = _modes(use_fp8, quantization_modes)
    if isinstance(ub_cfgs, Mapping) or ub_cfgs is None:
        cfgs: Sequence[Any] = [ub_cfgs] * len(modes)
    elif isinstance(ub_cfgs, (list, tuple)):
        if len(ub_cfgs) != len(modes):
            raise ValueError(
                f"initialize_ub: {len(ub_cfgs)} ub_cfgs for {len(modes)} quantization_modes; "
                "give one dict per mode, or one dict for all"
            )
        cfgs = ub_cfgs
    else:
        raise ValueError(f"initialize_ub: ub_cfgs must be a dict or a list of dicts, got {type(ub_cfgs).__name__}")
    if with_cublasmp:
        raise ValueError("initialize_ub: with_cublasmp=True: tp_fuse has no cuBLASMp backend (pass False)")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"initialize_ub: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"initialize_ub: tp_size must be a positive int, got {tp_size!r}")
    configs = {
        mode: OverlapConfig.from_dict(_translate(cfg, mode), source=f"initialize_ub ub_cfgs ({mode.name})")
        for mode, cfg in zip(modes, cfgs)
    }
    if _state is not None:
        raise ValueError("initialize_ub: userbuffers are already initialized; call destroy_ub() first")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("initialize_ub: torch.distributed must be initialized first (init_process_group)")
    backend = None if bootstrap_backend is None else str(bootstrap_backend)
    if backend is not None:
        if backend not in ("gloo", "mpi", "nccl"):
            raise ValueError(
                f"initialize_ub: bootstrap_backend must be one of 'gloo', 'mpi', 'nccl', got {backend!r}"
            )
        if not dist.is_backend_available(backend):
            raise ValueError(f"initialize_ub: bootstrap_backend {backend!r} is not available in this torch build")
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"initialize_ub: tp_size={tp_size} does not divide the world size {world}")
    _state = UserbuffersState(
        overlaps={mode: TPOverlap(config) for mode, config in configs.items()},
        shape=rows_hidden, tp_size=tp_size, dtype=dtype, bootstrap_backend=backend,
    )
    _generation += 1


def destroy_ub() -> None:
    """Drop what ``initialize_ub`` registered (its workspaces go with it); fusers re-decide."""
    global _state, _generation
    if _state is not None:
        _state = None
        _generation += 1


def is_ub_initialized() -> bool:
    """Whether ``initialize_ub`` registered overlap objects (TE's name)."""
    return _state is not None


def using_cublasmp_backend() -> bool:
    """Always False: there is no cuBLASMp backend here (TE's name)."""
    return False


def ub_generation() -> int:
    """Changes with every ``initialize_ub``/``destroy_ub``: part of a fuser's fusion key."""
    return _generation


def get_ub(name: str, use_fp8: bool) -> TPOverlap:
    """The registered ``TPOverlap`` serving GEMM stage ``name`` (TE's lookup).

    Raises ValueError when nothing is registered, and KeyError (as TE) for a mode or a
    GEMM stage name that was not registered.
    """
    if _state is None:
        raise ValueError("get_ub: userbuffers are not initialized (call initialize_ub first)")
    mode = UserBufferQuantizationMode.FP8 if use_fp8 else UserBufferQuantizationMode.NONE
    known = {f"{layer}_{stage}" for layer in GEMM_LAYERS for stage in GEMM_STAGES}
    if name not in known or mode not in _state.overlaps:
        raise KeyError(f"UB for {name} with use_fp8={use_fp8} is not registered.")
    return _state.overlaps[mode]


def registered_overlap(quantized: bool, tp_size: int, what: str) -> Optional[TPOverlap]:
    """The registered ``TPOverlap`` for a window without an explicit one (None: nothing
    registered). ``what`` names the window for errors."""
    if _state is None:
        return None
    mode = UserBufferQuantizationMode.FP8 if quantized else UserBufferQuantizationMode.NONE
    if mode not in _state.overlaps:
        raise ValueError(
            f"{what} runs {'quantized' if quantized else 'in high precision'}, but initialize_ub registered "
            f"only {[m.name for m in _state.overlaps]}: add UserBufferQuantizationMode.{mode.name} to "
            "quantization_modes (or pass a TPOverlap to the op)"
        )
    if tp_size != _state.tp_size:
        raise ValueError(
            f"{what}: its tensor-parallel group has {tp_size} ranks, but initialize_ub was called with "
            f"tp_size={_state.tp_size}"
        )
    return _state.overlaps[mode]
