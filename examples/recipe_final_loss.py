"""Final loss of the default 300-step GPT per low-precision recipe, against fp32.

Runs ``python launch/train.py +model=gpt fp8=<recipe> logger=none`` once per recipe, one
after the other (each run is minutes on CPU), and prints the final training loss, the
last validation loss and the relative difference to the first recipe given (put
``none`` = fp32 first)::

    nice python examples/recipe_final_loss.py none blockwise mxfp8 rowwise
    nice python examples/recipe_final_loss.py --at-step 100 none blockwise   # stop early
    nice python examples/recipe_final_loss.py --from-logs none blockwise     # re-print saved logs

``--at-step N`` stops each run after step N of the same 300-step schedule
(``trainer.exit_at_step=N``) and compares the losses logged at step N (validation runs
every 100 steps).

Each run's stdout is kept in ``--log-dir`` (default ``recipe_runs/``) as ``<recipe>.log``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"step\s+(\d+)/(\d+)\s+loss ([0-9.]+)(?:\s+val ([0-9.]+))?")


def parse(log: str, at_step: int | None = None) -> tuple[int, float, float | None]:
    """(last step, its training loss, last validation loss) from a launcher log, up to
    ``at_step`` when given."""
    last = None
    val = None
    for m in STEP.finditer(log):
        if at_step is not None and int(m.group(1)) > at_step:
            break
        last = (int(m.group(1)), float(m.group(3)))
        if m.group(4):
            val = float(m.group(4))
    if last is None:
        raise ValueError("no 'step N/M loss X' line in the log")
    return last[0], last[1], val


def run(recipe: str, log_dir: str, extra: list[str]) -> str:
    path = os.path.join(log_dir, f"{recipe}.log")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "+model=gpt", f"fp8={recipe}",
           "logger=none", "trainer.progress=false", *extra]
    env = {**os.environ, "PYTHONPATH": ROOT}
    with open(path, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=True, cwd=log_dir)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*", default=["none", "blockwise", "mxfp8", "rowwise"])
    ap.add_argument("--log-dir", default="recipe_runs")
    ap.add_argument("--from-logs", action="store_true", help="only parse <log-dir>/<recipe>.log")
    ap.add_argument("--extra", nargs="*", default=[], help="extra launcher overrides")
    ap.add_argument("--at-step", type=int, default=None, help="stop after this step (trainer.exit_at_step)")
    args = ap.parse_args()
    if args.at_step is not None:
        args.extra = [*args.extra, f"trainer.exit_at_step={args.at_step}"]
    os.makedirs(args.log_dir, exist_ok=True)
    rows = []
    for recipe in args.recipes:
        path = os.path.join(args.log_dir, f"{recipe}.log") if args.from_logs else run(recipe, args.log_dir, args.extra)
        with open(path) as f:
            rows.append((recipe, *parse(f.read(), args.at_step)))
    base = rows[0][2]
    print(f"{'recipe':<10} {'steps':>5} {'final loss':>10} {'vs ' + rows[0][0]:>10} {'val loss':>9}")
    for recipe, step, loss, val in rows:
        rel = (loss - base) / base * 100
        print(f"{recipe:<10} {step:>5} {loss:>10.4f} {rel:>+9.2f}% {val if val is not None else float('nan'):>9.4f}")


if __name__ == "__main__":
    main()
