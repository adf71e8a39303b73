"""PyTorch's symmetric-memory fused ops as ``method: auto`` candidates (label ``symm_mem``).

PyTorch maintains four micro-pipelined communication+GEMM ops in
``torch.distributed._symmetric_memory`` (registered as ``torch.ops.symm_mem.*``; schemas
as in torch 2.13)::

    fused_all_gather_matmul(Tensor A, Tensor[] Bs, int gather_dim, str group_name,
                            *, bool return_A=True) -> (Tensor?, Tensor[])
    fused_all_gather_scaled_matmul(Tensor A, Tensor[] Bs, Tensor A_scale, Tensor[] B_scales,
                            int gather_dim, str group_name, Tensor?[] biases,
                            Tensor?[] result_scales, ScalarType?[] out_dtypes,
                            bool[] use_fast_accum) -> (Tensor, Tensor[])
    fused_matmul_reduce_scatter(Tensor A, Tensor B, str reduce_op, int scatter_dim,
                            str group_name) -> Tensor
    fused_scaled_matmul_reduce_scatter(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale,
                            str reduce_op, int orig_scatter_dim,
                            int scatter_dim_after_maybe_reshape, str group_name,
                            SymInt[]? output_shape, Tensor? bias=None,
                            Tensor? result_scale=None, ScalarType? out_dtype=None,
                            bool use_fast_accum=False) -> Tensor

They have CUDA kernels only (plus Meta fallbacks); they copy the operand shards into the
group's symmetric-memory workspace (``get_symm_mem_workspace``: a rendezvous over the
group) and run the GEMM chunk by chunk while peers read the next chunk. So they exist
for tp_fuse only on CUDA, over an NCCL group (one GPU per rank, as
:class:`~tp_fuse.comm.userbuffers.UserBufferPool` requires for symmetric memory), with
the op registered and given a CUDA kernel: :func:`symm_mem_unavailable` says why not.

How tp_fuse's windows map onto them (``x2d [M, K]`` this rank's rows, ``W [N, K]``):

* AllGather+GEMM (column-parallel fprop): ``y [tp*M, N] = all_gather_0(x2d) @ W^T``:
  ``A = x2d``, ``Bs = [W^T]`` (a ``[K, N]`` column-major view), ``gather_dim = 0``.
* GEMM+ReduceScatter (row-parallel fprop): ``y [M/tp, N] = reduce_scatter_0(x2d @ W^T)``:
  ``A = x2d``, ``B = W^T``, ``scatter_dim = 0``, ``reduce_op = "sum"``.
* FP8: ``A``/``B`` are the float8 data, the scales are dequantization scales
  (``scale_inv``: real = fp8 * scale): tensor-wise (one fp32 element; for the all-gather
  every rank must hold the same one, which the window already guarantees) or row-wise
  (``Float8RowwiseScaling``: ``A_scale [M, 1]`` row-wise *sharded*, travelling with the
  rows; ``B_scale [1, N]``). Block scales (1x128, 128x128, MXFP8, NVFP4) have no form in
  these ops: :func:`fp8_layout_problem` names that, and the candidate is not offered.

:func:`tp_fuse.overlap.symm_mem_rules.symm_mem_violations` lists every documented
constraint a call's arguments break (schema, the ops' own checks, CUDA's ``_scaled_mm``
rules per chunk); :meth:`SymmMemCall.run` runs it before calling, and with
``TP_FUSE_STRICT_CUDA=1`` :func:`check_strict` runs it on any device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.userbuffers import symmetric_memory_available

from ..quantization import BlockScaledTensor, Float8Tensor, is_quantized_tensor
from ..strict import STRICT_ENV, CudaConformanceError, strict_cuda_enabled
from .method import Collective, Method
from .symm_mem_rules import AG, AG_SCALED, OPS, RS, RS_SCALED, symm_mem_violations

__all__ = [
    "SYMM_MEM",
    "SymmMemCall",
    "WindowCall",
    "ag_matmul_call",
    "ag_scaled_matmul_call",
    "fp8_layout_problem",
    "fp8_operands",
    "group_name_of",
    "matmul_rs_call",
    "scaled_matmul_rs_call",
    "symm_mem_unavailable",
    "symm_op_for",
    "window_call",
]

#: The candidate label of these ops in ``method: auto`` (and in choice files).
SYMM_MEM = Method.SYMM_MEM


def _op(name: str) -> Any:
    """``torch.ops.symm_mem.<name>``, or None when it is not registered in this torch."""
    try:
        # Importing the module registers the ops (its torch.library.Library("symm_mem", "DEF")).
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return None
    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return None


def symm_mem_unavailable(op: str, group: Optional[dist.ProcessGroup], device: torch.device,
                         pool: Any = None) -> Optional[str]:
    """Why ``torch.ops.symm_mem.<op>`` cannot run for ``group`` on ``device``, or None.

    Needs: a CUDA device, an initialized NCCL group (symmetric memory maps one GPU per
    rank; gloo groups may share a GPU), ``torch.distributed._symmetric_memory`` with
    ``empty``/``rendezvous`` (:func:`symmetric_memory_available`), the op registered with
    a CUDA kernel, and a pool (``pool``: the window's UserBufferPool) not built with
    ``use_symmetric_memory=False`` (the user chose no symmetric memory).
    """
    if op not in OPS:
        raise ValueError(f"symm_mem_unavailable: unknown op {op!r}; expected one of {OPS}")
    device = torch.device(device)
    if device.type != "cuda":
        return f"torch.ops.symm_mem.{op} has CUDA kernels only (tensors on {device})"
    if not dist.is_available() or not dist.is_initialized():
        return "no initialized process group"
    g = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(g))
    if "nccl" not in backend:
        return f"symmetric memory needs an NCCL group (one GPU per rank), got backend {backend}"
    if not symmetric_memory_available(device):
        return "torch.distributed._symmetric_memory (empty, rendezvous) is not available"
    if pool is not None and getattr(pool, "use_symmetric_memory", "auto") is False:
        return "the overlap's UserBufferPool was built with use_symmetric_memory=False"
    if _op(op) is None:
        return f"torch.ops.symm_mem.{op} is not registered in torch {torch.__version__}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"symm_mem::{op}", "CUDA"):
        return f"torch.ops.symm_mem.{op} has no CUDA kernel in torch {torch.__version__}"
    return None


def fp8_layout_problem(a_fp8: Any, w_fp8: Any) -> Optional[str]:
    """Why the FP8 operands of a window have no form in the scaled symm_mem ops, or None.

    Expressible: per-tensor ``Float8Tensor`` pairs (tensor-wise scales) and
    ``BlockScaledTensor`` pairs of the ``rowwise`` recipe (row-wise scales, 1xK blocks).
    """
    if isinstance(a_fp8, BlockScaledTensor) or isinstance(w_fp8, BlockScaledTensor):
        names = {getattr(t, "recipe_name", type(t).__name__) for t in (a_fp8, w_fp8)}
        if names != {"rowwise"}:
            return (f"{'/'.join(sorted(names))} block scales: the scaled symm_mem ops take tensor-wise or "
                    "row-wise scales only")
        return None
    if isinstance(a_fp8, Float8Tensor) and isinstance(w_fp8, Float8Tensor):
        return None
    return f"operands {type(a_fp8).__name__}/{type(w_fp8).__name__} are not FP8 tensors tp_fuse can map"


def fp8_operands(a_fp8: Any, w_fp8: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A [M, K], B [K, N] column-major, A_scale, B_scale)`` for ``a_fp8 [M, K]``, ``w_fp8 [N, K]``.

    Tensor-wise: the fp32 ``scale_inv`` of each (one element). Row-wise: ``A_scale [M, 1]``,
    ``B_scale [1, N]`` fp32 contiguous (``_scaled_mm``'s row-wise form). Call
    :func:`fp8_layout_problem` first.
    """
    if isinstance(a_fp8, BlockScaledTensor):
        pa, pw = a_fp8.payload("rowwise"), w_fp8.payload("rowwise")
        a_scale = pa.scale_inv.to(torch.float32).reshape(-1, 1).contiguous()
        b_scale = pw.scale_inv.to(torch.float32).reshape(1, -1).contiguous()
        return pa.data, pw.data.t(), a_scale, b_scale
    return (a_fp8._fp8, w_fp8._fp8.t(), a_fp8._sinv.to(torch.float32).reshape(1),
            w_fp8._sinv.to(torch.float32).reshape(1))


@dataclasses.dataclass
class SymmMemCall:
    """One call of ``torch.ops.symm_mem.<op>(**args)`` on a group of ``world_size`` ranks."""

    op: str
    args: dict[str, Any]
    world_size: int

    def violations(self) -> list[str]:
        return symm_mem_violations(self.op, self.args, world_size=self.world_size)

    def run(self) -> Any:
        """Check (always: a broken call is tp_fuse's bug, named here rather than deep in a
        CUDA stream), then call the op."""
        issues = self.violations()
        if issues:
            raise CudaConformanceError(f"torch.ops.symm_mem.{self.op} would reject this call: " + "; ".join(issues))
        fn = _op(self.op)
        if fn is None:
            raise ValueError(f"torch.ops.symm_mem.{self.op} is not registered in torch {torch.__version__}")
        # output_shape is divided in place by the CUDA implementation: give it a fresh list.
        args = {k: (list(v) if k == "output_shape" else v) for k, v in self.args.items()}
        return fn(**args)


def check_strict(call: SymmMemCall) -> None:
    """In strict mode (``TP_FUSE_STRICT_CUDA=1``), raise if the call breaks a rule."""
    if strict_cuda_enabled():
        issues = call.violations()
        if issues:
            raise CudaConformanceError(f"{STRICT_ENV}=1: torch.ops.symm_mem.{call.op} would reject this call: "
                                       + "; ".join(issues))


def symm_op_for(mode: Collective, fp8: bool) -> str:
    """The op of a window: ``mode`` all-gather or reduce-scatter, scaled when ``fp8``."""
    return {(Collective.ALL_GATHER, False): AG, (Collective.ALL_GATHER, True): AG_SCALED,
            (Collective.REDUCE_SCATTER, False): RS, (Collective.REDUCE_SCATTER, True): RS_SCALED}[(mode, fp8)]


# ---- building the calls of tp_fuse's windows ---------------------------------------------


def ag_matmul_call(a: torch.Tensor, b: torch.Tensor, group_name: str, world_size: int,
                   return_a: bool) -> SymmMemCall:
    """``(A_gathered [tp*M, K] or None, [all_gather_0(a) @ b])`` for ``a [M, K]``, ``b [K, N]``."""
    return SymmMemCall(AG, dict(A=a, Bs=[b], gather_dim=0, group_name=group_name, return_A=return_a), world_size)


def ag_scaled_matmul_call(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                          group_name: str, world_size: int, out_dtype: torch.dtype,
                          bias: Optional[torch.Tensor] = None) -> SymmMemCall:
    """``(A_gathered fp8 [tp*M, K], [dequant(all_gather_0(a)) @ dequant(b) (+ bias)])`` in ``out_dtype``.

    ``a [M, K]`` float8 row-major, ``b [K, N]`` float8 column-major, scales as
    :func:`fp8_operands` makes them (a row-wise ``a_scale [M, 1]`` is gathered with the rows).
    """
    return SymmMemCall(AG_SCALED, dict(
        A=a, Bs=[b], A_scale=a_scale, B_scales=[b_scale], gather_dim=0, group_name=group_name,
        biases=[bias], result_scales=[None], out_dtypes=[out_dtype], use_fast_accum=[False]), world_size)


def matmul_rs_call(a: torch.Tensor, b: torch.Tensor, group_name: str, world_size: int) -> SymmMemCall:
    """``reduce_scatter_0(a @ b)`` (sum) ``[M/tp, N]`` for ``a [M, K]``, ``b [K, N]``."""
    return SymmMemCall(RS, dict(A=a, B=b, reduce_op="sum", scatter_dim=0, group_name=group_name), world_size)


def scaled_matmul_rs_call(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                          group_name: str, world_size: int, out_dtype: torch.dtype,
                          bias: Optional[torch.Tensor] = None) -> SymmMemCall:
    """``reduce_scatter_0(dequant(a) @ dequant(b) (+ bias on every rank))`` ``[M/tp, N]`` in
    ``out_dtype`` (partial sums and their reduction in ``out_dtype``)."""
    return SymmMemCall(RS_SCALED, dict(
        A=a, B=b, A_scale=a_scale, B_scale=b_scale, reduce_op="sum", orig_scatter_dim=0,
        scatter_dim_after_maybe_reshape=0, group_name=group_name, output_shape=[a.shape[0], b.shape[-1]],
        bias=bias, result_scale=None, out_dtype=out_dtype, use_fast_accum=False), world_size)


def group_name_of(group: Optional[dist.ProcessGroup]) -> str:
    """The name the ops resolve the group by."""
    g = group if group is not None else dist.group.WORLD
    return g.group_name


# ---- one window's call, with what the op cannot fuse ---------------------------------------


@dataclasses.dataclass
class WindowCall:
    """A window's symm_mem call plus the epilogue the op cannot do, so that the result is
    the window's: ``y = op(...)`` then ``y + bias_after`` in ``out_dtype``.

    ``mode`` ``"all_gather"``: :meth:`run` returns ``(A_gathered or None, y [tp*M, N])``;
    ``"reduce_scatter"``: ``(None, y [M/tp, N])``.
    """

    mode: str
    call: SymmMemCall
    out_dtype: torch.dtype
    bias_after: Optional[torch.Tensor] = None

    def run(self) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        out = self.call.run()
        gathered, y = (out[0], out[1][0]) if self.mode == Collective.ALL_GATHER else (None, out)
        if self.bias_after is not None:
            # In fp32 (as the window's own GEMMs add a bias they cannot fuse), one rounding.
            y = (y.to(torch.float32) + self.bias_after.to(torch.float32)).to(self.out_dtype)
        elif y.dtype != self.out_dtype:
            y = y.to(self.out_dtype)
        return gathered, y


def window_call(mode: str, a: Any, w: Any, *, group_name: str, world_size: int, out_dtype: torch.dtype,
                bias: Optional[torch.Tensor] = None, return_a: bool = False) -> WindowCall:
    """The symm_mem call of a tp_fuse window: ``y = gather(a) @ w^T (+ bias)`` (``mode``
    ``"all_gather"``) or ``y = reduce_scatter(a @ w^T (+ bias on every rank))``
    (``"reduce_scatter"``), for ``a [M, K]``, ``w [N, K]`` both plain (high precision) or both
    FP8 (check :func:`fp8_layout_problem` first).

    Bias and output dtype as the window's unfused GEMMs have them: high precision adds the
    bias after the op (reduce-scatter: ``world_size * bias``, the sum of the per-rank
    biases); tensor-wise FP8 fuses a bias into each chunk's ``_scaled_mm`` for 16-bit
    outputs (in the output dtype, as cuBLASLt does; every rank's chunk adds it, so the
    reduce-scatter sums ``world_size`` of them) and adds it after for fp32; row-wise FP8
    computes in fp32 and adds the bias in fp32 before the cast, as ``block_gemm`` does
    (reduce-scatter: partial sums in ``out_dtype``, ``world_size * bias`` after).
    Equal to the unfused window up to the rounding of where the bias is added.
    """
    if mode not in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        raise ValueError(f"window_call: mode must be 'all_gather' or 'reduce_scatter', got {mode!r}")
    rs = mode == Collective.REDUCE_SCATTER
    scale_after = float(world_size) if rs else 1.0
    if not is_quantized_tensor(a):
        if is_quantized_tensor(w):
            raise ValueError("window_call: a high-precision input with an FP8 weight has no symm_mem form")
        after = None if bias is None else bias * scale_after
        b = w.t()
        call = (matmul_rs_call(a, b, group_name, world_size) if rs
                else ag_matmul_call(a, b, group_name, world_size, return_a))
        return WindowCall(mode, call, out_dtype, after)
    problem = fp8_layout_problem(a, w)
    if problem is not None:
        raise ValueError(f"window_call: {problem}")
    A, B, a_scale, b_scale = fp8_operands(a, w)
    rowwise = a_scale.numel() > 1 or b_scale.numel() > 1
    if rowwise:
        gemm_dtype = torch.float32 if not rs else out_dtype
        fused_bias, after = None, (None if bias is None else bias * scale_after)
    else:
        gemm_dtype = torch.float32 if out_dtype == torch.float64 else out_dtype
        fusable = bias is not None and gemm_dtype in (torch.bfloat16, torch.float16)
        fused_bias = bias.to(gemm_dtype) if fusable else None
        after = None if bias is None or fusable else bias * scale_after
    if rs:
        call = scaled_matmul_rs_call(A, B, a_scale, b_scale, group_name, world_size, gemm_dtype, fused_bias)
    else:
        call = ag_scaled_matmul_call(A, B, a_scale, b_scale, group_name, world_size, gemm_dtype, fused_bias)
    return WindowCall(mode, call, out_dtype, after)
