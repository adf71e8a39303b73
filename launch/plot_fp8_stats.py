"""Plot the FP8 scaling statistics of a run: ``python launch/plot_fp8_stats.py <run dir> out.png``.

Reads ``<run dir>/fp8_stats.jsonl`` (written every ``trainer.log_interval`` steps when
FP8 is on) and draws, for one GEMM (default ``layers.0/fc1``), the amax, scale and
quantization MSE of its input, weight and grad_output, plus the underflow % of every
tensor role averaged over all GEMMs of the model. Needs matplotlib (not a dependency
of tp-fuse: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import os
import sys

# `python launch/plot_fp8_stats.py` puts launch/ (not the repository root) on sys.path: take it off
# (launch/logging/ would stand in for the standard library's logging). From a checkout,
# import tp_fuse from this checkout, whose comm/, layers/, launch/ are tp_fuse.comm, .layers,
# .launch (pyproject's package-dir mapping), installed or not.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if "tp_fuse" not in sys.modules and os.path.isfile(os.path.join(_ROOT, "tp_fuse", "__init__.py")):
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "tp_fuse", os.path.join(_ROOT, "tp_fuse", "__init__.py"),
        submodule_search_locations=[os.path.join(_ROOT, "tp_fuse"), _ROOT],
    )
    sys.modules["tp_fuse"] = _tp_fuse = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_tp_fuse)

from tp_fuse.launch.logging.metrics import read_jsonl  # noqa: E402

ROLES = ("input", "weight", "grad_output")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--gemm", default="layers.0/fc1", help="<layer>/<gemm> for the per-GEMM panels")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"plotting needs matplotlib ({exc}): pip install matplotlib") from exc

    records = read_jsonl(os.path.join(args.run_dir, "fp8_stats.jsonl"))
    if not records:
        raise SystemExit(f"{args.run_dir}/fp8_stats.jsonl has no records (was the run trained with fp8=...?)")
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = (("amax", "amax = max |x|", True), ("scale", "scale (x -> FP8)", True), ("mse", "quantization MSE", True))
    for ax, (stat, title, log) in zip(axes.flat, panels):
        for role in ROLES:
            key = f"fp8/{args.gemm}/{role}/{stat}"
            ax.plot(steps, [r[key] for r in records], label=role)
        ax.set_title(f"{args.gemm}: {title}")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for role in ROLES:
        mean = []
        for r in records:
            vals = [v for k, v in r.items() if k.endswith(f"/{role}/underflow_pct")]
            mean.append(sum(vals) / len(vals))
        ax.plot(steps, mean, label=role)
    ax.set_title("underflow % (non-zero -> 0 in FP8), mean over all GEMMs")
    ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    fig.suptitle(f"FP8 scaling statistics: {os.path.basename(os.path.normpath(args.run_dir))}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
