"""Transformer Engine's ``Fp8Padding`` / ``Fp8Unpadding`` modules: pad every group of rows of a
grouped GEMM's input to a multiple of the quantization alignment (zero rows appended to each
group), and drop those rows again from its output. TE fuses each into one kernel
(``fused_multi_row_padding``); here they are ``torch`` slicing and concatenation, whose
autograd gives TE's backward (the gradient of the kept rows, zeros for none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F

from tp_fuse.te.fp8 import FP8GlobalStateManager, get_align_size_for_quantization

__all__ = ["Fp8Padding", "Fp8Unpadding"]


class _GroupRows(torch.nn.Module):
    """What padding and unpadding share: ``num_gemms``, the alignment (TE's ``align_size``;
    None: the active recipe's, fixed at the first forward as in TE) and the padded splits."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        cls = type(self).__name__
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms <= 0:
            raise ValueError(f"{cls}: num_gemms must be a positive int, got {num_gemms!r}")
        if align_size is not None and (isinstance(align_size, bool) or not isinstance(align_size, int)
                                       or align_size <= 0):
            raise ValueError(f"{cls}: align_size must be None or a positive int, got {align_size!r}")
        self.num_gemms = num_gemms
        self.align_size = align_size

    def _padded(self, m_splits: Sequence[int]) -> tuple[list[int], list[int]]:
        splits = [int(m) for m in m_splits]
        if len(splits) != self.num_gemms:
            raise ValueError(f"{type(self).__name__}: m_splits has {len(splits)} entries, expected "
                             f"num_gemms={self.num_gemms}")
        if self.align_size is None:
            self.align_size = get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
        a = self.align_size
        return splits, [(m + a - 1) // a * a for m in splits]


class Fp8Padding(_GroupRows):
    """TE's ``Fp8Padding(num_gemms, align_size=None)``: ``forward(inp [sum(m_splits), in],
    m_splits)`` -> ``(out [sum(padded), in], padded_m_splits)``, each group followed by zero
    rows up to the next multiple of ``align_size``; ``inp`` itself when nothing needs padding."""

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        splits, padded = self._padded(m_splits)
        if splits == padded:
            return inp, splits
        rows = inp.reshape(-1, inp.shape[-1]).split(splits)
        return torch.cat([F.pad(r, (0, 0, 0, p - m)) for r, m, p in zip(rows, splits, padded)]), padded


class Fp8Unpadding(_GroupRows):
    """TE's ``Fp8Unpadding(num_gemms, align_size=None)``: ``forward(inp [sum(padded), out],
    m_splits)`` -> ``[sum(m_splits), out]``, the first ``m_splits[i]`` rows of each padded group
    (``Fp8Padding``'s inverse); ``inp`` itself when nothing was padded."""

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        splits, padded = self._padded(m_splits)
        if splits == padded:
            return inp
        groups = inp.reshape(-1, inp.shape[-1]).split(padded)
        return torch.cat([g[:m] for g, m in zip(groups, splits)])
