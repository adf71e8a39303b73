"""What NCCL accepts, checked on CPU: the collective half of ``TP_FUSE_STRICT_CUDA=1``.

gloo (the CPU backend every test runs on) is more permissive than NCCL in a few ways
that only surface on a GPU: it reduces int16 tensors and computes BAND/BOR/BXOR, it has
``monitored_barrier``, and a size mismatch between ranks can go unnoticed. With the
environment variable ``TP_FUSE_STRICT_CUDA=1`` every collective that ``comm`` issues
(and the direct ``dist.all_reduce`` calls of ``tp_fuse``) is checked against the rules
below before it runs, so that such code fails on CPU with a :class:`CudaConformanceError`
naming the rule instead of failing later on a GPU machine.

Rules (from torch 2.x ``ProcessGroupNCCL.cpp``: ``ncclDataType``, ``ncclOp``,
``getNcclReduceOp`` and ``check_gpu_single_tensor``):

* dtypes NCCL moves: int8, uint8, int32, int64, float16, bfloat16, float32, float64,
  bool (as uint8) and the float8 types (as uint8, data movement only); complex only
  where torch views it as real (SUM). Not: int16, uint16/32/64.
* reductions: SUM, PRODUCT, MIN, MAX, AVG (and PREMUL_SUM); not BAND/BOR/BXOR; never on
  float8 data; AVG not on bool.
* every tensor dense and contiguous (NCCL reads ``numel`` elements from ``data_ptr``).
* flat all-gather: ``out.numel() == world_size * in.numel()``; flat reduce-scatter:
  ``in.numel() == world_size * out.numel()``; ``all_to_all_single`` without split sizes:
  dim 0 divisible by the world size; ranks agree on shapes and dtypes (checked across
  ranks by :func:`tp_fuse.comm.check_same_shape`, which ``comm`` turns on in strict mode).
* point-to-point: no rank sends to or receives from itself; every tensor of one batch on
  one device.

The strict flag is read from the environment at each check (no module state), so a
test can turn it on with ``monkeypatch.setenv``; spawned ranks inherit it.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from ..strict import STRICT_ENV, CudaConformanceError, strict_cuda_enabled

__all__ = [
    "NCCL_DTYPES",
    "check_collective",
    "collective_violations",
    "shape_descriptor",
    "describe_shape",
]


_FLOAT8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
#: dtypes ProcessGroupNCCL maps to an NCCL data type (float8 and bool travel as uint8).
NCCL_DTYPES = (
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.bool,
) + _FLOAT8  # fmt: skip
_NCCL_REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM")


def _op_name(op: object) -> str:
    """``"SUM"`` for ``dist.ReduceOp.SUM`` (a RedOpType) or a ``dist.ReduceOp`` instance."""
    if op is None:
        return "SUM"
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BOR", "BXOR", "UNUSED"):
        red = getattr(dist.ReduceOp, name, None)
        if red is not None and (op == red or op is red):
            return name
    return str(op)


def _tensor_violations(what: str, t: torch.Tensor, reduce_op: Optional[str]) -> list[str]:
    out = []
    if t.dtype not in NCCL_DTYPES and not (t.is_complex() and reduce_op in (None, "SUM")):
        out.append(f"{what}: dtype {t.dtype} is not an NCCL data type (NCCL moves {', '.join(map(str, NCCL_DTYPES))})")
    if t.layout != torch.strided or not t.is_contiguous():
        out.append(f"{what}: NCCL needs a dense contiguous tensor, got shape {tuple(t.shape)} strides {t.stride()}")
    if reduce_op is not None:
        if reduce_op not in _NCCL_REDUCE_OPS:
            out.append(f"{what}: reduction {reduce_op} is not supported by NCCL (gloo only); use one of {_NCCL_REDUCE_OPS}")
        if t.dtype in _FLOAT8:
            out.append(f"{what}: NCCL does not reduce float8 data ({t.dtype}); reduce in high precision")
        if t.dtype == torch.bool and reduce_op == "AVG":
            out.append(f"{what}: NCCL cannot AVG bool tensors")
    return out


def collective_violations(
    kind: str,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor] = (),
    *,
    world_size: int = 1,
    op: object = None,
    rank: Optional[int] = None,
    peers: Iterable[int] = (),
) -> list[str]:
    """The NCCL rules a collective call breaks (empty list: NCCL accepts it).

    Args:
        kind: ``"all_reduce"``, ``"all_gather_flat"`` (into one tensor),
            ``"all_gather_list"``, ``"reduce_scatter_flat"``, ``"all_to_all_single"``,
            ``"broadcast"``, ``"p2p"`` (a batch of sends/receives), ``"barrier"`` or
            ``"monitored_barrier"`` (gloo only).
        inputs / outputs: the tensors the backend reads / writes.
        world_size: size of the group.
        op: the reduction (``dist.ReduceOp``) of reducing collectives.
        rank, peers: for ``"p2p"``: this rank's global rank and the global ranks it
            talks to.
    """
    reduce_op = _op_name(op) if kind in ("all_reduce", "reduce_scatter_flat") else None
    issues = []
    if kind == "monitored_barrier":
        issues.append("monitored_barrier is gloo only: NCCL has no equivalent; use barrier()")
    for i, t in enumerate(inputs):
        issues += _tensor_violations(f"{kind} input {i}", t, reduce_op)
    for i, t in enumerate(outputs):
        issues += _tensor_violations(f"{kind} output {i}", t, None)
    if kind == "all_gather_flat" and inputs and outputs:
        if outputs[0].numel() != world_size * inputs[0].numel():
            issues.append(f"all_gather: output has {outputs[0].numel()} elements, NCCL needs world_size "
                          f"({world_size}) x input ({inputs[0].numel()})")
    if kind == "all_gather_list" and inputs and len(outputs) != world_size:
        issues.append(f"all_gather: {len(outputs)} output tensors for a group of {world_size}")
    if kind == "all_gather_list" and inputs:
        issues += [f"all_gather: output {i} has shape {tuple(o.shape)}, input {tuple(inputs[0].shape)}"
                   for i, o in enumerate(outputs) if o.shape != inputs[0].shape or o.dtype != inputs[0].dtype]
    if kind == "reduce_scatter_flat" and inputs and outputs:
        if inputs[0].numel() != world_size * outputs[0].numel():
            issues.append(f"reduce_scatter: input has {inputs[0].numel()} elements, NCCL needs world_size "
                          f"({world_size}) x output ({outputs[0].numel()})")
    if kind == "all_to_all_single" and inputs:
        if inputs[0].dim() == 0 or inputs[0].shape[0] % world_size:
            issues.append(f"all_to_all_single: dim 0 of {tuple(inputs[0].shape)} is not divisible by {world_size}")
        if outputs and outputs[0].numel() != inputs[0].numel():
            issues.append("all_to_all_single: input and output sizes differ")
    if kind == "p2p":
        peers = list(peers)
        if rank is not None and rank in peers:
            issues.append(f"p2p: rank {rank} sends to / receives from itself (NCCL deadlocks or errors)")
        devices = {t.device for t in (*inputs, *outputs)}
        if len(devices) > 1:
            issues.append(f"p2p: one batch spans devices {sorted(map(str, devices))}")
    if inputs and outputs and any(t.device != inputs[0].device for t in (*inputs, *outputs)):
        issues.append(f"{kind}: tensors on different devices")
    return issues


def check_collective(kind: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor] = (),
                     **kwargs) -> None:
    """In strict mode, raise :class:`CudaConformanceError` if NCCL would reject the call.

    Free when strict mode is off (one environment lookup). ``kwargs`` as in
    :func:`collective_violations`.
    """
    if not strict_cuda_enabled():
        return
    issues = collective_violations(kind, inputs, outputs, **kwargs)
    if issues:
        raise CudaConformanceError(f"{STRICT_ENV}=1: NCCL would reject this {kind}: " + "; ".join(issues))


_DESC_DTYPES = NCCL_DTYPES + (torch.int16, torch.complex64, torch.complex128)
_DESC_DIMS = 8


def shape_descriptor(t: torch.Tensor) -> torch.Tensor:
    """``int64 [2 + 8]``: dtype code, ndim, sizes (-1 padded); sent to a peer so that it can
    compare with what it expects (strict mode's cross-rank size check for point-to-point)."""
    desc = torch.full((2 + _DESC_DIMS,), -1, dtype=torch.int64)
    desc[0] = _DESC_DTYPES.index(t.dtype) if t.dtype in _DESC_DTYPES else len(_DESC_DTYPES)
    desc[1] = t.dim()
    if t.dim() <= _DESC_DIMS:
        desc[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return desc.to(t.device)


def describe_shape(desc: torch.Tensor) -> str:
    """``"(4, 8) torch.float32"`` from a :func:`shape_descriptor`."""
    d = desc.cpu().tolist()
    dtype = _DESC_DTYPES[d[0]] if d[0] < len(_DESC_DTYPES) else "other dtype"
    return f"{tuple(d[2 : 2 + d[1]])} {dtype}"
