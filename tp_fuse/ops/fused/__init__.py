"""Fused operations, one per file. Importing this package registers their fusions.

Registration order is application order (Transformer Engine's order for the fusions it
shares: forward linear+bias+add, linear+bias+activation, linear+scale+add; backward
linear+add, linear+scale, activation+bias, add+RMSNorm). ``ForwardLinearBiasAdd`` goes before
``ForwardLinearBiasActivation`` so that ``[BasicLinear, Bias, AddExtraInput]``
takes the residual into the GEMM rather than stopping at the bias.
Communication-overlap fusions (``[AllGather, BasicLinear(, Bias)]`` etc.)
must run before these, since after them a ``BasicLinear`` may already be part
of a fused op: register them with ``prepend=True`` or import them first.
"""

from ..fusion import register_backward_fusion, register_forward_fusion
from .backward_activation_bias import BackwardActivationBias, fuse_backward_activation_bias
from .backward_add_rmsnorm import BackwardAddRMSNorm, fuse_backward_add_rmsnorm
from .backward_linear_add import BackwardLinearAdd, fuse_backward_linear_add
from .backward_linear_scale import BackwardLinearScale, fuse_backward_linear_scale
from .forward_linear_bias_activation import (
    ForwardLinearBiasActivation,
    fuse_forward_linear_bias_activation,
)
from .forward_linear_bias_add import ForwardLinearBiasAdd, fuse_forward_linear_bias_add
from .forward_linear_scale_add import ForwardLinearScaleAdd, fuse_forward_linear_scale_add
from .grouped_mlp import fuse_grouped_mlp
from .forward_norm_quantize_linear import ForwardNormQuantizeLinear, fuse_forward_norm_quantize_linear
from .userbuffers_backward_linear import UserbuffersBackwardLinear
from .userbuffers_forward_linear import UserbuffersForwardLinear
from .userbuffers_forward_linear_all_reduce import UserbuffersForwardLinearAllReduce
from .userbuffers_matcher import (
    fuse_userbuffers_backward_linear,
    fuse_userbuffers_forward_linear,
    fuse_userbuffers_forward_linear_all_reduce,
)

register_forward_fusion(fuse_forward_linear_bias_add)
register_forward_fusion(fuse_forward_linear_bias_activation)
register_forward_fusion(fuse_forward_linear_scale_add)
# After the epilogue fusions: the norm's FP8 output feeds a BasicLinear that may already
# be fused with its bias (and activation / residual).
register_forward_fusion(fuse_forward_norm_quantize_linear)
register_backward_fusion(fuse_backward_linear_add)
register_backward_fusion(fuse_backward_linear_scale)
register_backward_fusion(fuse_backward_activation_bias)
register_backward_fusion(fuse_backward_add_rmsnorm)
# Reports only (Transformer Engine's grouped-MLP fusion needs CUDA-only cuDNN kernels).
register_forward_fusion(fuse_grouped_mlp)
register_backward_fusion(fuse_grouped_mlp)
# Communication-overlap fusions go in front of all others (prepend), so that they see the
# BasicLinear before [BasicLinear, Bias] is taken by the epilogue fusions. Each prepend
# goes to the front: the forward order ends up all-gather/reduce-scatter, then all-reduce.
register_forward_fusion(fuse_userbuffers_forward_linear_all_reduce, prepend=True)
register_forward_fusion(fuse_userbuffers_forward_linear, prepend=True)
register_backward_fusion(fuse_userbuffers_backward_linear, prepend=True)

__all__ = [
    "BackwardActivationBias",
    "BackwardAddRMSNorm",
    "BackwardLinearAdd",
    "BackwardLinearScale",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearScaleAdd",
    "ForwardNormQuantizeLinear",
    "UserbuffersBackwardLinear",
    "UserbuffersForwardLinear",
    "UserbuffersForwardLinearAllReduce",
]
