"""Benchmark tp_fuse.kernels on a CUDA GPU.

Memory-bound kernels: achieved bandwidth (minimum bytes each kernel must move / time)
as a fraction of the device copy bandwidth measured here with ``x.clone()``, and the
speed-up over the unfused torch reference of the same kernel.
FP8 GEMM: TFLOP/s of the Triton kernel vs ``torch._scaled_mm`` (cuBLASLt, tp_fuse's
default FP8 GEMM on CUDA) vs a bf16 ``torch.mm``, at the GEMMs of a transformer layer
with ``--tokens`` tokens and hidden size ``--gemm-hidden`` (QKV, attention output, fc1,
fc2) and at square-ish shapes (M in ``--gemm-m``, N = K = ``--gemm-nk``), plain and
with the fused bias+GELU epilogue. The "triton/scaled_mm" column is the number that
decides whether the Triton GEMM may become the default (>= 1.0 everywhere).

Every number is the median over ``--repeats`` timed runs after ``--warmup`` runs
(CUDA events around each run). ``--json PATH`` also writes every row as JSON (used by
``tools/gpu_check.py``). Usage::

    python examples/bench_kernels.py [--tokens 16384] [--hidden 8192] [--repeats 50] [--json out.json]

Needs a CUDA GPU and triton; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tp_fuse.kernels import (
    dgelu_dbias,
    dswiglu,
    fp8_gemm,
    gelu_fwd,
    layernorm_fwd,
    quantize,
    record_kernel_paths,
    rmsnorm_fwd,
    swiglu_fwd,
    triton_status,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def memory_bound_cases(tokens: int, hidden: int, device: torch.device):
    """(name, fn(backend), bytes moved) for each kernel at [tokens, hidden] bf16."""
    bf16 = torch.bfloat16
    x = torch.randn(tokens, hidden, device=device, dtype=bf16)
    g = torch.randn(tokens, hidden, device=device, dtype=bf16)
    gh = torch.randn(tokens, hidden // 2, device=device, dtype=bf16)
    w = torch.randn(hidden, device=device, dtype=bf16)
    s = torch.tensor(1.0, device=device)
    n = tokens * hidden
    q = dict(scale=s, fp8_dtype=E4M3)
    # Minimum traffic: bf16 inputs read once (2 B), fp8 outputs written once (1 B).
    return [
        ("quantize bf16->e4m3", lambda be: quantize(x, s, E4M3, backend=be), 3 * n),
        ("quantize +transpose", lambda be: quantize(x, s, E4M3, transpose=True, backend=be), 4 * n),
        ("layernorm -> e4m3", lambda be: layernorm_fwd(x, w, w, 1e-5, **q, backend=be), 3 * n),
        ("rmsnorm -> e4m3", lambda be: rmsnorm_fwd(x, w, 1e-5, **q, backend=be), 3 * n),
        ("gelu -> e4m3", lambda be: gelu_fwd(x, **q, backend=be), 3 * n),
        ("swiglu -> e4m3", lambda be: swiglu_fwd(x, **q, backend=be), 2 * n + n // 2),
        ("dgelu+dbias -> e5m2", lambda be: dgelu_dbias(g, x, scale=s, fp8_dtype=E5M2, backend=be), 5 * n),
        ("dswiglu -> e5m2", lambda be: dswiglu(gh, x, scale=s, fp8_dtype=E5M2, backend=be), 3 * n + n),
    ], x


def bench_memory_bound(tokens, hidden, device, warmup, repeats, backend) -> list[dict]:
    cases, x = memory_bound_cases(tokens, hidden, device)
    rows = []
    copy_ms = median_ms(lambda: x.clone(), device, warmup, repeats)
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    print(f"\nMemory-bound kernels, x = [{tokens}, {hidden}] bf16; device copy (x.clone()): {copy_gbs:,.0f} GB/s")
    print(f"{'kernel':<22}{'path':<10}{'ms':>9}{'GB/s':>9}{'% copy':>8}{'torch ms':>10}{'speed-up':>10}")
    for name, fn, nbytes in cases:
        with record_kernel_paths() as log:
            fn(backend)
        ms = median_ms(lambda: fn(backend), device, warmup, repeats)
        ref_ms = median_ms(lambda: fn("torch"), device, warmup, repeats)
        gbs = nbytes / ms / 1e6
        print(f"{name:<22}{log.last().backend:<10}{ms:>9.3f}{gbs:>9,.0f}{100 * gbs / copy_gbs:>7.0f}%"
              f"{ref_ms:>10.3f}{ref_ms / ms:>9.2f}x")
        rows.append({"kernel": name, "path": log.last().backend, "ms": ms, "gb_per_s": gbs,
                     "fraction_of_copy": gbs / copy_gbs, "copy_gb_per_s": copy_gbs, "torch_ms": ref_ms,
                     "speedup_vs_torch": ref_ms / ms})
    return rows


def transformer_gemm_shapes(tokens: int, hidden: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of the forward GEMMs of one GPT layer (out = x [M, K] @ W[N, K]^T)."""
    return [("qkv", tokens, 3 * hidden, hidden), ("proj", tokens, hidden, hidden),
            ("fc1", tokens, 4 * hidden, hidden), ("fc2", tokens, hidden, 4 * hidden)]


def bench_gemm(shapes, device, warmup, repeats) -> list[dict]:
    """Triton FP8 GEMM vs torch._scaled_mm vs bf16 mm at each (name, M, N, K)."""
    print("\nFP8 GEMM e4m3 x e4m3 -> bf16 (TFLOP/s; scaled_mm = cuBLASLt via torch._scaled_mm, bf16 = torch.mm)")
    print(f"{'shape':<8}{'M':>6}{'N':>7}{'K':>7}{'triton':>8}{'scaled_mm':>10}{'bf16':>7}{'tri/smm':>8}{'smm/bf16':>9}"
          f"{'tri +bias+gelu':>15}{'smm+bias, gelu':>15}  variant")
    rows = []
    for name, m, n, k in shapes:
        a = torch.randn(m, k, device=device).to(E4M3)
        b = torch.randn(n, k, device=device).to(E4M3)
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        sa = torch.tensor(0.5, device=device)
        sb = torch.tensor(0.25, device=device)
        bias = torch.randn(n, device=device, dtype=torch.bfloat16)
        flop = 2.0 * m * n * k
        with record_kernel_paths() as log:
            fp8_gemm(a, b, sa, sb, torch.bfloat16, backend="triton")  # also autotunes
        fp8_gemm(a, b, sa, sb, torch.bfloat16, bias=bias, gelu=True, backend="triton")
        tri = median_ms(lambda: fp8_gemm(a, b, sa, sb, torch.bfloat16, backend="triton"), device, warmup, repeats)
        tri_fused = median_ms(
            lambda: fp8_gemm(a, b, sa, sb, torch.bfloat16, bias=bias, gelu=True, backend="triton"),
            device, warmup, repeats)
        bt = b.t()
        smm = median_ms(lambda: torch._scaled_mm(a, bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                        device, warmup, repeats)
        smm_fused = median_ms(
            lambda: F.gelu(torch._scaled_mm(a, bt, scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16),
                           approximate="tanh"),
            device, warmup, repeats)
        b16t = b16.t()
        bf16 = median_ms(lambda: torch.mm(a16, b16t), device, warmup, repeats)

        def tf(t_ms):
            return flop / t_ms / 1e9

        print(f"{name:<8}{m:>6}{n:>7}{k:>7}{tf(tri):>8.0f}{tf(smm):>10.0f}{tf(bf16):>7.0f}{smm / tri:>7.2f}x"
              f"{bf16 / smm:>8.2f}x{tf(tri_fused):>15.0f}{tf(smm_fused):>15.0f}  {log.last().variant}")
        rows.append({"shape": name, "M": m, "N": n, "K": k, "triton_tflops": tf(tri), "scaled_mm_tflops": tf(smm),
                     "bf16_tflops": tf(bf16), "triton_over_scaled_mm": smm / tri, "scaled_mm_over_bf16": bf16 / smm,
                     "triton_fused_tflops": tf(tri_fused), "scaled_mm_fused_tflops": tf(smm_fused),
                     "triton_variant": log.last().variant})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--gemm-m", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--gemm-nk", type=int, default=4096)
    p.add_argument("--gemm-hidden", type=int, default=4096, help="hidden size of the transformer GEMM shapes")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (none found); the CPU path is the torch reference, "
                 "tested by tests/test_kernels.py")
    ok, detail = triton_status()
    if not ok:
        sys.exit(f"bench_kernels.py needs triton for the fused kernels: {detail}")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {detail}; "
          f"median of {args.repeats} after {args.warmup} warm-up runs")
    memory = bench_memory_bound(args.tokens, args.hidden, device, args.warmup, args.repeats, "triton")
    shapes = transformer_gemm_shapes(args.tokens, args.gemm_hidden)
    shapes += [("square", m, args.gemm_nk, args.gemm_nk) for m in args.gemm_m]
    gemm = bench_gemm(shapes, device, args.warmup, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": detail,
                       "repeats": args.repeats, "memory_bound": memory, "fp8_gemm": gemm}, f, indent=1)


if __name__ == "__main__":
    main()
