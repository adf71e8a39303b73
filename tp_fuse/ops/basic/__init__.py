"""Basic operations: one op per file."""

from .basic_linear import BasicLinear
from .quantize import Quantize
from .activation import GELU, ReLU, QGELU, SiLU, SReLU
from .gated_activation import SwiGLU, GEGLU, GLU, QGEGLU, ClampedSwiGLU, ReGLU, SiTUGLU, SReGLU
from .add_extra_input import AddExtraInput
from .all_gather import AllGather
from .all_reduce import AllReduce
from .bias import Bias
from .constant_scale import ConstantScale
from .dropout import Dropout
from .grouped_linear import GroupedLinear, is_op_fuser_grouped_tensor_path_supported
from .identity import Identity
from .l2normalization import L2Normalization
from .layer_norm import LayerNorm
from .make_extra_output import MakeExtraOutput
from .reduce_scatter import ReduceScatter
from .reshape import Reshape
from .rmsnorm import RMSNorm
from .scaled_activations import ScaledClampedQGeGLU, ScaledSiTUGLU, ScaledSReLU, ScaledSwiGLU
