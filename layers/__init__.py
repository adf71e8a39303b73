"""layers: sharded building blocks made of tp_fuse ops, a GPT model, and ``wrap()``.

Activations are ``[sequence, batch, hidden]`` (Megatron-LM's convention). Every layer
takes an explicit ``tp_group`` (None: no tensor parallelism) and ``sequence_parallel``.
"""

from .attention import DotProductAttention, MultiheadAttention
from .config import GPTConfig
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import PositionEmbedding, VocabParallelEmbedding
from .gpt import GPT
from .grad_sync import is_sequence_parallel_grad_synced, sync_sequence_parallel_grad
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .parallel_linear import ColumnParallelLinear, RowParallelLinear
from .random import DropoutRNG
from .sharding import (
    ShardSpec,
    full_grads,
    full_state_dict,
    gather_tensor,
    get_shard_spec,
    grad_norm,
    load_full_state_dict,
    shard_tensor,
)
from .tp_regions import CopyToTensorParallelRegion, GatherFromTensorParallelRegion, ScatterToTensorParallelRegion
from .transformer import TransformerLayer
from .wrap.plan_styles import FusedColumn
from .wrap.convert import ParallelLinearAdapter, WrapReport, wrap
from .wrap.export import original_state_dict, save_pretrained

__all__ = [
    "ColumnParallelLinear",
    "CopyToTensorParallelRegion",
    "DotProductAttention",
    "DropoutRNG",
    "GPT",
    "GPTConfig",
    "GatherFromTensorParallelRegion",
    "LayerNormLinear",
    "LayerNormMLP",
    "MultiheadAttention",
    "ParallelLinearAdapter",
    "FusedColumn",
    "WrapReport",
    "PositionEmbedding",
    "RowParallelLinear",
    "ScatterToTensorParallelRegion",
    "ShardSpec",
    "TransformerLayer",
    "VocabParallelEmbedding",
    "full_grads",
    "full_state_dict",
    "gather_tensor",
    "get_shard_spec",
    "grad_norm",
    "is_sequence_parallel_grad_synced",
    "load_full_state_dict",
    "original_state_dict",
    "save_pretrained",
    "shard_tensor",
    "sync_sequence_parallel_grad",
    "vocab_parallel_cross_entropy",
    "wrap",
]
