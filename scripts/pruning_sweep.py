"""Pruning-level sweep on a teacher: conventional vs SlimWise (handoff) vs reverse at several pruning ratios.

    python scripts/pruning_sweep.py                               # shipped teacher, REAP, 12.5/25/37.5/50%
    python scripts/pruning_sweep.py --criterion mass --per-family 200 --teacher <folder>
    python scripts/pruning_sweep.py --criterion reap,mass         # both criteria, one plot with both

Per criterion: scores experts once (cached), writes a keep set per ratio with `python -m slimwise_train.prune`,
then runs `python -m slimwise_train.eval` on all keep sets; the table lands in
outputs/sweep/<criterion>/eval/report.md and accuracy against pruning ratio (one line per mode) in
outputs/sweep/<criterion>/accuracy_vs_ratio.png. With several criteria, outputs/sweep/accuracy_vs_ratio.png has
them all (line style per criterion). `--plot-only` redraws the plots from the eval results already there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "sweep"


def plot(results_by_criterion: dict[str, dict], out: Path) -> list[Path]:
    """accuracy_vs_ratio.png per criterion (in its folder) and, for several, one with all of them in `out`."""
    from slimwise_train.eval.plots import plot_accuracy_vs_ratio

    written = []
    for criterion, results in results_by_criterion.items():
        path = out / criterion / "accuracy_vs_ratio.png"
        plot_accuracy_vs_ratio({criterion: results}, path)
        written.append(path)
    if len(results_by_criterion) > 1:
        path = out / "accuracy_vs_ratio.png"
        plot_accuracy_vs_ratio(results_by_criterion, path)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--criterion", default="reap", help="one criterion or a comma list (e.g. reap,mass)")
    parser.add_argument("--ratios", default="0.125,0.25,0.375,0.5")
    parser.add_argument("--per-family", type=int, default=100)
    parser.add_argument("--teacher", default=None, help="teacher folder (default: the shipped one)")
    parser.add_argument("--modes", default="full,conventional,slimwise,reverse")
    parser.add_argument("--out", type=Path, default=OUT, help=f"sweep folder (default {OUT.relative_to(REPO)})")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the plots from results already there")
    args = parser.parse_args(argv)
    model = ["model=teacher"] + ([f"model.path={args.teacher}"] if args.teacher else [])
    start = time.time()
    results = {}
    for criterion in args.criterion.split(","):
        out = args.out / criterion
        if not args.plot_only:
            keep_sets = []
            for ratio in args.ratios.split(","):
                run_dir = out / f"{criterion}-r{ratio}"
                subprocess.run([sys.executable, "-m", "slimwise_train.prune", *model, f"prune.criterion={criterion}",
                                f"prune.ratio={ratio}", f"hydra.run.dir={run_dir}", "progress=false"], cwd=REPO,
                               check=True)
                keep_sets.append(str(run_dir / "keep_set.json"))
            subprocess.run([sys.executable, "-m", "slimwise_train.eval", *model,
                            f"eval.keep_sets=[{','.join(keep_sets)}]", f"eval.modes=[{args.modes}]",
                            f"eval.num_per_family={args.per_family}", f"hydra.run.dir={out / 'eval'}",
                            "progress=false"], cwd=REPO, check=True)
            print((out / "eval" / "report.md").read_text())
        results_file = out / "eval" / "results.json"
        if not results_file.is_file():
            raise SystemExit(f"pruning_sweep: no {results_file}; run the sweep without --plot-only first")
        results[criterion] = json.loads(results_file.read_text())
    for path in plot(results, args.out):
        print(f"wrote {path}")
    print(f"sweep finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
