"""Transformer Engine's ``transformer_engine.pytorch.cpp_extensions.general_gemm`` and
``general_grouped_gemm``, the GEMM entry points TE users and TE's tests call directly, on
tp_fuse's GEMMs.

In TE this is a Python wrapper over its C++ extension; here it runs the same GEMM the
``ops`` layers run (``tp_fuse.quantization.fp8_gemm`` for Float8 operands, ``torch.matmul``
otherwise), so a result computed with it matches a layer's bit for bit. Only what tp_fuse
has is supported: the other arguments raise ValueError naming themselves.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tp_fuse.quantization import fp8_gemm
from tp_fuse.quantization.float8.tensor import Float8Tensor

__all__ = ["general_gemm", "general_grouped_gemm"]

_LAYOUTS = ("TN", "NN", "NT")


def _refuse(arg: str, value: Any, supported: str) -> None:
    raise ValueError(f"general_gemm: {arg}={value!r} is not supported by tp_fuse ({supported})")


def general_gemm(
    A: torch.Tensor,
    B: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
    quantization_params: Any = None,
    gelu: bool = False,
    gelu_in: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    beta: Optional[float] = None,
    accumulate: bool = False,
    layout: str = "TN",
    out: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    use_split_accumulator: bool = False,
    grad: bool = False,
    ub: Any = None,
    ub_type: Any = None,
    extra_output: Optional[torch.Tensor] = None,
    bulk_overlap: bool = False,
) -> tuple[torch.Tensor, None, None, None]:
    """TE's GEMM with cuBLAS's column-major layout letters, in row-major terms:

    * ``"TN"``: ``out = B @ A^T`` (fprop: ``A`` the weight ``[N, K]``, ``B`` the input ``[M, K]``)
    * ``"NN"``: ``out = B @ A``   (dgrad: ``A`` the weight, ``B`` dy)
    * ``"NT"``: ``out = B^T @ A`` (wgrad: ``A`` the input, ``B`` dy)

    ``A``/``B``: both Float8Tensors (FP8 GEMM, FP32 accumulation, as the ops' GEMM; the
    transposed operands are ``transpose_fp8()`` of the same bytes) or plain tensors (a
    Float8Tensor beside a plain tensor is dequantized). ``out_dtype``: default the plain
    operands' dtype, float32 for FP8 ones. ``bias`` is added to every output row (not with
    ``grad=True``: TE's bias-gradient epilogue is not here). ``accumulate=True`` adds the
    product into ``out`` (``beta`` 1 or None) and returns it. ``alpha`` scales the product.
    ``use_split_accumulator`` is TE's FP8 accumulation-precision hint; tp_fuse's FP8 GEMM
    always accumulates in FP32, so either value gives the same result.

    Returns ``(out, None, None, None)``: TE's ``(out, bias_grad, gelu_input, extra_output)``.
    Refused: ``quantization_params`` (an output quantizer), ``gelu``/``gelu_in``, ``ub``/
    ``ub_type``/``extra_output``/``bulk_overlap`` (use the ops' overlap), ``beta`` other than
    1 when accumulating.
    """
    if layout not in _LAYOUTS:
        _refuse("layout", layout, f"one of {_LAYOUTS}")
    if quantization_params is not None:
        _refuse("quantization_params", quantization_params, "None: a high-precision output")
    if gelu or gelu_in is not None:
        _refuse("gelu", gelu, "False")
    if ub is not None or ub_type is not None or extra_output is not None or bulk_overlap:
        _refuse("ub", ub, "None: comm+GEMM overlap lives in tp_fuse.ops")
    if bias is not None and grad:
        _refuse("bias", "<tensor> with grad=True", "a bias added in the forward GEMM (grad=False)")
    if accumulate:
        if out is None:
            _refuse("accumulate", accumulate, "True only with out=")
        if beta not in (None, 1, 1.0):
            _refuse("beta", beta, "None or 1 with accumulate=True")
    elif beta not in (None, 0, 0.0):
        _refuse("beta", beta, "None or 0 without accumulate")
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"general_gemm: {name} must be a 2-D tensor, got "
                             f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
    fp8 = isinstance(A, Float8Tensor) and isinstance(B, Float8Tensor)
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (torch.float32 if fp8 else B.dtype)
    # Row-major operands of out = a @ b^T.
    if fp8:
        if layout == "TN":
            a, b = B, A
        elif layout == "NN":
            a, b = B, A.transpose_fp8()
        else:  # NT
            a, b = B.transpose_fp8(), A.transpose_fp8()
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"general_gemm({layout}): inner dimensions differ: A {tuple(A.shape)}, "
                             f"B {tuple(B.shape)}")
        result = fp8_gemm(a, b, out_dtype, bias=None)
    else:
        a_hp = A.dequantize() if isinstance(A, Float8Tensor) else A
        b_hp = B.dequantize() if isinstance(B, Float8Tensor) else B
        dtype = torch.promote_types(a_hp.dtype, b_hp.dtype)
        a_hp, b_hp = a_hp.to(dtype), b_hp.to(dtype)
        if layout == "TN":
            result = b_hp @ a_hp.t()
        elif layout == "NN":
            result = b_hp @ a_hp
        else:
            result = b_hp.t() @ a_hp
        result = result.to(out_dtype)
    if alpha != 1.0:
        result = result * alpha
    if bias is not None:
        result = result + bias.to(result.dtype)
    if out is not None:
        if tuple(out.shape) != tuple(result.shape):
            raise ValueError(f"general_gemm: out has shape {tuple(out.shape)}, the product {tuple(result.shape)}")
        with torch.no_grad():
            if accumulate:
                out.add_(result.to(out.dtype))
            else:
                out.copy_(result)
        result = out
    return result, None, None, None


def general_grouped_gemm(
    A: list[torch.Tensor],
    B: list[torch.Tensor],
    out: list[torch.Tensor],
    quantization_params: list[Any],
    out_dtype: torch.dtype,
    layout: str = "TN",
    m_splits: Optional[list[int]] = None,
    gelu: bool = False,
    grad: bool = False,
    accumulate: bool = False,
    bias: Optional[list[torch.Tensor]] = None,
    use_bias: bool = False,
    use_split_accumulator: bool = False,
    D_dtype: Any = None,
    single_output: bool = False,
) -> tuple[Any, Optional[list[torch.Tensor]], None]:
    """TE's grouped GEMM: :func:`general_gemm` of ``A[i]``, ``B[i]`` for every group, as TE's
    own loop for the operands its grouped kernel does not take (row-scaled NVFP4, debug), so
    each group's result is the single GEMM's bit for bit. The results go into ``out[i]``, or
    with ``single_output`` into consecutive row blocks of ``out[0]`` (``m_splits[i]`` rows
    each); an empty block runs no GEMM (TE's loop). Every GEMM writes in ``out``'s dtype
    (TE's, whatever ``out_dtype`` says); ``accumulate`` adds into it.

    Returns ``(out, bias, None)``: TE's ``(out, bias or bias gradients, gelu input)``, with
    ``out`` the list or, with ``single_output``, ``out[0]``. Refused (ValueError naming the
    argument): output quantizers, ``gelu``, ``D_dtype``, ``use_bias`` with ``grad`` (TE's
    bias-gradient epilogue is not here)."""
    n = len(A)
    if len(B) != n or (not single_output and len(out) != n):
        raise ValueError(f"general_grouped_gemm: A has {n} tensors, B {len(B)}, out {len(out)} "
                         f"(expected {n} each, or out=[one tensor] with single_output=True)")
    if any(q is not None for q in quantization_params):
        raise ValueError("general_grouped_gemm: quantization_params is not supported by tp_fuse "
                         "([None] * num_gemms: high-precision outputs)")
    for arg, value, ok in (("gelu", gelu, not gelu), ("D_dtype", D_dtype, D_dtype is None),
                           ("use_bias", use_bias, not (use_bias and grad))):
        if not ok:
            raise ValueError(f"general_grouped_gemm: {arg}={value!r} is not supported by tp_fuse")
    if single_output:
        if m_splits is None or len(m_splits) != n or sum(m_splits) != out[0].shape[0]:
            raise ValueError(f"general_grouped_gemm: single_output=True needs m_splits with {n} sizes summing to "
                             f"out[0]'s {out[0].shape[0]} rows, got {m_splits!r}")
        views = list(torch.split(out[0], list(m_splits)))
    else:
        views = list(out)
    for i in range(n):
        if views[i].numel() == 0:
            continue
        general_gemm(A[i], B[i], views[i].dtype, accumulate=accumulate, layout=layout, out=views[i],
                     bias=bias[i] if use_bias else None, use_split_accumulator=use_split_accumulator, grad=grad)
    return (out[0] if single_output else out), (bias if use_bias else None), None
