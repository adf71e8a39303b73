"""Typed launcher configuration: one dataclass per Hydra config group.

``train.py`` composes the Hydra config and hands the plain dict to
:func:`tp_fuse.launch.config_parse.from_dict`, which builds :class:`TrainConfig` (unknown
keys and wrong types raise ``ValueError`` naming the field), and
:func:`tp_fuse.launch.config_validate.validate` checks cross-field constraints against the
world size *before* any process group exists (the world size comes from torchrun's
``WORLD_SIZE``) and returns the :class:`ParallelLayout`. Everything past those two reads
these plain dataclasses; nothing else touches Hydra or OmegaConf.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from tp_fuse.layers.config import GPTConfig

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
