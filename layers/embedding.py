"""Vocab-parallel token embedding and the GPT input embedding (tokens + learned positions)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_fuse.ops import AllReduce, ReduceScatter

from ._common import InitMethod, ParallelContext, full_init
from .grad_sync import sync_sequence_parallel_grad
from .sharding import ShardSpec, divide, normal_init, set_deferred_init, set_shard_spec, shard_tensor

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding whose vocabulary rows are split over the TP ranks.

    Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)`` of the TP=1 table. Each rank looks
    up the tokens it owns (zeros for the others), and the partial embeddings are summed
    over the group: all-reduce, or reduce-scatter along the sequence with sequence
    parallelism (which also leaves each rank its own sequence shard).

    Shapes:
        tokens: ``[s, b]`` int64, values in ``[0, V)``
        weight: ``[V/tp, h]``
        output: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)

    Equations (``m`` = "token is in my rows", ``E_r`` = my rows):
        forward:  y = reduce_q( m_q * E_q[t - start_q] )
        backward: dE_r[t - start_r] += m_r * dy   (dy all-gathered along the sequence under SP)
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, None, seed)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tp_size, self.tp_rank = ctx.tp_size, ctx.tp_rank
        self.sequence_parallel = sequence_parallel
        self.vocab_per_rank = divide(vocab_size, ctx.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        spec = ShardSpec(dim=0)
        full = full_init(ctx, (vocab_size, hidden_size), "weight", init_method or normal_init(0.02))
        shard = shard_tensor(full, spec, ctx.tp_rank, ctx.tp_size).to(device=ctx.device, dtype=dtype)
        self.weight = torch.nn.Parameter(shard)
        set_shard_spec(self.weight, spec)
        set_deferred_init(self.weight, full, spec, ctx.tp_rank, ctx.tp_size)
        self.reduce: Optional[torch.nn.Module] = None
        if ctx.tp_size > 1:
            self.reduce = ReduceScatter(tp_group) if sequence_parallel else AllReduce(tp_group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() != 2:
            raise ValueError(f"VocabParallelEmbedding: expected int tokens [s, b], got {tuple(tokens.shape)} {tokens.dtype}")
        if tokens.numel():
            # Out-of-range ids would silently embed as zeros on every rank: refuse them,
            # without a host read (the step stays capturable; see _check_token_range).
            _check_token_range(tokens, self.vocab_size)
        if self.tp_size == 1:
            return F.embedding(tokens, self.weight)  # [s, b, h]
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.vocab_per_rank)
        local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [s, b, h]
        assert self.reduce is not None
        return self.reduce(partial)

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, tp={self.tp_size}"


def _check_token_range(tokens: torch.Tensor, vocab_size: int) -> None:
    """Refuse ids outside ``[0, vocab_size)`` without reading the device from the host.

    ``torch._assert_async`` checks on the device: on a GPU a bad id fails the step at the
    next synchronization (a device-side assert naming the vocabulary size), inside CUDA
    graphs too; the launcher checks its CPU-side tokens before they are copied
    (``launch/data.py``), where a bad id is a ValueError naming it. On the CPU the assert
    raises at once and is turned into the same ValueError (the failure path may read the
    values: it ends the step anyway).
    """
    lo, hi = torch.aminmax(tokens)
    ok = (lo >= 0) & (hi < vocab_size)
    try:
        torch._assert_async(ok, f"token ids must be in [0, {vocab_size})")
    except RuntimeError:  # raised here on the CPU only
        raise ValueError(f"token ids must be in [0, {vocab_size}), got min {int(lo)} max {int(hi)}") from None


class PositionEmbedding(torch.nn.Module):
    """Learned absolute positions ``P [max_seq_len, h]``, replicated on every TP rank.

    ``forward(x)`` returns ``x + P[positions of x's rows]``. Under sequence parallelism
    ``x`` is rank ``r``'s shard ``[s/tp, b, h]`` of a sequence of length ``s``, so its
    rows are positions ``[r*s/tp, (r+1)*s/tp)``; the gradient of ``P`` is then a partial
    sum over the TP group and is all-reduced in backward.
    """

    def __init__(
        self,
        max_seq_len: int,
        hidden_size: int,
        *,
        tp_group: Optional[dist.ProcessGroup] = None,
        sequence_parallel: bool = False,
        init_method: Optional[InitMethod] = None,
        seed: Optional[int] = 0,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        ctx = ParallelContext(tp_group, sequence_parallel, dtype,
                              torch.device(device) if device is not None else None, None, seed)
        self.max_seq_len = max_seq_len
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.sequence_parallel = sequence_parallel
        full = full_init(ctx, (max_seq_len, hidden_size), "weight", init_method or normal_init(0.02))
        self.weight = torch.nn.Parameter(full.to(device=ctx.device, dtype=dtype))
        set_shard_spec(self.weight, None)
        set_deferred_init(self.weight, full, None, ctx.tp_rank, ctx.tp_size)
        if sequence_parallel:
            sync_sequence_parallel_grad(self.weight, tp_group)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len ({self.max_seq_len})")
        pos = self.weight[:seq_len]  # [s, h]
        if self.sequence_parallel and self.tp_size > 1:
            pos = pos.chunk(self.tp_size, dim=0)[self.tp_rank]  # [s/tp, h]: this rank's rows
        return x + pos.unsqueeze(1)  # [s(/tp), b, h]
