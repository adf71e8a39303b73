"""Transformer Engine's ``transformer_engine.pytorch.module``: TE's ``torch.nn.Module``
layers, and the userbuffers setup under TE's module path.

The three GEMM modules are constructors over the one block implementation in
``tp_fuse.layers`` (whose forward they run), with TE's constructor arguments, parameter
names and return conventions:

* :class:`Linear` (``te.Linear``): ``layers.ColumnParallelLinear`` / ``RowParallelLinear``;
  parameters ``weight``, ``bias`` (or TE's ``parameters_split`` names),
  ``forward(inp, is_first_microbatch)``, debug ``name``.
* :class:`LayerNormLinear` (``te.LayerNormLinear``): ``layers.LayerNormLinear``; parameters
  ``layer_norm_weight``/``layer_norm_bias``/``weight``/``bias``.
* :class:`LayerNormMLP` (``te.LayerNormMLP``): ``layers.LayerNormMLP``; parameters
  ``layer_norm_*``, ``fc1_weight``/``fc1_bias``/``fc2_weight``/``fc2_bias``; debug names
  ``<name>.fc1`` / ``<name>.fc2``.
* :class:`LayerNorm` / :class:`RMSNorm` (``te.LayerNorm``, ``te.RMSNorm``): one norm op,
  parameters ``weight`` (``bias``).
* :class:`GroupedLinear` (``te.GroupedLinear``): ``ops.GroupedLinear``, parameters
  ``weight{i}`` / ``bias{i}``, ``forward(inp, m_splits)``.
* :class:`Fp8Padding` / :class:`Fp8Unpadding`: pad / unpad a grouped GEMM's row groups to
  the quantization alignment.
* ``tp_fuse.module.base.initialize_ub`` / ``destroy_ub`` / ``UserBufferQuantizationMode``
  (implemented in ``tp_fuse.overlap.userbuffers_setup``).

TE arguments tp_fuse does not implement raise ``ValueError`` naming the argument.
TE's ``MultiheadAttention`` and ``TransformerLayer``, built on these classes, are
``tp_fuse.attention.MultiheadAttention`` and ``tp_fuse.transformer.TransformerLayer``
(``tp_fuse.layers`` has tp_fuse's own transformer layers).
"""

from . import base, fp8_padding, grouped_linear, layernorm, rmsnorm
from .fp8_padding import Fp8Padding, Fp8Unpadding
from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["Fp8Padding", "Fp8Unpadding", "GroupedLinear", "LayerNorm", "LayerNormLinear", "LayerNormMLP",
           "Linear", "RMSNorm", "base", "fp8_padding", "grouped_linear", "layernorm", "rmsnorm"]
