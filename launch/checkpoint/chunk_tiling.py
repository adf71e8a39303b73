"""Every byte of every checkpoint tensor accounted for: DCP chunks must tile their tensor.

DCP's metadata describes each saved tensor as chunks (offsets and sizes per dimension),
and loading reads, for each piece a rank wants, the chunks that overlap it. A piece no
chunk covers is simply never written: the destination keeps whatever memory it held
(issue 40 found values up to 1.5e38, a NaN loss, and the step saved). Two chunks that
overlap make the result depend on read order. So before any tensor is loaded, the chunks
of each tensor must cover it exactly once: no gap, no overlap, nothing out of bounds.

How: the chunk boundaries along each dimension cut the tensor into a grid of cells; every
cell must be covered by exactly one chunk. Everything DCP writes for tp-fuse is a product
of per-dimension splits (one chunk per distinct shard), so the grid has as many cells as
there are chunks and the check costs a sort per dimension. A crafted layout whose grid
has far more cells than chunks is refused before counting them (:data:`MAX_EXTRA_CELLS`),
so a small metadata file cannot make this check slow.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["MAX_EXTRA_CELLS", "tiling_problem"]

#: Cells the grid may have beyond 4 per chunk before the layout is refused as one tp-fuse
#: never writes (its grids have exactly one cell per chunk).
MAX_EXTRA_CELLS = 1 << 16


def _ranges(lo: Sequence[int], hi: Sequence[int]) -> str:
    """``[0:128, 0:64]``: a box of the tensor, as slices."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"


def tiling_problem(size: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Optional[str]:
    """What is wrong with ``chunks`` (``(offsets, sizes)`` pairs) as a tiling of a tensor of
    shape ``size``, or None when they cover every element exactly once.

    The problem names the first uncovered or doubly covered box (as ``[lo:hi, ...]``), or
    the chunk that is out of bounds.
    """
    ndim = len(size)
    for i, (offsets, sizes) in enumerate(chunks):
        if len(offsets) != ndim or len(sizes) != ndim:
            return (f"chunk {i} has {len(offsets)} offsets and {len(sizes)} sizes for a tensor of {ndim} "
                    "dimensions")
        ends = [o + s for o, s in zip(offsets, sizes)]
        if any(e > n for e, n in zip(ends, size)):
            return f"chunk {i} {_ranges(offsets, ends)} reaches outside the tensor's size {list(size)}"
    if math.prod(size) == 0:
        return None  # nothing to cover (chunks of an empty tensor are empty: in bounds is all)
    # Boundaries per dimension (the tensor's own ends included): the grid's cell edges.
    edges = [sorted({0, n, *(o[d] for o, _ in chunks), *(o[d] + s[d] for o, s in chunks)}) for d, n in
             enumerate(size)]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > 4 * len(chunks) + MAX_EXTRA_CELLS:
        return (f"its {len(chunks)} chunks cut it into {cells} pieces, not a grid of shards (tp-fuse writes one "
                "piece per chunk)")
    counts = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for offsets, sizes in chunks:
        if 0 in sizes:
            continue  # an empty shard (a dimension smaller than the TP size) covers nothing
        box = tuple(slice(bisect.bisect_left(e, o), bisect.bisect_left(e, o + s))
                    for e, o, s in zip(edges, offsets, sizes))
        counts[box] += 1
    for wrong, what in ((counts == 0, "is covered by no chunk (it would keep whatever memory it held)"),
                        (counts > 1, "is covered by more than one chunk")):
        if bool(wrong.any()):
            cell = [int(i) for i in wrong.nonzero()[0]]
            lo = [edges[d][c] for d, c in enumerate(cell)]
            hi = [edges[d][c + 1] for d, c in enumerate(cell)]
            return f"{_ranges(lo, hi) if ndim else 'its only element'} {what}"
    return None
