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

:func:`symm_mem_violations` lists every documented constraint a call's arguments break
(schema, the ops' own ``ValueError``/assert checks in torch's source, and CUDA's
``_scaled_mm`` rules for each chunk's GEMM via
:func:`tp_fuse.kernels.cuda_rules.scaled_mm_violations`). It is the check the CUDA path
runs before calling (:meth:`SymmMemCall.run`) and what the CPU tests feed argument sets
to; with ``TP_FUSE_STRICT_CUDA=1`` it runs on any device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_fuse.comm.userbuffers import symmetric_memory_available

from ..kernels.cuda_rules import scaled_mm_violations
from ..quantization import BlockScaledTensor, Float8Tensor, is_quantized_tensor
from ..strict import STRICT_ENV, CudaConformanceError, strict_cuda_enabled
from .method import Method

__all__ = [
    "OPS",
    "SCHEMA_ARGS",
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
    "symm_mem_violations",
    "symm_op_for",
    "window_call",
]

#: The candidate label of these ops in ``method: auto`` (and in choice files).
SYMM_MEM = Method.SYMM_MEM

AG, AG_SCALED = "fused_all_gather_matmul", "fused_all_gather_scaled_matmul"
RS, RS_SCALED = "fused_matmul_reduce_scatter", "fused_scaled_matmul_reduce_scatter"
OPS = (AG, AG_SCALED, RS, RS_SCALED)

#: Argument names of each op's schema, in order, with whether each has a default (torch
#: 2.13's ``lib.define`` in torch/distributed/_symmetric_memory/__init__.py); a test
#: compares this with the registered schemas.
SCHEMA_ARGS: dict[str, tuple[tuple[str, bool], ...]] = {
    AG: (("A", False), ("Bs", False), ("gather_dim", False), ("group_name", False), ("return_A", True)),
    AG_SCALED: (("A", False), ("Bs", False), ("A_scale", False), ("B_scales", False), ("gather_dim", False),
                ("group_name", False), ("biases", False), ("result_scales", False), ("out_dtypes", False),
                ("use_fast_accum", False)),
    RS: (("A", False), ("B", False), ("reduce_op", False), ("scatter_dim", False), ("group_name", False)),
    RS_SCALED: (("A", False), ("B", False), ("A_scale", False), ("B_scale", False), ("reduce_op", False),
                ("orig_scatter_dim", False), ("scatter_dim_after_maybe_reshape", False), ("group_name", False),
                ("output_shape", False), ("bias", True), ("result_scale", True), ("out_dtype", True),
                ("use_fast_accum", True)),
}


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


def symm_op_for(mode: str, fp8: bool) -> str:
    """The op of a window: ``mode`` ``"all_gather"`` / ``"reduce_scatter"``, scaled when ``fp8``."""
    return {("all_gather", False): AG, ("all_gather", True): AG_SCALED,
            ("reduce_scatter", False): RS, ("reduce_scatter", True): RS_SCALED}[(mode, fp8)]


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


# ---- the rules ----------------------------------------------------------------------------


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _shape(t: Any) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if _is_tensor(t) else type(t).__name__


def _dim_ok(dim: Any, ndim: int) -> bool:
    # The ops reject negative dims ("gather_dim < 0 or gather_dim >= A_shard.dim()").
    return isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < ndim


def _chunk_gemm_rules(what: str, rows: int, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                      b_scale: Any, out_dtype: Any, bias: Any) -> list[str]:
    """CUDA's ``_scaled_mm`` rules for one chunk ``a[:rows] @ b`` as the op computes it (the
    chunks are contiguous ``[rows, K]`` slices; a row-wise scale is sliced with them)."""
    if not _is_tensor(b_scale):
        return [f"{what}: B scale must be a tensor, got {type(b_scale).__name__}"]
    if out_dtype is None:
        return [f"{what}: out_dtype None writes a float8 output (tp_fuse needs bf16/fp16/fp32)"]
    # reshape, like the ops' flatten, is a view of a row-major A and a copy otherwise.
    chunk = a.reshape(-1, a.shape[-1])[:rows]
    scale = a_scale.reshape(-1)[:1] if a_scale.numel() == 1 else a_scale.reshape(-1, 1)[:rows].contiguous()
    return [f"{what}: {msg}" for msg in scaled_mm_violations(chunk, b, scale, b_scale, out_dtype, bias)]


def symm_mem_violations(op: str, args: Mapping[str, Any], *, world_size: int) -> list[str]:
    """Every documented constraint that ``torch.ops.symm_mem.<op>(**args)`` on a group of
    ``world_size`` ranks breaks; an empty list means the op accepts it.

    Checked: the schema (names, required arguments, types), and the conditions in torch
    2.13's implementation: ``A`` at least 2-D, ``B`` 2-D with ``A.shape[-1] == B.shape[0]``,
    ``0 <= gather_dim/scatter_dim < A.dim()``; all-gather: the shard flattened with the
    gather dim first must be contiguous (the pipelined copy asserts it), list arguments of
    equal length, the ``A_scale`` mode (tensor-wise ``numel == 1``, row-wise sharded
    ``A.shape[:-1] + (1,)``, row-wise replicated); reduce-scatter: ``reduce_op`` sum/avg,
    the scatter dim divisible by ``world_size`` (equal chunks), ``output_shape`` given with
    ``prod(output_shape[:-1]) == M`` and ``output_shape[-1] == N``, ``A_scale`` tensor-wise
    or row-wise with ``A_scale.shape[:-1] == A.shape[:-1]``. High precision: ``A`` and
    ``B`` of one floating dtype (``mm``). Scaled: each chunk's GEMM against CUDA's
    ``_scaled_mm`` rules (float8 operands, K and N % 16, ``A`` row-major, ``B``
    column-major, scale kinds, out dtype, bias). All tensors on one device.
    """
    if op not in SCHEMA_ARGS:
        return [f"unknown op {op!r}; expected one of {OPS}"]
    names = [n for n, _ in SCHEMA_ARGS[op]]
    issues = [f"unknown argument {k!r} (schema: {names})" for k in args if k not in names]
    issues += [f"missing required argument {n!r}" for n, has_default in SCHEMA_ARGS[op]
               if not has_default and n not in args]
    if issues:
        return issues
    if not isinstance(world_size, int) or world_size < 1:
        return [f"world_size must be a positive int, got {world_size!r}"]
    gn = args["group_name"]
    if not isinstance(gn, str) or not gn:
        issues.append(f"group_name must be a non-empty str, got {gn!r}")
    A = args["A"]
    if not _is_tensor(A) or A.dim() < 2:
        return issues + [f"A must be a tensor of at least 2 dims, got {_shape(A)}"]
    Bs = args["Bs"] if op in (AG, AG_SCALED) else [args["B"]]
    if not isinstance(Bs, (list, tuple)) or not Bs or not all(_is_tensor(b) for b in Bs):
        return issues + [f"Bs must be a non-empty list of tensors, got {Bs!r}"]
    for i, b in enumerate(Bs):
        if b.dim() != 2:
            issues.append(f"B[{i}] must be a matrix, got {_shape(b)}")
        elif b.shape[0] != A.shape[-1]:
            issues.append(f"B[{i}] {tuple(b.shape)} cannot multiply A {tuple(A.shape)} (K mismatch)")
    if issues:
        return issues
    tensors = [A, *Bs]
    scaled = op in (AG_SCALED, RS_SCALED)
    if op in (AG, RS):
        for i, b in enumerate(Bs):
            if not A.dtype.is_floating_point or b.dtype != A.dtype or A.dtype in _FP8:
                issues.append(f"A {A.dtype} and B[{i}] {b.dtype}: mm needs one high-precision floating dtype "
                              "(FP8 operands go to the scaled op)")
    if op in (AG, AG_SCALED):
        gd = args["gather_dim"]
        if not _dim_ok(gd, A.dim()):
            issues.append(f"gather_dim must be in [0, {A.dim()}), got {gd!r}")
            return issues
        if gd != A.dim() - 1 and not A.movedim(gd, 0).flatten(0, -2).is_contiguous():
            issues.append(f"A {tuple(A.shape)} strides {A.stride()}: with gather_dim {gd} first it must be "
                          "contiguous (the pipelined all-gather asserts contiguous shards)")
        if op == AG and not isinstance(args.get("return_A", True), bool):
            issues.append(f"return_A must be a bool, got {args['return_A']!r}")
    else:
        rop = args["reduce_op"]
        if rop not in ("sum", "avg"):
            issues.append(f"reduce_op must be 'sum' or 'avg', got {rop!r}")
        sd_name = "scatter_dim" if op == RS else "scatter_dim_after_maybe_reshape"
        sd = args[sd_name]
        if not _dim_ok(sd, A.dim()):
            issues.append(f"{sd_name} must be in [0, {A.dim()}), got {sd!r}")
            return issues
        if A.shape[sd] % world_size:
            issues.append(f"A dim {sd} ({A.shape[sd]}) must be divisible by the group size {world_size} "
                          "(equal chunks per rank)")
    if op == AG_SCALED:
        n = len(Bs)
        lists = {k: args[k] for k in ("B_scales", "biases", "result_scales", "out_dtypes", "use_fast_accum")}
        for k, v in lists.items():
            if not isinstance(v, (list, tuple)) or len(v) != n:
                issues.append(f"{k} must be a list of len(Bs) = {n}, got {v!r}")
        if issues:
            return issues
        a_scale = args["A_scale"]
        if not _is_tensor(a_scale):
            return issues + [f"A_scale must be a tensor, got {type(a_scale).__name__}"]
        tensors += [a_scale, *[t for t in (*lists["B_scales"], *lists["biases"]) if _is_tensor(t)]]
        gd = args["gather_dim"]
        full = list(A.shape)
        full[gd] *= world_size
        rows = A.numel() // A.shape[-1]
        if a_scale.dim() >= 1 and a_scale.shape[:-1] == A.shape[:-1] and a_scale.shape[-1] == 1:
            mode = "row-wise sharded"
            if rows % 4:
                # torch's reduce-scatter clones scale slices that are not 16-byte aligned
                # ("cuBLAS's row-wise kernel requires scales to be aligned to 16 bytes");
                # its all-gather slices the gathered scales at rows * 4 bytes per rank.
                issues.append(f"row-wise A_scale: {rows} rows per rank leave the next rank's fp32 scales "
                              "not 16-byte aligned in the gathered scale buffer (need rows % 4 == 0)")
        elif a_scale.numel() == 1:
            mode = "tensor-wise"
        elif a_scale.dim() >= 1 and list(a_scale.shape[:-1]) == full[:-1]:
            mode = "row-wise replicated"
        else:
            return issues + [f"A_scale {tuple(a_scale.shape)} is neither tensor-wise, row-wise sharded "
                             f"{(*A.shape[:-1], 1)} nor row-wise replicated for A {tuple(A.shape)}"]
        for i, b in enumerate(Bs):
            if not isinstance(lists["use_fast_accum"][i], bool):
                issues.append(f"use_fast_accum[{i}] must be a bool")
            if lists["result_scales"][i] is not None and lists["out_dtypes"][i] not in _FP8:
                issues.append(f"result_scales[{i}] applies to float8 outputs only")
            scale = a_scale if mode != "row-wise replicated" else a_scale.reshape(-1, 1)[:rows]
            issues += _chunk_gemm_rules(f"GEMM of B[{i}] ({mode})", rows, A, b, scale,
                                        lists["B_scales"][i], lists["out_dtypes"][i], lists["biases"][i])
    if op == RS_SCALED:
        a_scale, b_scale = args["A_scale"], args["B_scale"]
        if not _is_tensor(a_scale) or not _is_tensor(b_scale):
            return issues + ["A_scale and B_scale must be tensors (the op has no unscaled form)"]
        tensors += [a_scale, b_scale] + ([args["bias"]] if _is_tensor(args.get("bias")) else [])
        if a_scale.numel() > 1 and a_scale.shape[:-1] != A.shape[:-1]:
            issues.append(f"row-wise A_scale {tuple(a_scale.shape)}: its leading dims must match A's "
                          f"{tuple(A.shape[:-1])}")
        shape = args["output_shape"]
        n_out = Bs[0].shape[1]
        if not isinstance(shape, (list, tuple)) or not shape or not all(isinstance(s, int) for s in shape):
            issues.append(f"output_shape must be a list of ints (the CUDA path divides it in place), got {shape!r}")
        else:
            lead = 1
            for s in shape[:-1]:
                lead *= s
            if shape[-1] != n_out or lead != A.numel() // A.shape[-1]:
                issues.append(f"output_shape {list(shape)} does not hold A rows {A.numel() // A.shape[-1]} x N {n_out}")
            osd = args["orig_scatter_dim"]
            if not _dim_ok(osd, len(shape)):
                issues.append(f"orig_scatter_dim must be in [0, {len(shape)}), got {osd!r}")
            elif shape[osd] % world_size:
                issues.append(f"output_shape[{osd}] ({shape[osd]}) must be divisible by the group size {world_size}")
        if args.get("result_scale") is not None and args.get("out_dtype") not in _FP8:
            issues.append("result_scale applies to float8 outputs only")
        if not isinstance(args.get("use_fast_accum", False), bool):
            issues.append("use_fast_accum must be a bool")
        if not issues:
            chunk_rows = (A.numel() // A.shape[-1]) // world_size
            mode = "tensor-wise" if a_scale.numel() == 1 else "row-wise"
            issues += _chunk_gemm_rules(f"chunk GEMM ({mode})", chunk_rows, A, Bs[0], a_scale, b_scale,
                                        args.get("out_dtype"), args.get("bias"))
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        issues.append(f"devices: all tensors must be on one device, got {sorted(map(str, devices))}")
    return issues


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


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
        gathered, y = (out[0], out[1][0]) if self.mode == "all_gather" else (None, out)
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
    if mode not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"window_call: mode must be 'all_gather' or 'reduce_scatter', got {mode!r}")
    rs = mode == "reduce_scatter"
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
