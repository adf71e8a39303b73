"""PyTorch's symm_mem fused ops on GPUs (part of step 5, ``tp2``, of ``tools/gpu_check.py``).

Run inside the two NCCL ranks of ``tools/gpu_check_tp2.py`` (one GPU each; with fewer than
two GPUs that step is skipped with its reason, and this with it). For each of the four
windows tp_fuse builds (:func:`tp_fuse.overlap.symm_mem.window_call`): AG+GEMM and
GEMM+RS, bf16 and tensor-wise / row-wise FP8, it checks the op's result against the
unfused window (NCCL collective, then the GEMM, or the reverse; same operands) and times
both (median of ``ITERS`` CUDA-synchronized calls after a warm-up). A window whose op
cannot run here reports the reason (``symm_mem_unavailable``) instead of a time.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from tp_fuse.comm import all_gather_dim0
from tp_fuse.ops.basic.all_gather import gather_maybe_fp8
from tp_fuse.overlap import symm_mem as sm
from tp_fuse.quantization import BlockScalingQuantizer, CurrentScalingQuantizer, fp8_gemm
from tp_fuse.recipe import Float8CurrentScaling, Float8RowwiseScaling

SHAPE = dict(M=2048, K=4096, N=4096)  # per-rank rows, reduction dim, output features
ITERS = 10
TOL = {"hp": 2e-2, "tensorwise": 2e-2, "rowwise": 2e-2}  # bf16 outputs: relative to max |ref|


def _median_s(fn) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_symm_mem(group: dist.ProcessGroup, device: torch.device) -> dict:
    """``{"ok": bool, "windows": {"<mode>/<precision>": {"ok", "rel_err", "symm_mem_ms",
    "unfused_ms"} or {"skipped": why}}}``; ``ok`` is False when any window that ran failed
    (a skipped window carries its reason and does not fail the check)."""
    world = dist.get_world_size(group)
    gen = torch.Generator(device=device).manual_seed(11 + dist.get_rank(group))
    M, K, N = SHAPE["M"], SHAPE["K"], SHAPE["N"]
    dtype = torch.bfloat16
    report: dict = {}
    for mode in ("all_gather", "reduce_scatter"):
        for prec in ("hp", "tensorwise", "rowwise"):
            key = f"{mode}/{prec}"
            op = sm.symm_op_for(mode, prec != "hp")
            why = sm.symm_mem_unavailable(op, group, device)
            if why is not None:
                report[key] = {"skipped": why}
                continue
            x = torch.randn(M if mode == "all_gather" else M * world, K, generator=gen, device=device, dtype=dtype)
            w = torch.randn(N, K, generator=gen, device=device, dtype=dtype) / K**0.5
            if prec == "hp":
                a, wq = x, w
                gemm = lambda t: t @ w.t()  # noqa: E731
            else:
                if prec == "tensorwise":
                    qa = CurrentScalingQuantizer(Float8CurrentScaling(), "input", amax_reduction_group=group)
                    qw = CurrentScalingQuantizer(Float8CurrentScaling(), "weight")
                else:
                    qa = BlockScalingQuantizer(Float8RowwiseScaling(), "input")
                    qw = BlockScalingQuantizer(Float8RowwiseScaling(), "weight")
                a, wq = qa.quantize(x), qw.quantize(w)
                gemm = lambda t: fp8_gemm(t, wq, dtype)  # noqa: E731
            call = sm.window_call(mode, a, wq, group_name=sm.group_name_of(group), world_size=world, out_dtype=dtype)
            issues = call.call.violations()
            if issues:
                report[key] = {"ok": False, "violations": issues}
                continue

            if mode == "all_gather":
                def unfused():
                    if prec == "hp":
                        parts = torch.empty(world * M, K, device=device, dtype=dtype)
                        dist.all_gather_into_tensor(parts, a, group=group)
                        return gemm(parts)
                    # FP8 bytes gathered (tensor-wise: one scale on every rank; row-wise: scales too).
                    return gemm(gather_maybe_fp8(a, group, all_gather_dim0))
            else:
                def unfused():
                    full = gemm(a)
                    out = torch.empty(full.shape[0] // world, N, device=device, dtype=full.dtype)
                    dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
                    return out

            try:
                y = call.run()[1]
                ref = unfused()
                rel = float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
                report[key] = {"ok": rel <= TOL[prec], "rel_err": rel,
                               "symm_mem_ms": _median_s(call.run) * 1e3, "unfused_ms": _median_s(unfused) * 1e3}
            except Exception as e:  # noqa: BLE001 - one window's failure is reported, the others still run
                report[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": all(v.get("ok", True) for v in report.values()), "windows": report}
