"""layers: sharded building blocks made of tp_fuse ops, a GPT model, and ``wrap()``.

Activations are ``[sequence, batch, hidden]`` (Megatron-LM's convention). Every layer
takes an explicit ``tp_group`` (None: no tensor parallelism) and ``sequence_parallel``.
"""

from tp_fuse._floors import floor_path

# This package's modules are in the folder layers/ (a checkout's top level, or beside this file
# installed); the folder has no __init__.py so that it never shadows an installed `layers`.
__path__ = floor_path(__file__, "layers")

from tp_fuse.layers.attention import AttentionSubmodules, DotProductAttention, MultiheadAttention
from tp_fuse.layers.config import GPTConfig
from tp_fuse.layers.cross_entropy import vocab_parallel_cross_entropy
from tp_fuse.layers.embedding import PositionEmbedding, VocabParallelEmbedding
from tp_fuse.layers.gpt import GPT
from tp_fuse.layers.grad_sync import is_sequence_parallel_grad_synced, sync_sequence_parallel_grad
from tp_fuse.layers.layernorm_linear import LayerNormLinear
from tp_fuse.layers.layernorm_mlp import LayerNormMLP
from tp_fuse.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from tp_fuse.layers.random import DropoutRNG, TrackerRNG
from tp_fuse.layers.sharding import (
    ShardSpec,
    full_grads,
    full_state_dict,
    gather_tensor,
    get_shard_spec,
    grad_norm,
    load_full_state_dict,
    shard_tensor,
)
from tp_fuse.layers.tp_regions import CopyToTensorParallelRegion, GatherFromTensorParallelRegion, ScatterToTensorParallelRegion
from tp_fuse.layers.transformer import LayerSubmodules, TransformerLayer
from tp_fuse.layers.wrap.plan_styles import FusedColumn
from tp_fuse.layers.wrap.convert import ParallelLinearAdapter, WrapReport, wrap
from tp_fuse.layers.wrap.export import original_state_dict, save_pretrained

__all__ = [
    "AttentionSubmodules",
    "ColumnParallelLinear",
    "CopyToTensorParallelRegion",
    "DotProductAttention",
    "DropoutRNG",
    "GPT",
    "GPTConfig",
    "GatherFromTensorParallelRegion",
    "LayerNormLinear",
    "LayerNormMLP",
    "LayerSubmodules",
    "MultiheadAttention",
    "ParallelLinearAdapter",
    "FusedColumn",
    "WrapReport",
    "PositionEmbedding",
    "RowParallelLinear",
    "ScatterToTensorParallelRegion",
    "ShardSpec",
    "TrackerRNG",
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
