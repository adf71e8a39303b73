"""The documented constraints of PyTorch's symmetric-memory fused ops, checked in Python.

:func:`symm_mem_violations` lists every constraint a call's arguments break: the schema
(:data:`SCHEMA_ARGS`), the ops' own ``ValueError``/assert checks in torch's source, and
CUDA's ``_scaled_mm`` rules for each chunk's GEMM via
:func:`tp_fuse.kernels.cuda_rules.scaled_mm_violations`. It is the check the CUDA path runs
before calling (:meth:`tp_fuse.overlap.symm_mem.SymmMemCall.run`) and what the CPU tests
feed argument sets to; with ``TP_FUSE_STRICT_CUDA=1`` it runs on any device. How
tp_fuse's windows map onto the ops is :mod:`tp_fuse.overlap.symm_mem`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.cuda_rules import scaled_mm_violations

__all__ = ["AG", "AG_SCALED", "OPS", "RS", "RS_SCALED", "SCHEMA_ARGS", "symm_mem_violations"]

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

#: The float8 dtypes of this torch (the ops' result scales apply to them only).
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


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
