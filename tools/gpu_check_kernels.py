"""Triton kernels vs the torch path on the same inputs (step 3 of ``tools/gpu_check.py``).

For each kernel: run it with ``backend="triton"`` and ``backend="torch"`` and compare.

* ``quantize`` (cast + amax + transpose): FP8 bytes must be identical (the cast of the
  same fp32 values is exact in both), amax identical. This is the "bit-exact" claim.
* fused norm / activation kernels with FP8 output: the fp32 math before the cast may
  differ in the last bit (different operation order), so the report gives the fraction
  of bit-identical bytes and the largest distance in FP8 steps; pass: <= 1 step
  (the criterion of ``tests/test_kernels.py``), amaxes within fp32 rounding.
* block quantization (``block_quantize``: blockwise, MXFP8, row-wise recipes, both
  layouts): data bytes (NaN positions, not NaN bytes) and scale bytes identical.
* FP8 GEMM: the Triton GEMM against ``torch._scaled_mm`` (relative error; accumulation
  order differs).

NaN: hardware ``cvt.satfinite`` writes NaN as 0x7F for either sign, torch keeps the
sign; NaN positions are compared, their bytes are not. Runs on CUDA; on CPU only with
``TRITON_INTERPRET=1`` set (the tests use that, with small sizes).

Usage: ``python tools/gpu_check_kernels.py [--rows 4096] [--cols 4096] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_fuse.kernels import (  # noqa: E402 - after the repo path
    dgelu_dbias,
    dswiglu,
    fp8_gemm,
    gelu_fwd,
    layernorm_fwd,
    quantize,
    rmsnorm_fwd,
    swiglu_fwd,
)
from tp_fuse.kernels.testing import fp8_ulp_distance  # noqa: E402
from tp_fuse.quantization.op_quantizers import make_quantizer  # noqa: E402
from tp_fuse.recipe import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def compare_fp8(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bit-identical fraction and max FP8-step distance of two FP8 tensors (NaN-aware)."""
    na, nb = a.float().isnan(), b.float().isnan()
    same_nan = bool(torch.equal(na, nb))
    ab, bb = a.view(torch.uint8), b.view(torch.uint8)
    equal = (ab == bb) | (na & nb)
    ulp = fp8_ulp_distance(a, b)
    return {"bit_exact_fraction": equal.float().mean().item(), "max_fp8_steps": int(ulp.max().item()) if ulp.numel() else 0,
            "nan_positions_equal": same_nan}


def _amax_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30)).max().item()


def check_kernels(device: torch.device, rows: int, cols: int, seed: int = 0) -> dict:
    """Every kernel on ``device``: Triton vs torch. Returns the report (``ok`` and per kernel)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3).to(device=device, dtype=torch.bfloat16)
    grad = torch.randn(rows, cols, generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(cols, generator=g).to(device)
    s = torch.tensor(16.0, device=device)
    report: dict = {}

    def run(fn):
        return fn("triton"), fn("torch")

    for fp8 in (E4M3, E5M2):
        t, r = run(lambda be: quantize(x, s, fp8, transpose=True, backend=be))
        res = compare_fp8(t[0], r[0])
        res_t = compare_fp8(t[1], r[1])
        res["amax_equal"] = bool(torch.equal(t[2], r[2]))
        res["ok"] = (res["bit_exact_fraction"] == 1.0 and res_t["bit_exact_fraction"] == 1.0
                     and res["nan_positions_equal"] and res["amax_equal"])
        report[f"quantize+transpose {fp8}"] = res
    fused = {
        "layernorm_fwd e4m3": lambda be: layernorm_fwd(x, w, w, 1e-5, scale=s, fp8_dtype=E4M3, backend=be),
        "rmsnorm_fwd e4m3": lambda be: rmsnorm_fwd(x, w, 1e-5, scale=s, fp8_dtype=E4M3, backend=be),
        "gelu_fwd e4m3": lambda be: gelu_fwd(x, scale=s, fp8_dtype=E4M3, backend=be),
        "swiglu_fwd e4m3": lambda be: swiglu_fwd(x, scale=s, fp8_dtype=E4M3, backend=be),
        "dgelu_dbias e5m2": lambda be: dgelu_dbias(grad, x, scale=s, fp8_dtype=E5M2, backend=be),
        "dswiglu e5m2": lambda be: dswiglu(grad[:, : cols // 2], x, scale=s, fp8_dtype=E5M2, backend=be),
    }
    for name, fn in fused.items():
        t, r = run(fn)
        res = compare_fp8(t[0], r[0])
        res["amax_rel_diff"] = _amax_rel(t[-1], r[-1])
        res["ok"] = res["max_fp8_steps"] <= 1 and res["nan_positions_equal"] and res["amax_rel_diff"] <= 1e-5
        report[name] = res
    for name, recipe in (("blockwise", Float8BlockScaling()), ("mxfp8", MXFP8BlockScaling()),
                         ("rowwise", Float8RowwiseScaling())):
        quantized = {}
        for be in ("triton", "torch"):
            q = make_quantizer(recipe, "input")
            q.backend = be
            quantized[be] = q.quantize(x, transpose=True)
        res = {}
        for which in ("rowwise", "columnwise"):
            pt, pr = quantized["triton"].payload(which), quantized["torch"].payload(which)
            c = compare_fp8(pt.data, pr.data)
            res[f"{which}_bit_exact_fraction"] = c["bit_exact_fraction"]
            res[f"{which}_nan_positions_equal"] = c["nan_positions_equal"]
            res[f"{which}_scales_equal"] = bool(torch.equal(pt.scale_inv.contiguous().view(torch.uint8),
                                                            pr.scale_inv.contiguous().view(torch.uint8)))
        res["ok"] = all(v == 1.0 if k.endswith("fraction") else v for k, v in res.items())
        report[f"block_quantize {name}"] = res
    a = (torch.randn(rows, cols, generator=g) * 8).to(E4M3).to(device)
    b = (torch.randn(cols, cols, generator=g) * 8).to(E4M3).to(device)
    sa, sb = torch.tensor(0.37, device=device), torch.tensor(0.05, device=device)
    yt, _ = fp8_gemm(a, b, sa, sb, torch.float32, backend="triton")
    yr, _ = fp8_gemm(a, b, sa, sb, torch.float32, backend="torch")
    rel = ((yt - yr).abs().max() / yr.abs().max()).item()
    report["fp8_gemm e4m3 fp32-out vs _scaled_mm"] = {"max_rel_diff": rel, "ok": rel <= 1e-5}
    return {"ok": all(v["ok"] for v in report.values()), "device": str(device), "rows": rows, "cols": cols,
            "kernels": report}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    report = check_kernels(torch.device(args.device), args.rows, args.cols)
    for name, res in report["kernels"].items():
        print(f"{name:<40} {'ok ' if res['ok'] else 'BAD'} {json.dumps({k: v for k, v in res.items() if k != 'ok'})}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
