"""Block quantization (both layouts, as a GEMM input with a backward) per recipe and role:
the Triton kernels vs the torch quantizer path, measured side by side in one run.

On CUDA this is the kernels' speed-up. On CPU the Triton kernels only run in the
interpreter (``TRITON_INTERPRET=1``, a testing tool that executes programs one by one
in numpy): the ratio there says how much slower the interpreted kernels are, nothing
about a GPU. Without triton or the interpreter on CPU, only the torch times are printed.

    TRITON_INTERPRET=1 nice python examples/bench_block_quant.py --rows 1024 --cols 512 --repeats 5
    python examples/bench_block_quant.py --device cuda --rows 8192 --cols 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tp_fuse.kernels import dispatch
from tp_fuse.quantization.op_quantizers import make_quantizer
from tp_fuse.recipe import Float8BlockScaling, Float8RowwiseScaling, MXFP8BlockScaling

RECIPES = {"blockwise": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(), "rowwise": Float8RowwiseScaling()}


def _time(fn, repeats: int, sync) -> float:
    fn()  # warm-up (compilation on CUDA)
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(args.rows, args.cols, device=dev).to(getattr(torch, args.dtype))
    triton_ok = dispatch.triton_status()[0] and (dev.type == "cuda" or dispatch.triton_interpreted())
    print(f"x [{args.rows}, {args.cols}] {args.dtype} on {dev}; median of {args.repeats}; "
          f"triton: {'interpreted' if dispatch.triton_interpreted() else 'compiled'}" if triton_ok
          else f"x [{args.rows}, {args.cols}] {args.dtype} on {dev}; Triton cannot run here (torch only)")
    print(f"{'recipe':10s} {'role':12s} {'torch ms':>10s} {'triton ms':>10s} {'triton/torch':>13s}")
    for name, recipe in RECIPES.items():
        for role in ("input", "weight", "grad_output"):
            q = make_quantizer(recipe, role)
            q.backend = "torch"
            t_torch = _time(lambda: q.quantize(x, transpose=True), args.repeats, sync)
            if triton_ok:
                q.backend = "triton"
                t_triton = _time(lambda: q.quantize(x, transpose=True), args.repeats, sync)
                print(f"{name:10s} {role:12s} {t_torch * 1e3:10.2f} {t_triton * 1e3:10.2f} {t_triton / t_torch:13.2f}")
            else:
                print(f"{name:10s} {role:12s} {t_torch * 1e3:10.2f} {'-':>10s} {'-':>13s}")


if __name__ == "__main__":
    main()
