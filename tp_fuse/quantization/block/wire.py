"""Block-scaled tensors on the wire: FP8 bytes and their scales travel together.

Communication moves one uint8 tensor per collective (``comm`` knows nothing of FP8), split
along dim 0 between ranks. Two packings:

* **row-wise** (:func:`rowwise_wire`): row ``i`` of ``x [M, K]`` becomes ``K`` data bytes
  followed by the bytes of that row's scales (``ceil(K / bc)`` fp32 = 4 bytes each, or
  E8M0 = 1 byte each; one fp32 for row-wise scaling). A ring all-gather + GEMM can cut it
  anywhere between rows: each chunk carries its own scales. This is what the overlapped
  AG+GEMM moves (fprop of column-parallel layers, dgrad of row-parallel ones).
* **column-wise** (:func:`columnwise_wire`): the transposed copy ``x.T [K, M]`` has blocks
  running along ``M`` -- across the rows that the gather concatenates. Its wire has one
  row per group of ``g`` rows of ``x`` (``g`` = the block length, 128 or 32): the
  ``[g, K]`` data bytes of the group, then the group's ``K`` scales. Gathering groups in
  rank order gives the column-wise copy of the gathered tensor exactly when no block
  straddles two ranks (``M_local % g == 0``; checked, ValueError otherwise). Row-wise
  scaling has one scale per column over the *whole* ``M``: the local copies are quantized
  with column amaxes all-reduced over the TP group (see
  :func:`~tp_fuse.quantization.block.quantizer.BlockScalingQuantizer.quantize_gatherable`),
  so the scales are equal on every rank and one group per rank carries them.

The wgrad GEMM reads only the column-wise copy, the fprop/dgrad GEMM only the row-wise one,
so each collective carries one of them.

**NVFP4** packs two values per byte (``K/2`` data bytes per row, ``g/2`` packed rows per
column-wise group), one 1-byte E4M3 scale per 16 values, and appends the 4-byte fp32
per-tensor amax to every wire row, so a chunk stays self-describing. The quantizer makes
that amax equal on all ranks (``NVFP4Quantizer.quantize_gatherable`` all-reduces it);
the receiver checks that it is, ValueError otherwise.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .scaling import BlockSpec
from .tensor import BlockPayload, BlockScaledTensor

__all__ = [
    "rowwise_wire",
    "rowwise_from_wire",
    "columnwise_wire",
    "columnwise_from_wire",
    "wire_bytes_per_element",
    "gather_block_scaled",
]


def _scale_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _amax_bytes(p: BlockPayload, rows: int) -> list[torch.Tensor]:
    """NVFP4: the per-tensor amax as 4 bytes on each of ``rows`` wire rows ([] otherwise)."""
    if p.amax is None:
        return []
    a = p.amax.to(torch.float32).reshape(1).view(torch.uint8)
    return [a.reshape(1, 4).expand(rows, 4)]


def _amax_from(buf_tail: torch.Tensor, p: BlockPayload) -> Optional[torch.Tensor]:
    """The amax carried in the last 4 bytes of every wire row (NVFP4); all rows must agree."""
    if p.amax is None:
        return None
    amax = buf_tail.contiguous().view(torch.float32).reshape(-1)
    if amax.numel() == 0:
        return p.amax.reshape(()).clone()
    if not bool((amax.view(torch.int32) == amax[:1].view(torch.int32)).all()):
        raise ValueError(
            "NVFP4 all-gather: ranks quantized with different per-tensor amaxes; quantize the shard with "
            "NVFP4Quantizer.quantize_gatherable (amax all-reduced over the TP group)"
        )
    return amax[0].clone()


def rowwise_wire(t: BlockScaledTensor) -> torch.Tensor:
    """uint8 ``[M, K (K/2 for FP4) + scale bytes per row (+ 4 amax bytes, NVFP4)]`` of the row-wise payload."""
    p = t.payload("rowwise")
    if p.spec.rows != 1:
        raise ValueError(f"rowwise_wire: {p.spec.describe()} blocks span rows; only 1-D blocks can be cut between rows")
    rows = p.data.shape[0]
    return torch.cat([p.data.contiguous().view(torch.uint8), _scale_bytes(p.scale_inv)] + _amax_bytes(p, rows), dim=1)


def rowwise_from_wire(buf: torch.Tensor, like: BlockScaledTensor) -> BlockScaledTensor:
    """Inverse of :func:`rowwise_wire` for ``buf [M', W]`` (any number of rows), typed like ``like``."""
    p = like.payload("rowwise")
    k = p.data.shape[1]  # bytes of data per row (K/2 for FP4)
    buf = buf.reshape(buf.shape[0], -1)
    end = buf.shape[1] - (4 if p.amax is not None else 0)
    data = buf[:, :k].contiguous().view(p.data.dtype)
    scales = buf[:, k:end].contiguous().view(p.scale_inv.dtype).reshape(buf.shape[0], -1)
    payload = BlockPayload(data, scales, p.spec, _amax_from(buf[:, end:], p), p.e4m3_max)
    return BlockScaledTensor((buf.shape[0], p.shape[1]), like.dtype, payload, None, like.recipe_name)


def _group_rows(p: BlockPayload, local_rows: int) -> int:
    """Rows of ``x`` per column-wise wire row (the column-wise block length along M)."""
    if p.spec.cols is None:
        return max(local_rows, 1)  # row-wise scaling: scales shared by all ranks, one group per rank
    g = p.spec.cols
    if local_rows % g:
        raise ValueError(
            f"block-scaled all-gather: the column-wise copy (read by the wgrad GEMM) has {g}-element "
            f"blocks along the gathered dimension, but this rank has {local_rows} rows, not a multiple "
            f"of {g}: blocks would straddle ranks and differ from quantizing the gathered tensor. "
            f"Choose micro_batch_size * seq_len / tp as a multiple of {g}, or turn overlap off"
        )
    return g


def columnwise_wire(t: BlockScaledTensor) -> torch.Tensor:
    """uint8 ``[M / g, g*K + K*scale_size]`` of the column-wise payload (module docstring)."""
    p = t.payload("columnwise")
    k, m = p.shape
    g = _group_rows(p, m)
    groups = m // g if m else 0
    per = 2 if p.is_fp4 else 1  # values per byte along M
    # data.T [M/per, K] -> [groups, (g/per)*K] bytes; scales [K, groups] -> [groups, K*size] bytes.
    # (Transposed as bytes: torch has no strided copy for float4_e2m1fn_x2.)
    data = p.data.view(torch.uint8).t().contiguous().reshape(groups, (g // per) * k)
    scales = p.scale_inv.t().contiguous()
    return torch.cat([data, _scale_bytes(scales)] + _amax_bytes(p, groups), dim=1)


def columnwise_from_wire(buf: torch.Tensor, like: BlockScaledTensor) -> BlockScaledTensor:
    """The gathered tensor's column-wise copy from a gathered :func:`columnwise_wire`."""
    p = like.payload("columnwise")
    k, m_local = p.shape
    g = _group_rows(p, m_local)
    groups = buf.shape[0]
    per = 2 if p.is_fp4 else 1
    nbytes = (g // per) * k
    end = buf.shape[1] - (4 if p.amax is not None else 0)
    data_t = buf[:, :nbytes].contiguous().reshape(groups * (g // per), k)
    scales = buf[:, nbytes:end].contiguous().view(p.scale_inv.dtype).reshape(groups, k)
    if p.spec.cols is None:
        # Row-wise scaling: every rank sent the same (TP-reduced) per-column scales.
        if not bool((scales == scales[:1]).all()):
            raise ValueError(
                "block-scaled all-gather (rowwise): ranks quantized the column-wise copy with different "
                "column scales; quantize it with column amaxes reduced over the TP group"
            )
        scale_inv = scales[:1].t().contiguous()  # [K, 1]
    else:
        scale_inv = scales.t().contiguous()  # [K, groups]
    col = BlockPayload(data_t.t().contiguous().view(p.data.dtype), scale_inv, p.spec, _amax_from(buf[:, end:], p), p.e4m3_max)
    return BlockScaledTensor((groups * g, k), like.dtype, None, col, like.recipe_name)


def wire_bytes_per_element(t: BlockScaledTensor) -> float:
    """Bytes on the wire per tensor element of the row-wise packing (data + scales)."""
    w = rowwise_wire(t)
    return w.numel() / max(t.numel(), 1)


GatherFn = Callable[[torch.Tensor, Optional[dist.ProcessGroup]], torch.Tensor]


def gather_block_scaled(t: BlockScaledTensor, group: Optional[dist.ProcessGroup], gather: GatherFn) -> BlockScaledTensor:
    """All-gather ``t`` along dim 0 with ``gather``: each existing copy travels with its scales."""
    rows = t.shape[:-1].numel()
    tp = dist.get_world_size(group) if dist.is_initialized() else 1
    k = t.shape[-1]
    row = col = None
    if t._rowwise is not None:
        row = rowwise_from_wire(gather(rowwise_wire(t), group), t)._rowwise
    if t._columnwise is not None:
        col = columnwise_from_wire(gather(columnwise_wire(t), group), t)._columnwise
    shape = (rows * tp, k) if t.dim() == 2 else (t.shape[0] * tp, *t.shape[1:])
    assert math.prod(shape[:-1]) == rows * tp
    return BlockScaledTensor(shape, t.dtype, row, col, t.recipe_name)
