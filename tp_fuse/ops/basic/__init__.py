"""Basic operations: one op per file."""

from .basic_linear import BasicLinear
from .quantize import Quantize
from .activation import GELU, ReLU, SwiGLU
from .add_extra_input import AddExtraInput
from .bias import Bias
from .constant_scale import ConstantScale
from .dropout import Dropout
from .identity import Identity
from .layer_norm import LayerNorm
from .make_extra_output import MakeExtraOutput
from .reshape import Reshape
from .rmsnorm import RMSNorm
