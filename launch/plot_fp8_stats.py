"""Plot the FP8 scaling statistics of a run: ``python launch/plot_fp8_stats.py <run dir> out.png``.

Reads ``<run dir>/fp8_stats.jsonl`` (written every ``trainer.log_interval`` steps when
``fp8=`` is on and ``fp8.stats=true``) and draws, for one GEMM, a panel per statistic with
its input, weight and grad_output, plus the underflow % of every tensor role averaged over
all GEMMs of the model. Works for every recipe: per-tensor scaling (``delayed``,
``current``: ``amax``, ``scale``, ``mse`` by default) and block scaling (``blockwise``,
``mxfp8``, ``rowwise``, ``nvfp4``: ``amax``, the smallest and largest block ``scale_inv``,
``mse``), and for every model the launcher trains (``layers.0/fc1`` of the GPT; a
``+model=hf`` GEMM such as ``model.model.layers.0/mlp.down_proj._tp.ops.linear``).

``--list`` prints the GEMMs and statistics the file holds. ``--gemm`` takes a full name or
a part that names one GEMM (``--gemm layers.1/mlp.down_proj``); ``--stats`` picks the
panels. Needs matplotlib: ``pip install -e .[plot]``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

# Before any other import: `python launch/plot_fp8_stats.py` puts launch/ on sys.path, where
# launch/logging/ would stand in for the standard library's logging; _tp_fuse_checkout takes
# it off and imports tp_fuse from this checkout (see its docstring).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tp_fuse_checkout import use_checkout  # noqa: E402

use_checkout()

from tp_fuse.launch.logging.metrics import read_jsonl  # noqa: E402

__all__ = ["Fp8Stats", "figure", "main", "plot"]

ROLES = ("input", "weight", "grad_output")
#: Default panels, the first whose statistics the GEMM has: per-tensor, then block scaling.
DEFAULT_PANELS = (("amax", "scale", "mse"), ("amax", "block_scale_inv_min", "block_scale_inv_max", "mse"))
TITLES = {
    "amax": "amax = max |x|",
    "scale": "scale (x -> FP8)",
    "scale_inv": "scale_inv (FP8 -> x)",
    "amax_history_max": "max of the amax history",
    "mse": "quantization MSE",
    "underflow_pct": "underflow % (non-zero -> 0)",
    "overflow_pct": "overflow % (saturated)",
    "block_scale_inv_min": "smallest block scale_inv",
    "block_scale_inv_max": "largest block scale_inv",
    "block_scale_inv_std": "std of the block scale_inv",
    "nonfinite_amax_count": "non-finite amaxes (cumulative)",
}
# A series with at most this many points is drawn with markers too: a single logged step
# (a short run, trainer.log_interval close to trainer.max_steps) is then a visible dot.
_MARKER_POINTS = 50
_KEY = re.compile(r"^fp8/(?P<gemm>.+)/(?P<role>input|weight|grad_output)/(?P<stat>[A-Za-z0-9_]+)$")


def _natural(name: str) -> list:
    """Sort key: ``layers.2`` before ``layers.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _float(v: object) -> float:
    # MetricsSink writes NaN/inf as strings ("nan", "inf"); anything else unplottable is NaN.
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


class Fp8Stats:
    """The records of one ``fp8_stats.jsonl``, indexed by GEMM and statistic.

    Raises ValueError when the file is missing, unreadable or holds no FP8 statistics.
    """

    def __init__(self, run_dir: str) -> None:
        path = os.path.join(run_dir, "fp8_stats.jsonl")
        if not os.path.lexists(path):
            raise ValueError(f"{path}: no such file; expected the run directory of a run trained with fp8=<recipe> "
                             "and fp8.stats=true (it holds metrics.jsonl and fp8_stats.jsonl)")
        self.path = path
        self.records = read_jsonl(path)
        # gemm -> role -> stats present in any record
        self.gemms: dict[str, dict[str, set[str]]] = {}
        for record in self.records:
            for key in record:
                m = _KEY.match(key)
                if m:
                    self.gemms.setdefault(m["gemm"], {}).setdefault(m["role"], set()).add(m["stat"])
        if not self.gemms:
            raise ValueError(f"{path} has {len(self.records)} records and no FP8 statistics "
                             "(fp8/<layer>/<gemm>/<tensor>/<stat>); was the run trained with fp8=<recipe>?")

    def gemm_names(self) -> list[str]:
        return sorted(self.gemms, key=_natural)

    def stats_of(self, gemm: str) -> list[str]:
        return sorted(set().union(*self.gemms[gemm].values()))

    def listing(self) -> str:
        """The GEMMs and, for each, its tensors and statistics (what ``--list`` prints)."""
        lines = [f"{self.path}: {len(self.records)} records, steps "
                 f"{self.records[0]['step']}..{self.records[-1]['step']}, {len(self.gemms)} GEMMs"]
        for gemm in self.gemm_names():
            roles = [r for r in ROLES if r in self.gemms[gemm]]
            lines.append(f"  {gemm}  [{', '.join(roles)}]: {', '.join(self.stats_of(gemm))}")
        return "\n".join(lines)

    def resolve_gemm(self, wanted: str | None) -> str:
        """The GEMM named ``wanted``: its full name or a part only one GEMM's name contains.

        None: ``layers.0/fc1`` if there is one (the GPT's first MLP GEMM), else the first GEMM.
        A name that matches none or several is a ValueError listing what exists.
        """
        names = self.gemm_names()
        if wanted is None:
            return "layers.0/fc1" if "layers.0/fc1" in self.gemms else names[0]
        if wanted in self.gemms:
            return wanted
        matches = [n for n in names if wanted in n]
        if len(matches) == 1:
            return matches[0]
        what = f"matches {len(matches)} GEMMs" if matches else "is not a GEMM"
        raise ValueError(f"--gemm {wanted!r} {what} of {self.path}; expected one of:\n  "
                         + "\n  ".join(matches or names))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of the records that hold ``key``."""
        pairs = [(r["step"], _float(r[key])) for r in self.records if key in r]
        return [s for s, _ in pairs], [v for _, v in pairs]


def _draw(ax, steps: list[int], values: list[float], label: str, **kw) -> None:
    marker = "o" if len(steps) <= _MARKER_POINTS else None
    ax.plot(steps, values, label=label, marker=marker, markersize=3, **kw)


def _log_if_positive(ax, values: list[float]) -> None:
    # A log axis shows amax/scale/MSE over decades, but hides zeros (MSE 0 of an exact tensor).
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0:
        ax.set_yscale("log")


def figure(stats: Fp8Stats, gemm: str | None = None, panels: list[str] | None = None, title: str | None = None):
    """``(matplotlib figure, GEMM name)``: the statistics of one GEMM (see :meth:`Fp8Stats.resolve_gemm`).

    ``panels``: statistics, one panel each (None: :data:`DEFAULT_PANELS`); one the GEMM does
    not have is a ValueError listing those it has. Needs matplotlib (imported here: it is
    the optional ``plot`` extra); uses the Agg backend (files only, no display).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = stats.resolve_gemm(gemm)
    have = stats.stats_of(name)
    if panels is None:
        panels = next((list(p) for p in DEFAULT_PANELS if set(p) <= set(have)), have[:3])
    missing = [p for p in panels if p not in have]
    if missing:
        raise ValueError(f"--stats: {', '.join(missing)} not logged for {name} in {stats.path}; "
                         f"it has: {', '.join(have)}")
    n = len(panels) + 1
    cols = 2
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.5 * rows), sharex=True, squeeze=False)
    flat = list(axes.flat)
    for ax, stat in zip(flat, panels):
        values_all: list[float] = []
        for role in ROLES:
            steps, values = stats.series(f"fp8/{name}/{role}/{stat}")
            if steps:
                _draw(ax, steps, values, role)
                values_all += values
        _log_if_positive(ax, values_all)
        ax.set_title(f"{name}: {TITLES.get(stat, stat)}", fontsize=9)
        ax.legend(fontsize=8)
    ax = flat[len(panels)]
    for role in ROLES:
        steps, mean = [], []
        for r in stats.records:
            vals = [_float(v) for k, v in r.items() if k.startswith("fp8/") and k.endswith(f"/{role}/underflow_pct")]
            if vals:
                steps.append(r["step"])
                mean.append(sum(vals) / len(vals))
        if steps:
            _draw(ax, steps, mean, role)
    ax.set_title(f"underflow % (non-zero -> 0), mean over {len(stats.gemms)} GEMMs", fontsize=9)
    ax.legend(fontsize=8)
    for ax in flat[n:]:
        ax.set_visible(False)
    for ax in flat[max(0, n - cols):n]:
        ax.set_xlabel("training step")
        ax.tick_params(labelbottom=True)  # sharex hides the labels of panels above a hidden one
    fig.suptitle(title or f"FP8 scaling statistics: {os.path.basename(os.path.dirname(os.path.abspath(stats.path)))}")
    fig.tight_layout()
    return fig, name


def plot(stats: Fp8Stats, out: str, gemm: str | None = None, panels: list[str] | None = None,
         title: str | None = None) -> str:
    """Write :func:`figure` to ``out`` (format from its extension); returns the GEMM's name."""
    fig, name = figure(stats, gemm, panels, title)
    import matplotlib.pyplot as plt  # after figure() chose the Agg backend

    try:
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return name


def main(argv: list[str] | None = None) -> None:
    """The command line; errors (missing file, unknown GEMM or statistic) exit with a message."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Needs matplotlib: pip install -e .[plot]")
    parser.add_argument("run_dir", help="the run directory (holds fp8_stats.jsonl)")
    parser.add_argument("out", nargs="?", help="the image to write (.png, .pdf, .svg)")
    parser.add_argument("--gemm", default=None,
                        help="<layer>/<gemm>, or a part naming one GEMM (default: layers.0/fc1, else the first)")
    parser.add_argument("--stats", default=None,
                        help="comma-separated statistics, one panel each (default: amax,scale,mse for per-tensor "
                             "recipes; amax,block_scale_inv_min,block_scale_inv_max,mse for block recipes)")
    parser.add_argument("--list", action="store_true", help="print the GEMMs and statistics of the run and exit")
    args = parser.parse_args(argv)
    try:
        stats = Fp8Stats(args.run_dir)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.list:
        print(stats.listing())
        return
    if args.out is None:
        parser.error("the output image is required (or --list)")
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"error: plotting needs matplotlib ({exc}): pip install -e .[plot]") from None
    panels = [s.strip() for s in args.stats.split(",") if s.strip()] if args.stats else None
    try:
        name = plot(stats, args.out, args.gemm, panels)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"wrote {args.out} ({name})")


if __name__ == "__main__":
    main()
