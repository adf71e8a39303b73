"""UserBufferPool: reuse of the same storage, dtype views, growth warning, keys, guards."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tp_fuse.comm import UserBufferPool, symmetric_memory_available, userbuffers
from dist_utils import run_distributed


def test_auto_symmetric_memory_only_over_nccl(monkeypatch) -> None:
    # Regression (first GPU run, H200): "auto" rendezvoused symmetric memory over a gloo
    # group whose two ranks share one GPU, and CUDA refused "overlapping devices".
    monkeypatch.setattr(userbuffers, "symmetric_memory_available", lambda device: True)
    group = object()
    cuda = torch.device("cuda")
    monkeypatch.setattr(userbuffers.dist, "get_backend", lambda g: "gloo")
    assert UserBufferPool()._wants_symmetric(group, cuda) is False
    assert UserBufferPool(use_symmetric_memory=True)._wants_symmetric(group, cuda) is True
    monkeypatch.setattr(userbuffers.dist, "get_backend", lambda g: "nccl")
    assert UserBufferPool()._wants_symmetric(group, cuda) is True
    assert UserBufferPool(use_symmetric_memory=False)._wants_symmetric(group, cuda) is False


def test_symmetric_memory_is_never_claimed_on_cpu() -> None:
    assert symmetric_memory_available("cpu") is False
    with pytest.raises(ValueError, match="use_symmetric_memory"):
        UserBufferPool(use_symmetric_memory="yes")  # type: ignore[arg-type]


def _pool_cases(rank: int, world: int) -> None:
    world_group = dist.group.WORLD
    pool = UserBufferPool()
    a = pool.get(world_group, "ws", (4, 8), torch.float32, "cpu")
    assert a.shape == (4, 8) and a.dtype == torch.float32 and a.is_contiguous()
    a.fill_(float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = pool.get(world_group, "ws", (4, 8), torch.float32, "cpu")
        assert b.data_ptr() == a.data_ptr(), "same request must return the same storage"
        assert torch.equal(b, torch.full((4, 8), float(rank + 1))), "contents must persist"
        # smaller and differently typed requests (FP8 bytes) view the same storage
        c = pool.get(world_group, "ws", (16,), torch.uint8, "cpu")
        d = pool.get(world_group, "ws", (2, 3), torch.float64, "cpu")
        assert c.data_ptr() == a.data_ptr() == d.data_ptr()
        assert pool.get(None, "ws", (4, 8), torch.float32, "cpu").data_ptr() == a.data_ptr()  # None = WORLD
        e = pool.get(world_group, "other", (4, 8), torch.float32, "cpu")
        assert e.data_ptr() != a.data_ptr(), "different names must not alias"
        z = pool.get(world_group, "empty", (0, 5), torch.float32, "cpu")
        assert z.shape == (0, 5)
    assert not [w for w in caught if "UserBufferPool" in str(w.message)], [str(w.message) for w in caught]
    assert pool.registered_bytes(world_group, "ws", "cpu") == 4 * 8 * 4

    # growth: exactly one warning naming the buffer, old and new size; then reuse
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        big = [pool.get(world_group, "ws", (10, 8), torch.float32, "cpu") for _ in range(3)]
        big.append(pool.get(world_group, "ws", (9, 8), torch.float32, "cpu"))
    msgs = [str(w.message) for w in caught if "UserBufferPool" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "'ws'" in msgs[0] and "128" in msgs[0] and "320" in msgs[0], msgs[0]
    assert len({t.data_ptr() for t in big}) == 1
    assert pool.registered_bytes(world_group, "ws", "cpu") == 320

    # reserve() registers the largest size up front: no warning later
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool.reserve(world_group, "reserved", 1024, "cpu")
        r = pool.get(world_group, "reserved", (256,), torch.float32, "cpu")
    assert not [w for w in caught if "UserBufferPool" in str(w.message)]
    assert r.numel() == 256

    # buffers are per group: a sub-group's buffer of the same name is distinct
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates all
    s = pool.get(groups[rank], "ws", (4, 8), torch.float32, "cpu")
    assert s.data_ptr() != a.data_ptr()
    assert pool.total_bytes >= 320 + 1024 + 128

    # guards
    with pytest.raises(ValueError, match="negative dimension"):
        pool.get(world_group, "bad", (2, -1), torch.float32, "cpu")
    with pytest.raises(ValueError, match="symmetric memory is not available on cpu"):
        UserBufferPool(use_symmetric_memory=True).get(world_group, "x", (2,), torch.float32, "cpu")
    assert pool.symmetric_handle(world_group, "ws", "cpu") is None
    n = len(pool)
    pool.clear()
    assert len(pool) == 0 and n > 0
    dist.barrier()


@pytest.mark.multirank
def test_userbuffer_pool_on_two_ranks() -> None:
    run_distributed(2, _pool_cases, timeout=60)
