"""Typed launcher configuration: the Hydra config, converted once and validated once.

``train.py`` composes the Hydra config and hands the plain dict to
:func:`from_dict`, which builds :class:`TrainConfig` (unknown keys and wrong types
raise ``ValueError`` naming the field), and :func:`validate` checks cross-field
constraints against the world size *before* any process group exists (the world
size comes from torchrun's ``WORLD_SIZE``). Everything past this module reads plain
dataclasses; nothing else touches Hydra or OmegaConf.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch

from tp_fuse.layers.config import GPTConfig
from tp_fuse.layers.wrap.convert import PLAN_STYLES
from tp_fuse.layers.wrap.hf_plans import FAMILIES
from tp_fuse.overlap.config import OverlapConfig as TPOverlapConfig
from tp_fuse.safe_yaml import read_yaml_file

from .checkpoint.hf_export import check_export_target
from .models.hf import gpt_fields, is_plan_object, load_plan_object, needs_plan
from .tokenizer import check_tokenizer_choice
from tp_fuse.debug import DebugSession

__all__ = [
    "CONFIG_DIR",
    "SECTIONS",
    "CheckpointConfig",
    "DataConfig",
    "DebugConfig",
    "FP8Config",
    "LoggerConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlapSettings",
    "ParallelConfig",
    "ParallelLayout",
    "TrainConfig",
    "TrainerConfig",
    "from_dict",
    "validate",
]

MEGATRON_NEEDS_CUDA = ("+model=megatron_gpt needs CUDA: megatron-core allocates buffers and RNG states with "
                       "torch.cuda (on CPU use model.spec=te with learned positions and no sequence parallelism, "
                       "or +model=gpt / +model=llama, tp-fuse's own GPT)")
#: ``model.spec`` of ``+model=megatron_gpt``: megatron-core's local layer spec (wrapped by
#: tp_fuse.layers.wrap) or its Transformer Engine spec on tp_fuse's TE classes.
MEGATRON_SPECS = ("local", "te")


@dataclass
class ModelConfig:
    """``model`` group: a preset name plus every :class:`tp_fuse.layers.config.GPTConfig` field."""

    name: str = "gpt"
    gpt: GPTConfig = field(default_factory=GPTConfig)
    #: ``+model=hf``: the local Hugging Face model directory (config.json, tokenizer.json,
    #: optional *.safetensors); ``gpt`` then holds the sizes read from its config.json.
    path: Optional[str] = None
    #: ``+model=hf`` at ``parallel.tp`` > 1: ``wrap(verify=True)`` at start-up -- one
    #: forward and backward of the wrapped model against the original on a [2, 8] token
    #: probe (``tp_fuse.layers.wrap.verify``; costs one full-model gradient per rank, transiently).
    verify: bool = True
    #: ``+model=hf``: the ``wrap`` plan. None: the family plan of config.json's
    #: ``model_type``; a built-in plan's name (``tp_fuse.layers.wrap.hf_plans.FAMILIES``,
    #: e.g. ``llama``); or a ``{module glob: style}`` mapping (styles:
    #: ``tp_fuse.layers.wrap.convert.PLAN_STYLES``), given in a YAML config or, on the command
    #: line, as the path of a ``.yaml`` file holding it (Hydra overrides cannot spell globs);
    #: or ``<module>:<attribute>`` naming such a mapping (whose styles may then also be
    #: ``FusedColumn`` objects) or a ``plan(config) -> mapping`` function in the user's code.
    #: The model's own family checks and fix-ups still apply (``wrap``'s explicit plans).
    plan: Union[None, str, dict[str, str]] = None
    #: ``+model=megatron_gpt``: ``"local"`` (megatron-core's local layer spec, its layers swapped
    #: by ``tp_fuse.layers.wrap``) or ``"te"`` (``get_gpt_layer_with_transformer_engine_spec()``
    #: with ``transformer_engine`` served by tp_fuse: ``tp_fuse.te.te_alias``). On CPU only
    #: ``"te"`` builds, with learned positions and without sequence parallelism (megatron-core's
    #: RoPE and SP collectives allocate on ``torch.cuda.current_device()``).
    spec: str = "local"


@dataclass
class ParallelConfig:
    """``parallel`` group. ``tp="auto"`` uses every rank for TP; DP is the rest."""

    tp: Union[int, Literal["auto"]] = "auto"
    sequence_parallel: bool = False
    # How long a collective waits for a peer before failing (seconds). A rank that fails
    # tears its group down, so peers fail at once; this bounds a peer that hangs.
    timeout_s: float = 600.0
    # Data parallelism = dp_replicate x dp_shard. dp_shard > 1: FSDP2 (fully_shard) shards
    # parameters, gradients and optimizer state over dp_shard ranks; HSDP when both > 1.
    # Defaults: everything replicated (one bucketed all-reduce), as before.
    dp_shard: int = 1
    dp_replicate: Union[int, Literal["auto"]] = "auto"


@dataclass
class OverlapSettings:
    """``overlap`` group: comm/GEMM overlap on TP layers.

    ``config`` is an optional Megatron ``tp_comm_overlap_cfg`` YAML file (per-GEMM
    methods such as ``qkv_fprop: {method: ring_exchange}``).

    ``method``: what GEMM stages the YAML does not name use. ``auto`` (default) measures
    the methods that apply and no overlap at the first step with each shape, the same
    choice on every TP rank (``tp_fuse.overlap.auto``); choices are saved to
    ``<run dir>/overlap_choices.json`` and reused from there on restart/resume.
    ``megatron``: Megatron-LM's fixed defaults.
    """

    enabled: bool = False
    config: Optional[str] = None
    method: Literal["auto", "megatron"] = "auto"


@dataclass
class FP8Config:
    """``fp8`` group: recipe and amax-reduction group for FP8 GEMMs.

    ``group`` is the amax reduction group kind (``ParallelTopology.fp8_group``).
    ``stats`` logs FP8 scaling statistics every ``trainer.log_interval`` steps.
    ``gemms``: ``all`` runs every Linear's GEMMs in FP8; ``auto`` only those where FP8 is
    faster at their shape (``tp_fuse.autocast(gemms="auto")``: measured at the first step
    on CUDA, torchao's rule elsewhere; docs/fp8.md); ``device`` (the default) is ``auto``
    on CUDA -- FP8 exists to be faster there, and a GEMM too small to win stays in
    bf16 -- and ``all`` elsewhere: a CPU has no FP8 hardware, so its FP8 runs are the exact
    emulation for developing and testing numerics, which ``auto`` would turn off
    (:meth:`gemms_on`).
    """

    # blockwise / mxfp8 / rowwise: Float8BlockScaling, MXFP8BlockScaling, Float8RowwiseScaling
    # (per-block or per-row scales from local data: ``group`` and the delayed-scaling
    # fields do not apply; ``power_2_scale`` applies to rowwise).
    # nvfp4: NVFP4BlockScaling (FP4 E2M1, E4M3 scales per 16 values + a per-tensor scale;
    # ``format`` does not apply, the three ``disable_*`` fields are TE's recipe fields).
    recipe: Literal["none", "delayed", "current", "blockwise", "mxfp8", "rowwise", "nvfp4"] = "none"
    format: Literal["HYBRID", "E4M3", "E5M2"] = "HYBRID"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    power_2_scale: bool = False
    group: Literal["tp", "dp", "world"] = "world"
    stats: bool = True
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    gemms: Literal["device", "all", "auto"] = "device"

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def gemms_on(self, device_type: str) -> str:
        """``all`` or ``auto``: :attr:`gemms` with ``device`` resolved for ``device_type``."""
        if self.gemms != "device":
            return self.gemms
        return "auto" if device_type == "cuda" else "all"


@dataclass
class DataConfig:
    """``data`` group.

    ``source``: ``stdlib`` (no download: the Python reference text shipped with the
    standard library in ``pydoc_data.topics``), ``text`` (your UTF-8 files in
    ``paths``), ``bin`` (pre-tokenized ``uint16``/``uint32`` token
    files, nanoGPT/Megatron style). The last ``val_fraction`` of the token stream is
    the validation split.
    """

    source: Literal["stdlib", "text", "bin"] = "stdlib"
    paths: list[str] = field(default_factory=list)
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    # auto | byte | bpe | <path to tokenizer.json> (tp_fuse.launch.tokenizer): auto = byte for
    # model.vocab_size 256, else a BPE of model.vocab_size trained on the corpus.
    tokenizer: str = "auto"
    val_fraction: float = 0.05
    seq_len: Optional[int] = None  # None: model.max_seq_len


@dataclass
class OptimConfig:
    """``optim`` group: AdamW with linear warmup and cosine decay to ``min_lr``."""

    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # torch.optim.AdamW(capturable=True): the step counts live on the GPU and the update
    # reads nothing on the host (needed to capture the optimizer step; CUDA only).
    capturable: bool = False


@dataclass
class LoggerConfig:
    """``logger`` group. ``mode: auto`` is online only when W&B credentials exist."""

    kind: Literal["wandb", "none"] = "wandb"
    project: str = "tp-fuse"
    entity: Optional[str] = None
    name: Optional[str] = None
    mode: Literal["auto", "offline", "online"] = "auto"
    tags: list[str] = field(default_factory=list)
    # Online start-up gives up after this long and the run goes on offline (with a warning).
    init_timeout_s: float = 30.0


@dataclass
class TrainerConfig:
    """``trainer`` group.

    ``global_batch_size`` sequences per optimizer step over all DP ranks;
    ``micro_batch_size`` per DP rank per forward; gradient accumulation makes up the
    rest. Validation uses the first ``val_tokens`` tokens of the validation split (whole
    ``seq_len`` windows, at most the split), the same sequences for every TP/DP layout.
    ``exit_at_step`` stops after that step and saves a checkpoint (e.g. to fit
    a job's time limit; the LR schedule still spans ``max_steps``). ``fail_at_step``
    kills ``fail_rank`` at that step on the first attempt only
    (``TORCHELASTIC_RESTART_COUNT`` 0): a fault-injection switch for restart tests.
    """

    max_steps: int = 300
    log_interval: int = 10
    val_interval: int = 100
    val_tokens: int = 262144
    seed: int = 1234
    global_batch_size: int = 16
    micro_batch_size: int = 8
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    exit_at_step: Optional[int] = None
    fail_at_step: Optional[int] = None
    fail_rank: int = -1
    # Non-finite steps (NaN/inf loss, gradient norm or FP8 amax) in a row that are skipped;
    # one more stops the run with an error (tp_fuse.launch.health).
    max_nonfinite_steps: int = 3
    # Activation recompute: none | selective (core attention) | full (every TransformerLayer).
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = False  # torch.compile every TransformerLayer (fusion groups traced, FP8 casts and GEMMs as custom ops: docs/fsdp.md)
    # torch.compile's mode for trainer.compile=true; reduce-overhead records CUDA graphs on a
    # GPU (the step has no host sync inside the compiled layers; CPU ignores the graphs).
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    # CUDA graphs per TransformerLayer (tp_fuse.make_graphed_callables; FP8 scales updated
    # after backward, outside the graphs), static gradient buffers (zero_grad keeps them)
    # and static layer inputs. GPU only: refused at the config check elsewhere.
    cuda_graphs: bool = False
    # The peak FLOP/s of one rank that MFU divides by: null = the data sheet of known GPUs or,
    # on CPU, a measurement cached per machine; "remeasure" = measure the CPU peak again.
    peak_flops: Union[float, Literal["remeasure"], None] = None


@dataclass
class CheckpointConfig:
    """``checkpoint`` group.

    ``dir`` None: ``<run dir>/checkpoints``. ``interval`` 0: no periodic saves (a final
    one is still written when ``save_final``). ``resume``: ``true`` = must resume
    (error if none), ``auto`` = resume if one exists, ``false`` = start fresh (an
    elastic restart resumes its own run's newest checkpoint). A fresh start in a
    directory holding checkpoints is refused unless ``overwrite`` (``tp_fuse.launch.checkpoint.run_identity``).
    """

    dir: Optional[str] = None
    interval: int = 0
    resume: Union[bool, Literal["auto"]] = False
    keep: int = 2
    save_final: bool = False
    verify: bool = True
    overwrite: bool = False  # resume=false over another run's checkpoints: delete them (else an error)
    #: ``+model=hf``: at the end of the run (trained to ``trainer.max_steps``, or a resumed
    #: checkpoint already there), write the model as a Hugging Face directory
    #: (``config.json`` + safetensors of the original, unsharded model) at this new path.
    export_hf: Optional[str] = None


@dataclass
class DebugConfig:
    """``debug`` group: YAML of ``tp_fuse.debug`` features (LogTensorStats, ...)."""

    config: Optional[str] = None


@dataclass
class TrainConfig:
    """The whole launcher configuration."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    overlap: OverlapSettings = field(default_factory=OverlapSettings)
    fp8: FP8Config = field(default_factory=FP8Config)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def seq_len(self) -> int:
        return self.data.seq_len if self.data.seq_len is not None else self.model.gpt.max_seq_len

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for W&B's run config and checkpoint manifests)."""
        out = dataclasses.asdict(self)
        gpt = out["model"].pop("gpt")
        out["model"].update(gpt)
        if out["model"].get("path") is None:
            out["model"].pop("path", None)
        if out["model"]["name"] != "hf":
            out["model"].pop("verify", None)
            out["model"].pop("plan", None)
        return out


@dataclass(frozen=True)
class ParallelLayout:
    """Resolved sizes: ``world = tp * dp``."""

    world_size: int
    tp: int
    dp: int
    grad_accum_steps: int
    dp_shard: int = 1  # FSDP2 shard size (1: replicated data parallelism)
    dp_replicate: int = 0  # 0: dp (set by validate)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1


#: The Hydra config directory (``configs/`` at the repository root).
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

#: Config groups besides ``model``, by name, with their dataclass.
SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "overlap": OverlapSettings,
    "fp8": FP8Config,
    "data": DataConfig,
    "optim": OptimConfig,
    "logger": LoggerConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "debug": DebugConfig,
}


# ---- dict -> dataclasses ---------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _string_literals(tp: Any) -> list[str]:
    """The string values a ``Literal`` (possibly inside a ``Union``) allows."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return [a for a in typing.get_args(tp) if isinstance(a, str)]
    if origin in (Union, types.UnionType):
        return [v for a in typing.get_args(tp) for v in _string_literals(a)]
    return []


def _literal_hint(value: Any, tp: Any) -> str:
    """``; did you mean 'delayed'?`` for a string close to one of ``tp``'s literals, else empty."""
    if not isinstance(value, str):
        return ""
    guess = difflib.get_close_matches(value, _string_literals(tp), n=1, cutoff=0.6)
    return f"; did you mean {guess[0]!r}?" if guess else ""


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """``value`` checked (and, for int->float, converted) against annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        # Compare types too: True == 1 must not select a Literal[1].
        if any(type(value) is type(a) and value == a for a in typing.get_args(tp)):
            return value
        raise ValueError(f"{name}: expected one of {_type_name(tp)}, got {value!r}{_literal_hint(value, tp)}")
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, name)
            except ValueError:
                continue
        raise ValueError(f"{name}: expected {_type_name(tp)}, got {value!r}{_literal_hint(value, tp)}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(f"{name}: expected null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name}: expected true/false, got {value!r}")
    if tp is int:
        # bool is an int subclass; `tp=true` is a mistake, not a size of 1.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{name}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {tp!r} for {name}")


def _did_you_mean(prefix: str, name: str, known: list[str]) -> str:
    """``; did you mean <prefix>.<closest known key>?`` (empty when nothing is close)."""
    guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {prefix}.{guess[0]}?" if guess else ""


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{prefix}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)}; "
            f"known keys of {prefix}: {', '.join(known)}" + _did_you_mean(prefix, unknown[0], known)
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from the composed (resolved) Hydra config dict.

    Raises ValueError naming the field for a missing model, unknown keys or bad types.
    """
    data = dict(data)
    data.pop("hydra", None)
    if "model" not in data or data["model"] is None:
        raise ValueError("model: no model selected; add +model=gpt (or gpt-125m, gpt-350m, llama, ...)")
    model = dict(data.pop("model"))
    name = model.pop("name", "gpt")
    if not isinstance(name, str):
        raise ValueError(f"model.name: expected a string, got {name!r}")
    path = model.pop("path", None)
    spec = model.pop("spec", "local")
    if spec != "local" and name != "megatron_gpt":
        raise ValueError(f"model.spec: only +model=megatron_gpt takes a layer spec (model.name is {name!r})")
    if spec not in MEGATRON_SPECS:
        raise ValueError(f"model.spec: expected one of {', '.join(MEGATRON_SPECS)}, got {spec!r}")
    verify = True
    plan = None
    if name == "hf":
        verify = model.pop("verify", True)
        if not isinstance(verify, bool):
            raise ValueError(f"model.verify: expected true or false, got {verify!r}")
        plan = check_plan(model.pop("plan", None))
        extra = sorted(model)
        if extra:
            raise ValueError(f"unknown key(s) {', '.join(f'model.{k}' for k in extra)}: +model=hf takes model.path, "
                             f"model.verify and model.plan (the sizes come from the directory's config.json)")
        gpt = GPTConfig(**gpt_fields(path))
        family = needs_plan(path)
        if family is not None and plan is None:
            raise ValueError(f"model.plan: wrap has no built-in plan for model_type {family!r} ({path}); give one: "
                             f"model.plan=<module>:<attribute> naming a {{module glob: style}} mapping (FusedColumn "
                             f"for fused projections) or a plan(config) function in your Python code, or a .yaml "
                             f"file of {{module glob: style}}")
    else:
        if path is not None:
            raise ValueError(f"model.path: only +model=hf takes a model directory (model.name is {name!r})")
        if model.pop("plan", None) is not None:
            raise ValueError(f"model.plan: only +model=hf takes a wrap plan (model.name is {name!r}; tp-fuse's "
                             f"own models are built sharded)")
        gpt = _build(GPTConfig, model, "model")
    sections = SECTIONS
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(
            f"unknown top-level key(s) {', '.join(unknown)}; known: model, {', '.join(sections)}"
        )
    built = {k: _build(cls, data[k] if data.get(k) is not None else {}, k) for k, cls in sections.items()}
    return TrainConfig(model=ModelConfig(name=name, gpt=gpt, path=path, verify=verify, plan=plan, spec=spec),
                       **built)


def check_plan(plan: Any) -> Union[None, str, dict[str, str]]:
    """``model.plan`` for ``+model=hf``, checked before any process starts: None, the name
    of a built-in plan, or a ``{module glob: style}`` mapping of strings; ValueError
    listing what is available otherwise."""
    if plan is None:
        return None
    if isinstance(plan, str) and plan.endswith((".yaml", ".yml")):
        # Hydra's override grammar cannot spell glob keys ("*", "."), so on the command
        # line a mapping comes as a YAML file: read as plain data, bounded (tp_fuse.safe_yaml).
        try:
            loaded = read_yaml_file(plan, "model.plan: plan file")
        except OSError as e:
            raise ValueError(f"model.plan: cannot read the plan file {plan}: {e.strerror or e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"model.plan: {plan} must hold a YAML mapping {{module glob: style}}, got "
                             f"{type(loaded).__name__}")
        plan = loaded
    if is_plan_object(plan):
        load_plan_object(plan)  # importable, and the attribute a mapping or a callable
        return plan
    if isinstance(plan, str):
        if plan not in FAMILIES:
            raise ValueError(f"model.plan: no built-in wrap plan named {plan!r}; available: {', '.join(sorted(FAMILIES))} "
                             f"(or a .yaml file holding a mapping {{module glob: style}} with styles "
                             f"{', '.join(PLAN_STYLES)}, or <module>:<attribute> naming such a mapping or "
                             f"a plan(config) function in your Python code; "
                             f"leave it unset for config.json's model_type)")
        return plan
    if isinstance(plan, dict) and plan:
        for glob, style in plan.items():
            if not isinstance(glob, str) or not glob:
                raise ValueError(f"model.plan: keys must be module-name globs (non-empty strings), got {glob!r}")
            if style not in PLAN_STYLES:
                raise ValueError(f"model.plan[{glob!r}]: unknown style {style!r}; expected one of "
                                 f"{', '.join(PLAN_STYLES)} (fused projections need the Python API's FusedColumn, "
                                 f"or a built-in plan by name: {', '.join(sorted(FAMILIES))})")
        return dict(plan)
    raise ValueError(f"model.plan: expected the name of a built-in plan ({', '.join(sorted(FAMILIES))}) or a "
                     f"non-empty mapping {{module glob: style}}, got {plan!r}")


# ---- cross-field validation -----------------------------------------------------


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive(name: str, value: int) -> None:
    _need(value > 0, f"{name} must be > 0, got {value}")


def _gpu_missing(device: str) -> Optional[str]:
    """Why ``trainer.device`` gives no GPU here, or None when it does."""
    if device == "cpu":
        return "trainer.device=cpu"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


def _check_cuda_graphs(cfg: TrainConfig, tp: int) -> None:
    """``trainer.cuda_graphs`` and ``optim.capturable``: a GPU, and the features the
    per-layer graphs keep right (each refusal names the field to change)."""
    tr = cfg.trainer
    if cfg.optim.capturable:
        why = _gpu_missing(tr.device)
        _need(why is None, f"optim.capturable=true keeps AdamW's state for CUDA graph capture and needs a GPU "
                           f"({why}); drop optim.capturable")
    if not tr.cuda_graphs:
        return
    why = _gpu_missing(tr.device)
    _need(why is None, f"trainer.cuda_graphs=true records CUDA graphs, which need a GPU ({why}); "
                       f"drop trainer.cuda_graphs")
    gpt = cfg.model.gpt
    refusals = [
        (tr.compile, "trainer.compile=true (torch.compile's own graphs: use trainer.compile_mode instead)"),
        (tr.activation_checkpointing != "none",
         f"trainer.activation_checkpointing={tr.activation_checkpointing} (recompute inside a graph)"),
        (tp > 1, f"parallel.tp={tp} (tensor-parallel collectives inside the layer graphs are not verified yet)"),
        (cfg.parallel.dp_shard > 1, f"parallel.dp_shard={cfg.parallel.dp_shard} (FSDP2 hooks run Python per layer)"),
        (cfg.model.name != "gpt", f"+model={cfg.model.name} (only tp-fuse's GPT layers are graphed)"),
        (gpt.hidden_dropout > 0 or gpt.attention_dropout > 0,
         "model dropout > 0 (tp-fuse's dropout RNG streams are not registered with the graphs)"),
        (cfg.fp8.recipe not in ("none", "delayed", "current"),
         f"fp8={cfg.fp8.recipe} (graphs keep delayed and current scaling static)"),
        (cfg.fp8.recipe != "none" and cfg.fp8.stats, "fp8.stats=true (its observers run Python at every cast, "
                                                      "which a replay skips): add fp8.stats=false"),
        (cfg.fp8.recipe != "none" and cfg.fp8.gemms == "auto", "fp8.gemms=auto (measured in the first forward)"),
        (cfg.debug.config is not None, "debug.config (debug hooks run Python at every cast)"),
    ]
    for refused, what in refusals:
        _need(not refused, f"trainer.cuda_graphs=true does not support {what}")


def validate(cfg: TrainConfig, world_size: int) -> ParallelLayout:
    """Check every cross-field constraint; return the resolved parallel layout.

    Runs before any process group exists. Errors name the field, the expected and
    the actual value.
    """
    _need(world_size >= 1, f"world size must be >= 1, got {world_size}")
    par, gpt, tr = cfg.parallel, cfg.model.gpt, cfg.trainer
    tp = world_size if par.tp == "auto" else par.tp
    _need(tp >= 1, f"parallel.tp must be >= 1 or 'auto', got {tp}")
    _need(world_size % tp == 0, f"parallel.tp ({tp}) must divide the world size ({world_size})")
    dp = world_size // tp
    _need(not (par.sequence_parallel and tp == 1),
          "parallel.sequence_parallel=true needs parallel.tp > 1 (got tp=1): there is no sequence to split")
    if cfg.model.name == "hf":
        # Family plans shard attention and MLP; embeddings and lm_head stay replicated, so
        # the vocabulary need not divide by TP (vocab_size=tp below only skips that check).
        # Every plan gives each rank whole key/value heads (replicating them would break the
        # query-to-KV-head grouping: tp_fuse.layers.wrap.hf_plans._heads_check), so say so in
        # config.json's words here, not after the process group has started.
        _need(gpt.kv_groups % tp == 0,
              f"parallel.tp ({tp}) must divide model.num_query_groups ({gpt.kv_groups}) (num_key_value_heads in "
              f"{cfg.model.path}/config.json): every rank needs whole key/value heads; use a parallel.tp "
              f"that divides {gpt.kv_groups}")
        # alibi: Bloom's ALiBi, built by transformers (tp-fuse's own models refuse it).
        dataclasses.replace(gpt, vocab_size=tp).validate(tp, alibi=True)
    else:
        gpt.validate(tp)  # tp vs heads, query groups, hidden, ffn, vocab -- names the field

    for name in ("max_steps", "log_interval", "global_batch_size", "micro_batch_size"):
        _positive(f"trainer.{name}", getattr(tr, name))
    _need(tr.val_interval >= 0, f"trainer.val_interval must be >= 0 (0 = off), got {tr.val_interval}")
    _need(tr.val_tokens >= 1, f"trainer.val_tokens must be >= 1, got {tr.val_tokens}")
    per_step = tr.micro_batch_size * dp
    _need(tr.global_batch_size % per_step == 0,
          f"trainer.global_batch_size ({tr.global_batch_size}) must be a multiple of "
          f"trainer.micro_batch_size ({tr.micro_batch_size}) * dp ({dp}) = {per_step}")
    _need(-world_size <= tr.fail_rank < world_size,
          f"trainer.fail_rank must be in [-{world_size}, {world_size}), got {tr.fail_rank}")
    # A mode without compiling would be silently ignored: say so instead.
    _need(tr.compile or tr.compile_mode == "default",
          f"trainer.compile_mode={tr.compile_mode} needs trainer.compile=true (it is torch.compile's mode); "
          f"add trainer.compile=true or drop trainer.compile_mode")
    _check_cuda_graphs(cfg, tp)
    if tr.exit_at_step is not None:
        _need(1 <= tr.exit_at_step <= tr.max_steps,
              f"trainer.exit_at_step must be in [1, trainer.max_steps={tr.max_steps}], got {tr.exit_at_step}")
    if tr.fail_at_step is not None:
        _need(1 <= tr.fail_at_step <= tr.max_steps,
              f"trainer.fail_at_step must be in [1, trainer.max_steps={tr.max_steps}], got {tr.fail_at_step}")

    seq = cfg.seq_len
    _need(1 < seq <= gpt.max_seq_len,
          f"data.seq_len ({seq}) must be in [2, model.max_seq_len={gpt.max_seq_len}]")
    _need(0.0 < cfg.data.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.source in ("text", "bin"):
        _need(bool(cfg.data.paths), f"data.paths must list at least one file for data.source={cfg.data.source}")
        _check_data_files(cfg)
    # megatron-core allocates its buffers and RNG states with torch.cuda: say so before start-up.
    if cfg.model.name == "megatron_gpt" and not torch.cuda.is_available():
        _need(cfg.model.spec == "te", MEGATRON_NEEDS_CUDA)
        _need(gpt.position_embedding == "learned", "+model=megatron_gpt model.spec=te on CPU needs "
              "model.position_embedding=learned (megatron-core's RoPE allocates on torch.cuda)")
        _need(not par.sequence_parallel, "+model=megatron_gpt model.spec=te on CPU needs "
              "parallel.sequence_parallel=false (megatron-core's SP collectives allocate on torch.cuda)")
    if cfg.model.name == "hf":  # tokenized with the model directory's tokenizer.json; no SP for [b, s, h] models
        _need(not par.sequence_parallel, "parallel.sequence_parallel=true does not apply to +model=hf "
              "(Hugging Face activations are [batch, seq, hidden])")
    else:
        check_tokenizer_choice(cfg.data.tokenizer, cfg.data.source, gpt.vocab_size)  # vs model.vocab_size
    if par.sequence_parallel:
        _need(seq % tp == 0, f"data.seq_len ({seq}) must be divisible by parallel.tp ({tp}) with sequence parallel")

    _need(math.isfinite(par.timeout_s) and par.timeout_s > 0,
          f"parallel.timeout_s must be a finite number > 0, got {par.timeout_s}")
    _need(tr.max_nonfinite_steps >= 0, f"trainer.max_nonfinite_steps must be >= 0, got {tr.max_nonfinite_steps}")
    if isinstance(tr.peak_flops, float):
        _need(math.isfinite(tr.peak_flops) and tr.peak_flops > 0,
              f"trainer.peak_flops must be a finite number of FLOP/s > 0 (one rank's peak, e.g. 989e12), "
              f"'remeasure' or null, got {tr.peak_flops}")

    opt = cfg.optim
    for name in ("lr", "min_lr", "weight_decay", "eps", "grad_clip", "beta1", "beta2"):
        v = getattr(opt, name)
        _need(math.isfinite(v), f"optim.{name} must be a finite number, got {v}")
    _need(opt.lr > 0, f"optim.lr must be > 0, got {opt.lr}")
    _need(opt.eps > 0, f"optim.eps must be > 0, got {opt.eps}")
    _need(opt.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {opt.weight_decay}")
    _need(0 <= opt.min_lr <= opt.lr, f"optim.min_lr must be in [0, optim.lr={opt.lr}], got {opt.min_lr}")
    _need(opt.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {opt.warmup_steps}")
    _need(opt.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 = off), got {opt.grad_clip}")
    for name in ("beta1", "beta2"):
        v = getattr(opt, name)
        _need(0.0 <= v < 1.0, f"optim.{name} must be in [0, 1), got {v}")

    fp8 = cfg.fp8
    if fp8.enabled:
        _need(fp8.margin >= 0, f"fp8.margin must be >= 0, got {fp8.margin}")
        _need(fp8.amax_history_len >= 1, f"fp8.amax_history_len must be >= 1, got {fp8.amax_history_len}")
        _check_fp8_dims(cfg, tp)
        block = {"blockwise": 128, "mxfp8": 32, "nvfp4": 16}.get(fp8.recipe)
        if block is not None and cfg.overlap.enabled and par.sequence_parallel and tp > 1:
            # The overlapped all-gathers move each rank's rows with their block scales; the
            # wgrad copy has blocks along those rows, so a block must not straddle two ranks.
            local = cfg.trainer.micro_batch_size * seq // tp
            _need(local % block == 0,
                  f"fp8.recipe={fp8.recipe} with overlap and sequence parallel needs the rows per TP rank "
                  f"(trainer.micro_batch_size * data.seq_len / parallel.tp = {local}) to be a multiple of "
                  f"the {block}-row block of the column-wise copy")

    ck = cfg.checkpoint
    _need(ck.interval >= 0, f"checkpoint.interval must be >= 0 (0 = off), got {ck.interval}")
    _need(ck.keep >= 1, f"checkpoint.keep must be >= 1, got {ck.keep}")
    if ck.dir is not None:
        _check_writable_dir("checkpoint.dir", ck.dir)

    dp_shard, dp_replicate = _check_dp_split(par, dp)
    if ck.export_hf is not None:
        _need(cfg.model.name == "hf", f"checkpoint.export_hf writes a Hugging Face directory: it needs +model=hf "
                                      f"(model.name is {cfg.model.name!r})")
        _need(dp_shard == 1, f"checkpoint.export_hf needs parallel.dp_shard=1 (got {dp_shard}): resume the "
                             f"checkpoint with dp_shard=1 to export it (checkpoints reshard on load)")
        check_export_target(ck.export_hf)  # not there, no partial export beside it, creatable

    if cfg.overlap.enabled:
        _need(tp > 1, "overlap=on needs parallel.tp > 1 (got tp=1): there is no TP communication to overlap")
        if cfg.overlap.config is not None:
            _check_overlap_yaml(cfg.overlap.config)
    if cfg.debug.config is not None:
        _check_debug_config(cfg)
    return ParallelLayout(world_size=world_size, tp=tp, dp=dp, grad_accum_steps=tr.global_batch_size // per_step,
                          dp_shard=dp_shard, dp_replicate=dp_replicate)


def _check_dp_split(par: ParallelConfig, dp: int) -> tuple[int, int]:
    """``(dp_shard, dp_replicate)`` with ``dp_shard * dp_replicate == dp`` (the DP size)."""
    _need(par.dp_shard >= 1, f"parallel.dp_shard must be >= 1, got {par.dp_shard}")
    _need(dp % par.dp_shard == 0,
          f"parallel.dp_shard ({par.dp_shard}) must divide the data-parallel size ({dp} = world size / parallel.tp)")
    replicate = dp // par.dp_shard if par.dp_replicate == "auto" else par.dp_replicate
    _need(replicate >= 1, f"parallel.dp_replicate must be >= 1 or 'auto', got {par.dp_replicate}")
    _need(replicate * par.dp_shard == dp,
          f"parallel.dp_replicate ({replicate}) x parallel.dp_shard ({par.dp_shard}) must equal the data-parallel "
          f"size ({dp} = world size / parallel.tp)")
    return par.dp_shard, replicate


def _check_data_files(cfg: TrainConfig) -> None:
    """Every data file exists, is readable and non-empty, and together they hold enough
    tokens for one training and one validation window (checked from file sizes)."""
    data, seq = cfg.data, cfg.seq_len
    itemsize = {"uint16": 2, "uint32": 4}[data.bin_dtype] if data.source == "bin" else 1
    tokens = 0
    for i, path in enumerate(data.paths):
        field_name = f"data.paths[{i}]"
        _need(os.path.exists(path), f"{field_name}: no such file: {path!r}")
        _need(os.path.isfile(path), f"{field_name}: {path!r} is not a file")
        _need(os.access(path, os.R_OK), f"{field_name}: {path!r} is not readable (permissions)")
        size = os.path.getsize(path)
        _need(size > 0, f"{field_name}: {path!r} is empty")
        _need(size % itemsize == 0,
              f"{field_name}: {path!r} has {size} bytes, not a multiple of {itemsize} "
              f"(data.bin_dtype={data.bin_dtype}); wrong dtype?")
        tokens += size // itemsize
    if data.source == "text":
        tokens += 2 * (len(data.paths) - 1)  # files are joined with a blank line
    n_val = max(int(tokens * data.val_fraction), seq + 1)
    _need(tokens - n_val >= 2 * (seq + 1),
          f"data.paths: the corpus has {tokens} tokens; data.seq_len={seq} with data.val_fraction="
          f"{data.val_fraction} needs at least {n_val + 2 * (seq + 1)}")


def _check_writable_dir(name: str, path: str) -> None:
    """``path`` is a writable directory, or can be created as one."""
    path = os.path.abspath(path)
    _need(not os.path.exists(path) or os.path.isdir(path), f"{name}: {path} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    _need(os.path.isdir(parent), f"{name}: {path} cannot be created: {parent} is not a directory")
    _need(os.access(parent, os.W_OK | os.X_OK),
          f"{name}: {path} is not writable ({parent} does not allow writing for this user)")


def _check_overlap_yaml(path: str) -> None:
    """Parse the Megatron overlap YAML now: a bad file fails before any process starts."""
    _need(os.path.exists(path), f"overlap.config: no such file: {path!r}")  # a FIFO: from_yaml names it
    try:
        TPOverlapConfig.from_yaml(path, warn_ignored=False)
    except ValueError as exc:
        raise ValueError(f"overlap.config={path}: {exc}") from None


def _check_debug_config(cfg: TrainConfig) -> None:
    """Parse the debug feature YAML now (every key, feature and option is checked);
    only matching layer names has to wait for the model."""

    try:
        session = DebugSession(cfg.debug.config)
    except ValueError as exc:
        raise ValueError(f"debug.config={cfg.debug.config}: {exc}") from exc
    _need(not ("LogFp8TensorStats" in session.feature_names() and not cfg.fp8.enabled),
          f"debug.config={cfg.debug.config} enables LogFp8TensorStats, which needs FP8: "
          "use fp8=delayed or fp8=current")


def _check_fp8_dims(cfg: TrainConfig, tp: int) -> None:
    """FP8 GEMMs (``torch._scaled_mm`` on CUDA) need every GEMM dimension % 16 == 0.

    Checked on CPU too, so that a config that trains here also runs on a GPU.
    The dimensions are per TP rank: hidden and FFN shards, the QKV output shard, and
    the token count of a micro-batch (the K dimension of the wgrad GEMM).
    """
    gpt = cfg.model.gpt
    head_dim = gpt.head_dim
    qkv = (gpt.num_heads + 2 * gpt.kv_groups) * head_dim
    tokens = cfg.trainer.micro_batch_size * cfg.seq_len
    dims = {
        "model.hidden_size": gpt.hidden_size,
        "model.ffn_hidden_size (effective)": gpt.ffn_size,
        "model.hidden_size / parallel.tp": gpt.hidden_size // tp,
        "model.ffn_hidden_size / parallel.tp": gpt.ffn_size // tp,
        "QKV output size / parallel.tp ((num_heads + 2*num_query_groups) * head_dim / tp)": qkv // tp,
        "trainer.micro_batch_size * data.seq_len (tokens per micro-batch)": tokens,
    }
    if gpt.activation == "swiglu":
        dims["2 * model.ffn_hidden_size / parallel.tp (SwiGLU fc1 output)"] = 2 * gpt.ffn_size // tp
    for name, value in dims.items():
        _need(value % 16 == 0,
              f"fp8.recipe={cfg.fp8.recipe} needs GEMM dimensions divisible by 16: {name} = {value}")
