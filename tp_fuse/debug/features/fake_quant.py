"""``FakeQuant``: emulate an FP8 cast in high precision (quantize, then dequantize)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from nvdlfw_inspect.registry import api_method

from tp_fuse.quantization import scaling
from tp_fuse.quantization.block.cast import quantize_layouts
from tp_fuse.quantization.block.scaling import BlockSpec, ScaleRule
from tp_fuse.quantization.nvfp4.quantizer import NVFP4Quantizer
from tp_fuse.quantization.nvfp4.scaling import rht_matrix
from tp_fuse.recipe import NVFP4BlockScaling
from tp_fuse.debug.features.api import DebugFeature

__all__ = ["FakeQuant"]

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: Per-tensor formats (current scaling with ``margin``).
_FORMATS = {"FP8E4M3": _E4M3, "FP8E5M2": _E5M2}
_POW2 = ScaleRule("fp32", power_2=True)
#: Block formats: (FP8 dtype, block of activations/gradients, block of weights, scale rule).
#: MXFP8E4M3/MXFP8E5M2 are TE's names; the others name our block recipes.
_BLOCK_FORMATS = {
    "MXFP8E4M3": (_E4M3, BlockSpec(1, 32), BlockSpec(1, 32), ScaleRule("e8m0")),
    "MXFP8E5M2": (_E5M2, BlockSpec(1, 32), BlockSpec(1, 32), ScaleRule("e8m0")),
    "FP8E4M3_BLOCKWISE": (_E4M3, BlockSpec(1, 128), BlockSpec(128, 128), _POW2),
    "FP8E5M2_BLOCKWISE": (_E5M2, BlockSpec(1, 128), BlockSpec(128, 128), _POW2),
    "FP8E4M3_ROWWISE": (_E4M3, BlockSpec(1, None), BlockSpec(1, None), _POW2),
    "FP8E5M2_ROWWISE": (_E5M2, BlockSpec(1, None), BlockSpec(1, None), _POW2),
}
#: (GEMM, tensor) pairs whose GEMM contracts over the tensor's first dimension: a block
#: recipe's GEMM reads the column-wise copy (blocks along that dimension) there.
_TRANSPOSED = {("dgrad", "weight"), ("wgrad", "gradient"), ("wgrad", "activation")}
#: NVFP4 (not a Transformer Engine FakeQuant format: TE's FakeQuant has none for FP4).
_NVFP4 = "NVFP4"
#: Debug tensor name -> the quantizer role whose NVFP4BlockScaling settings apply.
_NVFP4_ROLE = {"activation": "input", "weight": "weight", "gradient": "grad_output"}


def fake_quantize_blocks(tensor: torch.Tensor, quant_format: str, gemm: str, tensor_name: str) -> torch.Tensor:
    """Block-format round trip of a GEMM operand ``tensor [..., K]``, in ``tensor.dtype``.

    Quantized as the block recipe's quantizer quantizes the copy ``gemm`` reads: row-wise
    (blocks along the last dim) for fprop and for dgrad's gradient, column-wise (blocks of
    ``tensor.T``) for dgrad's weight and wgrad's operands; weights use 128x128 blocks under
    ``*_BLOCKWISE``. Same code and numerics as ``BlockScalingQuantizer``.
    """
    fp8_dtype, act_spec, weight_spec, rule = _BLOCK_FORMATS[quant_format]
    spec = weight_spec if tensor_name == "weight" else act_spec
    x2d = tensor.detach().reshape(-1, tensor.shape[-1])
    transposed = (gemm, tensor_name) in _TRANSPOSED
    src = x2d.t() if transposed else x2d
    out = quantize_layouts(src, spec, fp8_dtype, rule, columnwise=False).rowwise.dequantize()
    out = out.t() if transposed else out
    return out.to(tensor.dtype).reshape(tensor.shape)


def fake_quantize_nvfp4(tensor: torch.Tensor, gemm: str, tensor_name: str) -> torch.Tensor:
    """NVFP4 round trip of a GEMM operand ``tensor [..., K]``, in ``tensor.dtype``.

    Quantized by ``NVFP4Quantizer.for_role(NVFP4BlockScaling(), role)`` exactly as the
    recipe's GEMM operand: the row-wise copy (1x16 blocks; 16x16 for weights) for fprop and
    for dgrad's gradient, the column-wise copy (blocks of ``x.T``) for dgrad's weight and
    the wgrad operands. Gradients round stochastically (a seed from torch's default
    generator of the tensor's device). Where the recipe applies the random Hadamard
    transform (the wgrad operands' column-wise copies) the dequantized ``Q(x.T H)`` is
    multiplied back by ``H.T`` (float64, rounded once): the wgrad GEMM's product
    ``Q(dy.T H) @ Q(x.T H).T`` then equals the product of the two fake-quantized operands
    in exact arithmetic. The recipe flags come from ``NVTE_NVFP4_DISABLE_*`` as for the recipe.
    """
    quantizer = NVFP4Quantizer.for_role(NVFP4BlockScaling(), _NVFP4_ROLE[tensor_name])
    transposed = (gemm, tensor_name) in _TRANSPOSED
    q = quantizer.quantize(tensor.detach(), transpose=transposed)
    if not transposed:
        out = q._rowwise.dequantize()
    else:
        out = q._columnwise.dequantize()  # [K, rows]: blocks (and the RHT) along the rows
        if quantizer.with_rht:
            m = rht_matrix(out.device)
            out = (out.to(torch.float64).reshape(-1, 16) @ m.t()).reshape(out.shape)
        out = out.t()
    return out.to(tensor.dtype).reshape(tensor.shape)


class FakeQuant(DebugFeature):
    """Replace GEMM inputs by their FP8 round trip.

    Options: ``gemms`` / ``gemms_struct`` (which GEMMs), ``tensors`` /
    ``tensors_struct`` (activation, weight, gradient), ``quant_format`` (required):

    * ``FP8E4M3`` / ``FP8E5M2`` -- per-tensor current scaling, ``margin`` (int >= 0,
      default 0): ``scale = fp8_max / amax(x) / 2**margin``, ``x' = dequant(cast(x * scale))``;
    * ``MXFP8E4M3`` / ``MXFP8E5M2`` (TE's names) -- 1x32 blocks, E8M0 scales
      (``MXFP8BlockScaling``);
    * ``FP8E4M3_BLOCKWISE`` / ``FP8E5M2_BLOCKWISE`` -- ``Float8BlockScaling``'s blocks:
      1x128 for activations and gradients, 128x128 for weights, power-of-two fp32 scales;
    * ``FP8E4M3_ROWWISE`` / ``FP8E5M2_ROWWISE`` -- one power-of-two scale per row
      (``Float8RowwiseScaling``);
    * ``NVFP4`` (our name; TE's FakeQuant has no FP4 format) -- ``NVFP4BlockScaling``'s
      quantizer for the tensor's role: 1x16 blocks (16x16 for weights), E4M3 block scales
      and a per-tensor FP32 scale, stochastic rounding for gradients, the random Hadamard
      transform undone after dequantizing (:func:`fake_quantize_nvfp4`).

    Block formats quantize exactly as the block recipes' quantizers do, with blocks along
    the dimension the GEMM contracts (the copy that recipe's GEMM reads: ``x.T`` for
    wgrad, ``W.T`` for dgrad); Transformer Engine always blocks along the last dimension.
    ``margin`` applies to the per-tensor formats only.

    The covered GEMMs run in high precision on the fake-quantized values (TE
    semantics: ``fp8_gemm_enabled`` is False for them), so a model can be tried at
    FP8 precision without FP8 GEMMs, or with a different format per tensor.
    Gradients pass straight through.
    """

    options = frozenset({"quant_format", "margin"})
    allowed_tensors = frozenset({"activation", "weight", "gradient"})

    def check(self, opts: dict[str, Any], where: str) -> None:
        fmt = opts.get("quant_format")
        known = sorted(_FORMATS) + sorted(_BLOCK_FORMATS) + [_NVFP4]
        if fmt is not None and fmt not in known:
            raise ValueError(f"{where}.quant_format: expected one of {known}, got {fmt!r}")
        margin = opts.get("margin", 0)
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ValueError(f"{where}.margin: expected an int >= 0, got {margin!r}")
        if (fmt in _BLOCK_FORMATS or fmt == _NVFP4) and margin != 0:
            raise ValueError(f"{where}.margin: block format {fmt} takes its scales from each block's amax; "
                             f"margin applies to FP8E4M3/FP8E5M2 only, got margin={margin}")

    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        if "quant_format" not in config:
            raise ValueError(f"FakeQuant on {layer_name}/{gemm}/{tensor_name}: option 'quant_format' is required")
        return True, iteration + 1

    @api_method
    def fp8_gemm_enabled(self, config, layer_name, gemm, iteration):
        return False, None

    @api_method
    @torch.no_grad()
    def modify_tensor(
        self,
        config: dict[str, Any],
        layer_name: str,
        gemm: str,
        tensor_name: str,
        tensor: torch.Tensor,
        default_quantizer: Any,
        iteration: int,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        fmt = config["quant_format"]
        if fmt in _BLOCK_FORMATS:
            return fake_quantize_blocks(tensor, fmt, gemm, tensor_name)
        if fmt == _NVFP4:
            return fake_quantize_nvfp4(tensor, gemm, tensor_name)
        dtype = _FORMATS[fmt]
        fp8_max = float(torch.finfo(dtype).max)
        x = tensor.detach().to(torch.float32)
        scale = scaling.current_scale(x.abs().amax(), fp8_max) / (2.0 ** int(config.get("margin", 0)))
        q = (x * scale).clamp(-fp8_max, fp8_max).to(dtype)
        # Dequantized as a Float8Tensor is (and TE's quantize/dequantize): times 1/scale.
        return (q.to(torch.float32) * torch.reciprocal(scale)).to(tensor.dtype)
