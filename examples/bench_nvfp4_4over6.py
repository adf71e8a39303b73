"""Quantization error of NVFP4 with and without 4over6, side by side in one run.

Prints ``||dequantize(q(x)) - x|| / ||x||`` for a 1024x1024 standard-normal ``x`` (seed 0)
with plain NVFP4 and 4over6 (both error metrics, both global bounds), 1x16 and 16x16 blocks.

    python examples/bench_nvfp4_4over6.py
"""

from __future__ import annotations

import torch

from tp_fuse.quantization import NVFP4Quantizer


def rel_error(q: NVFP4Quantizer, x: torch.Tensor) -> float:
    d = q(x).dequantize().double()
    return float((d - x.double()).norm() / x.double().norm())


def main() -> None:
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    for two_d in (False, True):
        block = "16x16" if two_d else "1x16"
        plain = rel_error(NVFP4Quantizer(columnwise=False, with_2d_quantization=two_d), x)
        print(f"{block:5s} plain NVFP4            rel. error {plain:.5f}")
        for m in (256, 448):
            for mode in ("MAE", "MSE"):
                q = NVFP4Quantizer(columnwise=False, with_2d_quantization=two_d, nvfp4_use_4over6=True,
                                   nvfp4_e4m3_max=m, nvfp4_4over6_err_mode=mode)
                e = rel_error(q, x)
                print(f"{block:5s} 4over6 M={m} {mode}      rel. error {e:.5f}  ratio to plain {e / plain:.4f}")


if __name__ == "__main__":
    main()
