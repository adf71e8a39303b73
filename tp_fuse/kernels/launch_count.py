"""Count the kernels a step would launch on CUDA, on a CPU.

On a GPU host every launched kernel costs tens of microseconds of Python and launch
overhead, so until a step is captured its launch count *is* its time. The count is
deterministic, so it is measured on CPU and pinned in tests (``test_launch_budget_*``).

How a CPU process follows the CUDA path (``TP_FUSE_SIMULATE_CUDA=1``, read once at
import by :mod:`tp_fuse.strict`; :func:`simulated_cuda_env` gives the whole
environment): CPU tensors take every CUDA branch of tp_fuse (``dispatch.takes_cuda_path``):
Triton kernels are chosen and run in Triton's interpreter (``TRITON_INTERPRET=1``), the
FP8 GEMM is CUDA's ``torch._scaled_mm`` (checked against cuBLASLt's rules; computed by
the exact emulation), the strict-CUDA checks are on. Then :func:`count_launches` counts:

* every Triton kernel call as one launch (the interpreter's ``run``; the wrapper's own
  ATen calls -- allocations, fills -- are counted as ATen ops like any other);
* every ATen op by :data:`ATEN_KERNELS`: views, allocations and metadata launch nothing,
  a few ops launch several kernels on CUDA, every other op one;
* every region marked with :func:`one_launch` (a CUDA kernel whose CPU stand-in is
  several ATen ops, e.g. the ``_scaled_mm`` emulation) as one launch, and every region
  marked :func:`cpu_only` (what only CPU kernels need) as none.

Outside simulation the same counter counts what the process really runs (the CPU path).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tp_fuse.strict import SIMULATE_CUDA_ENV, STRICT_ENV, simulating_cuda

from .dispatch import triton_interpreted

__all__ = ["ATEN_KERNELS", "LaunchCount", "count_launches", "cpu_only", "one_launch", "simulated_cuda_env"]

#: ATen ops that launch no kernel on CUDA: views, metadata, allocations without a fill.
_NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "slice", "select",
    "unsqueeze", "squeeze", "detach", "alias", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "lift_fresh", "_reshape_alias", "unbind", "split", "split_with_sizes",
    "chunk", "narrow", "diagonal", "view_as_real", "view_as_complex", "_conj", "is_same_size",
    "set_", "resize_", "unfold", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "_has_compatible_shallow_copy_type", "_to_copy_noop", "view_as", "numpy_T", "mT", "unflatten",
    "_nested_tensor_size", "record_stream", "is_pinned", "_pin_memory",
})

#: ATen ops that launch more than one kernel on CUDA (torch 2.x kernels).
ATEN_KERNELS: dict[str, int] = {
    # dx kernel + one kernel for dgamma/dbeta (GammaBetaBackward)
    "native_layer_norm_backward": 2,
    "_fused_rms_norm_backward": 2,
    # flash attention backward: the dot(dO, O) preprocess, the main kernel, dq's conversion
    "_scaled_dot_product_flash_attention_backward": 3,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 3,
    "_scaled_dot_product_efficient_attention_backward": 2,
    # sort + segment offsets + the sums (embedding_dense_backward_cuda)
    "embedding_dense_backward": 4,
    # a zero fill of the input's shape, then a copy into the indexed part
    "select_backward": 2,
    "slice_backward": 2,
}

# A device-to-host read: a sync on CUDA (and one copy kernel).
_SYNCS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero"})


def simulated_cuda_env() -> dict[str, str]:
    """The environment variables under which a CPU process follows the CUDA path (set
    them before the process starts: Triton reads ``TRITON_INTERPRET`` at import)."""
    return {SIMULATE_CUDA_ENV: "1", STRICT_ENV: "1", "TRITON_INTERPRET": "1"}


@dataclass
class LaunchCount:
    """Kernels launched by a counted call.

    ``total`` = ``sum(by_kernel.values())``; ``by_kernel`` names ATen ops (``aten.mm``),
    Triton kernels (``triton._quantize_kernel``) and marked regions
    (``cuda._scaled_mm``). ``syncs``: device-to-host reads (each stalls a GPU step).
    ``collectives``: c10d calls (not kernels of this count). ``cuda_path``: counted under
    ``TP_FUSE_SIMULATE_CUDA=1`` (the CUDA path) rather than the CPU path.
    """

    by_kernel: Counter = field(default_factory=Counter)
    syncs: int = 0
    collectives: int = 0
    cuda_path: bool = False

    @property
    def total(self) -> int:
        return sum(self.by_kernel.values())

    def table(self) -> str:
        """One line per kernel, most launched first."""
        rows = [f"{n:4d}  {name}" for name, n in self.by_kernel.most_common()]
        return "\n".join(rows + [f"{self.total:4d}  total ({'CUDA' if self.cuda_path else 'CPU'} path)"])


class _Counter(TorchDispatchMode):
    """Counts ATen ops by :data:`ATEN_KERNELS` while no launch region is open."""

    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _state.suspended:
            name = func.__name__.split(".")[0]
            if func.namespace == "c10d" or func.namespace == "_c10d_functional":
                self.count.collectives += 1
            elif name not in _NO_KERNEL:
                self.count.by_kernel[f"aten.{name}"] += ATEN_KERNELS.get(name, 1)
                if name in _SYNCS:
                    self.count.syncs += 1
        return func(*args, **(kwargs or {}))


class _State(threading.local):
    def __init__(self) -> None:
        self.active: list[LaunchCount] = []
        self.suspended = 0


_state = _State()
# Whether any count is open in the process: the hot-path check of one_launch.
_counting = False


def one_launch(name: str) -> contextlib.AbstractContextManager:
    """Mark a region that is one kernel launch on CUDA (its CPU stand-in may run many
    ATen ops, counted as this one launch). Next to free when no count is open: a shared
    null context (the per-GEMM host path, tests/test_host_path_budget.py)."""
    if not _counting or _state.suspended or not _state.active:
        return _NO_REGION
    return _launch_region(name)


_NO_REGION = contextlib.nullcontext()


@contextlib.contextmanager
def _launch_region(name: str) -> Iterator[None]:
    _state.active[-1].by_kernel[name] += 1
    _state.suspended += 1
    try:
        yield
    finally:
        _state.suspended -= 1


@contextlib.contextmanager
def cpu_only() -> Iterator[None]:
    """Mark a region that the CUDA path does not run: an adaptation of the CPU stand-in to
    a CPU kernel's rules (e.g. aten's CPU LayerNorm backward wants fp32 parameters with a
    bf16 input). Counted as no launch. Free when no count is open."""
    if not _counting or not _state.active:
        yield
        return
    _state.suspended += 1
    try:
        yield
    finally:
        _state.suspended -= 1


def _count_triton_launches() -> contextlib.AbstractContextManager:
    """Count each interpreted Triton kernel call as one launch (the interpreter's own
    tensor copies inside are not kernels of the step)."""
    if not triton_interpreted():
        return contextlib.nullcontext()
    # Triton's interpreter, imported only when it runs the kernels (TRITON_INTERPRET=1).
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if warmup or _state.suspended or not _state.active:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        _state.active[-1].by_kernel[f"triton.{self.fn.__name__}"] += 1
        _state.suspended += 1
        try:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            _state.suspended -= 1

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = original

    return patched()


def count_launches(fn: Callable[[], Any]) -> LaunchCount:
    """Run ``fn()`` once and count the kernels it launches (see the module doc).

    Counts the calling thread (a CPU backward runs there). Under
    ``TP_FUSE_SIMULATE_CUDA=1`` the count is the CUDA path's; otherwise the CPU path's.
    """
    global _counting
    count = LaunchCount(cuda_path=simulating_cuda())
    _state.active.append(count)
    _counting = True
    try:
        with _count_triton_launches(), _Counter(count):
            fn()
    finally:
        _state.active.pop()
        _counting = bool(_state.active)
    return count
