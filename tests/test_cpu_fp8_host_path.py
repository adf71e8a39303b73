"""The CPU FP8 hot path (issue 20): transposed views instead of transposed bytes, decoded
weights kept from fprop to dgrad, the byte-pair decode table, and the per-step op count.

On CPU the FP8 GEMM is an exact emulation that reads any operand layout
(``kernels.fp8_gemm_reads_views``): the backward GEMMs then take ``t()`` views of the
row-wise bytes, the quantizers write no transposed copies, and a weight's decoded values
serve both its fprop and dgrad GEMMs. These tests pin that the results are the same as
with the K-major transposed bytes a GPU needs (strict-CUDA mode takes that path on CPU),
that every cache is invalidated by writes, and that a training step dispatches no more
aten ops than measured (a load-independent guard of the host time).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tp_fuse
from tp_fuse import kernels, ops
from tp_fuse.kernels.fp8_emulation import fp8_to_float
from tp_fuse.quantization import Float8Tensor
from tp_fuse.quantization.float8.delayed_scaling import DelayedScalingQuantizer
from tp_fuse.recipe import DelayedScaling, Float8CurrentScaling
from tp_fuse.strict import STRICT_ENV, strict_cuda_enabled

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Strict-CUDA mode (CI's second pass) replaces the CPU path these tests pin by the GPU's.
pytestmark = pytest.mark.skipif(strict_cuda_enabled(), reason=f"{STRICT_ENV}=1 takes the GPU's layouts")


def _block(hidden: int = 64) -> ops.Sequential:
    torch.manual_seed(0)
    return ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, 4 * hidden), ops.GELU(),
                          ops.Linear(4 * hidden, hidden))


def _steps(seq: ops.Sequential, recipe, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor, list]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, seq[0].weight.shape[0], generator=g, requires_grad=True)
    dy = torch.randn(16, seq[0].weight.shape[0], generator=g)
    for _ in range(steps):
        with tp_fuse.autocast(recipe=recipe):
            y = seq(x)
        y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in seq.parameters()]


@pytest.mark.parametrize("recipe", [DelayedScaling, Float8CurrentScaling], ids=["delayed", "current"])
def test_views_path_equals_the_transposed_bytes_path(recipe, tp_settings):
    """Same outputs and gradients (bit for bit) with views (default CPU) and with the K-major
    transposed bytes strict-CUDA mode makes: the decoded values are the same numbers, and
    torch.mm sums them in the same order for either layout here."""
    assert kernels.fp8_gemm_reads_views(torch.device("cpu"))
    fast = _steps(_block(), recipe())
    tp_settings(**{STRICT_ENV: "1"})
    assert not kernels.fp8_gemm_reads_views(torch.device("cpu"))
    strict = _steps(_block(), recipe())
    torch.testing.assert_close(fast[0], strict[0], rtol=0, atol=0)
    torch.testing.assert_close(fast[1], strict[1], rtol=0, atol=0)
    for a, b in zip(fast[2], strict[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_transposed_bytes_are_written_on_the_views_path():
    q = DelayedScalingQuantizer(DelayedScaling(), "input")
    seq = _block()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(16, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with tp_fuse.autocast(recipe=DelayedScaling()):
            seq(x).sum().backward()
    fp8 = [t for t in saved if isinstance(t, Float8Tensor)]
    assert fp8, "the FP8 GEMM operands are saved for backward"
    assert all(t._transpose is None for t in fp8)
    # The quantizer still writes them when asked (a GPU's GEMM needs them).
    assert q.quantize(torch.randn(8, 16), transpose=True)._transpose is not None


def test_kept_decode_is_shared_with_the_transposed_view_and_invalidated_by_writes():
    q = DelayedScalingQuantizer(DelayedScaling(), "weight")
    w = q.quantize(torch.randn(64, 48))
    w.keep_decoded()
    first = w.decoded()
    assert w.decoded() is first  # kept
    t = w.transposed_view()
    assert t._fp8.data_ptr() == w._fp8.data_ptr() and not t._fp8.is_contiguous()
    assert torch.equal(t.decoded(), first.t())
    # A write through the tensor changes the bytes: neither keeps the stale values.
    w.copy_(torch.randn(64, 48) * 3)
    assert torch.equal(w.decoded(), w._fp8.to(torch.float32))
    assert torch.equal(t.decoded(), t._fp8.to(torch.float32))
    # Assigning other bytes (TE's ``_data``) too.
    w._data = torch.zeros(64, 48, dtype=torch.uint8)
    assert torch.equal(w.decoded(), torch.zeros(64, 48))
    # float64 GEMM outputs read a float64 decode.
    assert w.decoded(torch.float64).dtype == torch.float64


def test_current_amax_slot_follows_the_history_tensor():
    q = DelayedScalingQuantizer(DelayedScaling(), "input")
    slot = q.current_amax
    assert q.current_amax is slot  # made once
    clone = copy.deepcopy(q)
    clone.current_amax.fill_(5.0)
    assert float(clone.amax_history[0]) == 5.0 and float(q.amax_history[0]) == 0.0
    q.amax_history = torch.zeros(q.amax_history.numel())  # rebound (a device move does this)
    q.current_amax.fill_(2.0)
    assert float(q.amax_history[0]) == 2.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_pair_table_decode_is_bit_exact(dtype):
    """The byte-pair table (large e4m3 operands): every one of the 65536 pairs, an odd
    length and an odd storage offset (which cannot be read as int16 pairs)."""
    pairs = torch.arange(65536, dtype=torch.int32).view(torch.uint8).view(-1, 4)[:, :2].reshape(-1).view(dtype)
    for data in (pairs, pairs[1:], pairs[1:-1], pairs.view(256, 512)):
        got, want = fp8_to_float(data), data.to(torch.float32)
        assert got.shape == data.shape
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN payloads too


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


# aten ops per training step of examples/bench_cpu_speed.py's block (hidden 64, 16 tokens),
# measured with torch 2.13: 158 delayed, 202 current (212 and 253 before the views and the
# kept weight decode; 165 and 209 before the backward GEMMs read the decoded operands
# without transposed Float8Tensor views). Delayed: 165 since each cast allocates the
# tensor's scale_inv for the cast kernel to write (one allocation, which on CUDA replaces a
# reciprocal kernel); current: 213 since the quantizer's state is written in place (copies
# into static buffers, which CUDA graphs need, where the state was rebound to new tensors). A bound, not a timing: an accidental extra cast or copy per GEMM
# shows up here on any machine. The CUDA path's launches: test_launch_budget.py.
MAX_OPS = {"delayed": 166, "current": 214}


@pytest.mark.parametrize("name,recipe", [("delayed", DelayedScaling), ("current", Float8CurrentScaling)])
def test_fp8_step_op_count(name, recipe):
    seq, r = _block(), recipe()
    x, dy = torch.randn(16, 64, requires_grad=True), torch.randn(16, 64)

    def step():
        with tp_fuse.autocast(recipe=r):
            y = seq(x)
        y.backward(dy)

    for _ in range(3):
        step()
    with _OpCounter() as counter:
        step()
    assert counter.count <= MAX_OPS[name], f"{counter.count} aten ops per step (bound {MAX_OPS[name]})"
