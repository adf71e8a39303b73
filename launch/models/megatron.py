"""``+model=megatron_gpt``: a megatron-core ``GPTModel`` built from the ``model`` fields, wrapped.

The same fields as ``+model=gpt`` (``tp_fuse.layers.GPTConfig``) select megatron-core's
``TransformerConfig`` (GELU or SwiGLU = ``gated_linear_unit``, LayerNorm or RMSNorm,
learned or RoPE positions, grouped-query attention, biases, tied output layer) and its
local layer spec. megatron-core's parallel state is initialized over the world with the
launcher's TP size (TP groups are consecutive ranks in both). ``tp_fuse.layers.wrap`` then swaps
every tensor-parallel linear for tp-fuse's (FP8, overlap), keeping Megatron's
parameters, state_dict keys and ``(output, bias)`` returns.

megatron-core 0.16 allocates with ``torch.cuda.current_device()`` and keeps CUDA RNG
states, so this model needs CUDA; on a CPU-only machine the launcher says so (the test
suite runs :func:`build_megatron_gpt` on CPU with test-only shims).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.layers import GPTConfig, wrap
from tp_fuse.layers.grad_sync import sync_sequence_parallel_grad

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


def _transformer_config(gpt: GPTConfig, tp: int, sequence_parallel: bool, dtype: torch.dtype) -> Any:
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
    )


def build_megatron_gpt(gpt: GPTConfig, *, tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool,
                       dtype: torch.dtype, device: torch.device, seed: int, overlap: Any,
                       layer_spec: Any = None) -> MegatronGPTLoss:
    """megatron-core ``GPTModel`` for ``gpt`` at this TP size, wrapped by ``tp_fuse.layers.wrap``.

    ``layer_spec``: megatron-core's local GPT spec by default.
    """
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
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    model = GPTModel(
        _transformer_config(gpt, tp, sequence_parallel, dtype),
        layer_spec if layer_spec is not None else get_gpt_layer_local_spec(normalization=gpt.normalization),
        vocab_size=gpt.vocab_size, max_sequence_length=gpt.max_seq_len,
        share_embeddings_and_output_weights=gpt.tie_embeddings,
        position_embedding_type="rope" if gpt.position_embedding == "rope" else "learned_absolute",
        rotary_base=int(gpt.rope_theta),
    ).to(device)
    if tp_group is not None:
        # megatron-core's own TP group (the same ranks) is the one its layers check against.
        megatron_tp = parallel_state.get_tensor_model_parallel_group()
        wrap(model, megatron_tp, overlap=overlap)
        # The launcher has no Megatron finalize_model_grads: the parameters Megatron tags
        # `sequence_parallel` (norms, row biases under SP) get their TP all-reduce in backward.
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False):
                sync_sequence_parallel_grad(p, megatron_tp)
    return MegatronGPTLoss(model)
