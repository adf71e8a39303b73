"""``+model=megatron_gpt``: a megatron-core ``GPTModel`` built from the ``model`` fields, wrapped.

The same fields as ``+model=gpt`` (``tp_fuse.layers.GPTConfig``) select megatron-core's
``TransformerConfig`` (GELU or SwiGLU = ``gated_linear_unit``, LayerNorm or RMSNorm,
learned or RoPE positions, grouped-query attention, biases, tied output layer) and its
local layer spec. megatron-core's parallel state is initialized over the world with the
launcher's TP size (TP groups are consecutive ranks in both). ``tp_fuse.layers.wrap`` then swaps
every tensor-parallel linear for tp-fuse's (FP8, overlap), keeping Megatron's
parameters, state_dict keys and ``(output, bias)`` returns.

``model.spec=te`` builds megatron-core's Transformer Engine spec
(``get_gpt_layer_with_transformer_engine_spec()``) instead, with ``transformer_engine`` served
by tp_fuse (:func:`tp_fuse.te.te_alias.install`, before megatron-core is first imported): its
layers already are tp_fuse's TE classes (``LayerNormLinear``, ``Linear``,
``DotProductAttention``, ``LayerNorm``/``RMSNorm``), so nothing is wrapped; megatron's own
embedding and output layer stay as they are. Its RNG tracker is TE's
(``use_te_rng_tracker``: tp_fuse's ``CudaRNGStatesTracker``, CPU-capable).

megatron-core 0.16 allocates with ``torch.cuda.current_device()`` (RoPE, sequence-parallel
collectives, the local spec's attention buffer) and the local spec keeps CUDA RNG states, so
the local spec needs CUDA, and on CPU the TE spec runs with learned positions and without
sequence parallelism; the launcher's validation says so (the test suite runs both specs on
CPU further with test-only shims).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.layers import GPTConfig, wrap
from tp_fuse.layers.grad_sync import sync_sequence_parallel_grad
from tp_fuse.layers.sharding import ShardSpec
from tp_fuse.te import te_alias

from ..config import MEGATRON_NEEDS_CUDA

__all__ = ["build_megatron_gpt", "MegatronGPTLoss", "require_cuda"]


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise ValueError(MEGATRON_NEEDS_CUDA)


class MegatronGPTLoss(torch.nn.Module):
    """``model(tokens, labels) -> mean loss`` (labels already shifted, -100 ignored) around
    megatron-core's ``GPTModel(input_ids, position_ids, attention_mask, labels=...)``, which
    returns the per-token loss ``[b, s]`` (its cross-entropy edits the logits in place)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).expand(b, s)
        mask = labels != -100
        per_token = self.model(tokens, positions, None, labels=labels.clamp(min=0))  # [b, s]
        return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def _transformer_config(gpt: GPTConfig, tp: int, sequence_parallel: bool, dtype: torch.dtype,
                        te_spec: bool = False) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    swiglu = gpt.activation == "swiglu"
    return TransformerConfig(
        num_layers=gpt.num_layers, hidden_size=gpt.hidden_size, num_attention_heads=gpt.num_heads,
        num_query_groups=gpt.kv_groups, ffn_hidden_size=gpt.ffn_size, gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else (lambda x: F.gelu(x, approximate="tanh")),
        normalization=gpt.normalization, add_bias_linear=gpt.bias, hidden_dropout=gpt.hidden_dropout,
        attention_dropout=gpt.attention_dropout, layernorm_epsilon=gpt.layernorm_eps, init_method_std=gpt.init_std,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, params_dtype=dtype,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        # The TE spec's dropout draws from TE's tracker (tp_fuse's, CPU-capable).
        use_te_rng_tracker=te_spec,
    )


def _use_transformer_engine_spec() -> Any:
    """megatron-core's TE layer spec with ``transformer_engine`` served by tp_fuse."""
    import sys

    if "megatron.core" in sys.modules and not te_alias.is_installed():
        # megatron-core decides at its import whether TE exists (HAVE_TE): too late to map it.
        raise ValueError("model.spec=te: megatron.core was imported before transformer_engine was mapped to "
                         "tp_fuse; build the TE-spec model in a fresh process")
    te_alias.install()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def _tag_layouts(model: torch.nn.Module) -> None:
    """``tp_shard`` on every parameter of the TE-spec model (the launcher's parameter count,
    grad norm and checkpoints read it), from the Megatron attributes TE's classes and
    megatron's own layers set: what ``wrap`` does for the layers it leaves untouched."""
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            p.tp_shard = ShardSpec(dim=int(p.partition_dim), blocks=int(getattr(p, "partition_stride", 1)))
        else:
            p.tp_shard = None


def build_megatron_gpt(gpt: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool,
                       dtype: torch.dtype, device: torch.device, seed: int, overlap: Any,
                       layer_spec: Any = None, spec: str = "local") -> MegatronGPTLoss:
    """megatron-core ``GPTModel`` for ``gpt`` at this TP size.

    ``spec="local"``: megatron-core's local GPT spec (or ``layer_spec``), wrapped by
    ``tp_fuse.layers.wrap``. ``spec="te"``: its Transformer Engine spec on tp_fuse's TE classes
    (see the module docstring; ``overlap`` must be disabled: TE's userbuffers setup is not
    reached from here).
    """
    te_spec = spec == "te"
    if spec not in ("local", "te"):
        raise ValueError(f"model.spec: expected 'local' or 'te', got {spec!r}")
    if te_spec:
        if layer_spec is not None:
            raise ValueError("build_megatron_gpt: give layer_spec or spec='te', not both")
        if getattr(getattr(overlap, "config", None), "enabled", False):
            raise ValueError("model.spec=te: overlap is not supported (megatron's TE spec sets up userbuffers "
                             "through TE's initialize_ub, which the launcher does not call)")
        layer_spec = _use_transformer_engine_spec()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    if parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"megatron-core's parallel state has TP size "
                         f"{parallel_state.get_tensor_model_parallel_world_size()}, parallel.tp is {tp}")
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_spec)
    torch.manual_seed(seed)
    model = GPTModel(
        _transformer_config(gpt, tp, sequence_parallel, dtype, te_spec),
        layer_spec if layer_spec is not None else get_gpt_layer_local_spec(normalization=gpt.normalization),
        vocab_size=gpt.vocab_size, max_sequence_length=gpt.max_seq_len,
        share_embeddings_and_output_weights=gpt.tie_embeddings,
        position_embedding_type="rope" if gpt.position_embedding == "rope" else "learned_absolute",
        rotary_base=int(gpt.rope_theta),
    ).to(device)
    if te_spec:
        _tag_layouts(model)
    if tp_group is not None:
        # megatron-core's own TP group (the same ranks) is the one its layers check against.
        megatron_tp = parallel_state.get_tensor_model_parallel_group()
        if not te_spec:  # the TE spec's layers already are tp_fuse's
            wrap(model, megatron_tp, overlap=overlap)
        # The launcher has no Megatron finalize_model_grads: the parameters Megatron tags
        # `sequence_parallel` (norms, row biases under SP) get their TP all-reduce in backward.
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False):
                sync_sequence_parallel_grad(p, megatron_tp)
    return MegatronGPTLoss(model)
